"""How close a quantized model stays to its full-precision self: perplexity on a held-out text and greedy agreement
over the benchmark prompts, for depctl's precisions and, with ``--llama-cpp``, llama.cpp's GGUF quantizations of the
same model on the same text and prompts.

    .venv/bin/python benchmarks/quality.py                                      # SmolLM2: float32, int8, int4
    .venv/bin/python benchmarks/quality.py --model qwen2.5-coder-1.5b-instruct --workload code,grounded
    .venv/bin/python benchmarks/quality.py --llama-cpp $LLAMA_CPP/build/bin \\
        --gguf F32=smol-f32.gguf --gguf Q8_0=smol-q8_0.gguf --gguf Q4_K_M=smol-q4_k_m.gguf

- **Perplexity**: the text is this repository's ``docs/*.md`` (written after every packaged model was trained, so
  held out), tokenized once, cut into windows of ``--ctx`` tokens, and each window's second half scored, as
  llama.cpp's ``llama-perplexity`` scores it; llama.cpp's rows come from that tool on the same file.
- **Greedy agreement**: each prompt (chat template applied) decoded greedily for ``--max-tokens`` tokens; a row gives
  the share of the reference's tokens it reproduces before its first different token, and how many prompts it
  reproduces whole. The reference is depctl's first precision (float32 by default: the packaged GGUF's values
  exactly). llama.cpp's rows come from its server's ``/completion`` with the same prompt tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from depctl.workloads import prompts_dir  # noqa: E402
from depctl_runtime.backends.precision import QUANTIZED, surgery_for  # noqa: E402
from depctl_runtime.model.runner import ModelRunner  # noqa: E402
from depctl_runtime.speculation import EngineConfig, GenerationParams, SpeculativeEngine, generate  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from bench import encode, load  # noqa: E402


def held_out_text() -> str:
    return "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))


@torch.inference_mode()
def perplexity(model, ids: list[int], ctx: int) -> float:
    """exp of the mean negative log-likelihood of each window's second half."""
    nll, count = 0.0, 0
    for start in range(0, len(ids) - ctx + 1, ctx):
        window = torch.tensor([ids[start : start + ctx]])
        logits = model(input_ids=window, use_cache=False).logits[0].float()  # [ctx, vocab]
        half = ctx // 2
        logp = torch.log_softmax(logits[half - 1 : ctx - 1], dim=-1)
        nll -= logp.gather(1, window[0, half:, None]).sum().item()
        count += ctx - half
    return math.exp(nll / count)


def greedy(model, vocab: int, eos: list[int], prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    engine = SpeculativeEngine(
        ModelRunner(model, vocab), None, EngineConfig(num_draft_tokens=0, max_context=4096, eos_token_ids=tuple(eos))
    )
    params = GenerationParams(max_tokens=max_tokens)
    return [[t for out in generate(engine, ids, params) for t in out.token_ids] for ids in prompts]


def agreement(reference: list[list[int]], outputs: list[list[int]]) -> tuple[float, int]:
    """(share of the reference's tokens reproduced before the first difference, prompts reproduced whole)"""
    kept, total, whole = 0, 0, 0
    for ref, out in zip(reference, outputs):
        same = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
        kept += same
        total += len(ref)
        whole += out == ref
    return kept / max(total, 1), whole


def llama_perplexity(binary: Path, gguf: Path, text: Path, ctx: int) -> float:
    out = subprocess.run(
        [str(binary / "llama-perplexity"), "-m", str(gguf), "-f", str(text), "-c", str(ctx), "-t", "2"],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr).group(1))


def llama_greedy(binary: Path, gguf: Path, prompts: list[list[int]], max_tokens: int, eos: list[int]):
    port = 8931
    server = subprocess.Popen(
        [str(binary / "llama-server"), "-m", str(gguf), "-t", "2", "-c", "4096", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(1)
        outputs = []
        for ids in prompts:
            body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0, "top_k": 1, "return_tokens": True}
            body["cache_prompt"] = False
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            tokens = json.load(urllib.request.urlopen(request, timeout=600))["tokens"]
            while tokens and tokens[-1] in eos:  # ours stops before the end token
                tokens.pop()
            outputs.append(tokens)
        return outputs
    finally:
        server.terminate()
        server.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--precisions", default="float32,int8,int4", help="depctl's; the first is the reference")
    parser.add_argument("--workload", default="grounded,chat")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--llama-cpp", type=Path, default=None, help="a llama.cpp build's bin/ directory")
    parser.add_argument("--gguf", action="append", default=[], metavar="LABEL=FILE")
    args = parser.parse_args()
    torch.manual_seed(0)

    model, tokenizer = load(args.model, torch.device("cpu"), torch.float32)
    eos = sorted({tokenizer.eos_token_id} | set(_as_list(model.generation_config.eos_token_id)))
    text = held_out_text()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    prompts = [
        encode(tokenizer, json.loads(line)["prompt"])
        for workload in args.workload.split(",")
        for line in (prompts_dir() / f"{workload}.jsonl").open()
    ]
    print(
        f"{args.model}: {len(ids)} tokens of held-out text ({len(ids) // args.ctx} windows of {args.ctx}), "
        f"{len(prompts)} prompts x {args.max_tokens} greedy tokens",
        file=sys.stderr,
    )
    rows, reference = [], None
    for precision in args.precisions.split(","):
        m = surgery_for(
            load(args.model, torch.device("cpu"), torch.float32)[0], QUANTIZED.get(precision, precision), True
        )
        t0 = time.perf_counter()
        ppl = perplexity(m, ids, args.ctx)
        outputs = greedy(m, len(tokenizer), eos, prompts, args.max_tokens)
        reference = reference or (precision, ppl, outputs)
        rows.append((f"depctl {precision}", ppl, *agreement(reference[2], outputs)))
        print(f"  {precision}: {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    if args.llama_cpp:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as fh:
            fh.write(text)
        for label, path in (g.split("=", 1) for g in args.gguf):
            ppl = llama_perplexity(args.llama_cpp, Path(path), Path(fh.name), args.ctx)
            outputs = llama_greedy(args.llama_cpp, Path(path), prompts, args.max_tokens, eos)
            rows.append((f"llama.cpp {label}", ppl, *agreement(reference[2], outputs)))
    print(f"\n### {args.model}: quality against depctl {reference[0]}\n")
    print("| weights | perplexity | vs reference | greedy tokens kept | prompts identical |")
    print("|---|---|---|---|---|")
    for name, ppl, kept, whole in rows:
        print(f"| {name} | {ppl:.3f} | {ppl / reference[1]:.3f}x | {kept:.1%} | {whole}/{len(prompts)} |")


def _as_list(value) -> list:
    return value if isinstance(value, list) else [] if value is None else [value]


if __name__ == "__main__":
    main()
