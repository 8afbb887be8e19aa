"""Speculative decoding, side by side, in one run: our engine with speculation off and on, and transformers'
own ``generate`` (plain, ``prompt_lookup_num_tokens``, ``assistant_model``) with the same models and settings.

    .venv/bin/python benchmarks/bench.py                                   # SmolLM2, n-gram, both workloads
    .venv/bin/python benchmarks/bench.py --workload chat --max-tokens 96
    .venv/bin/python benchmarks/bench.py --model qwen2.5-coder-1.5b-instruct \\
        --draft qwen2.5-coder-0.5b-instruct --workload code --no-ngram

Batch 1, greedy, chat template applied. Prompts run round-robin over the configurations (each prompt through every
configuration before the next prompt), so drift in machine speed hits all of them alike. Ratios are the numbers
to read; absolute tokens/s on shared machines are not stable. Every output is compared with our plain greedy
decoding ("exact"; with ``--compile both``, an eager row with our eager plain row: compiled and eager kernels round
differently, so each mode is exact against itself).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from depctl import models  # noqa: E402
from depctl.workloads import prompts_dir  # noqa: E402
from depctl_runtime.backends.passes import compile_passes  # noqa: E402
from depctl_runtime.backends.precision import (  # noqa: E402
    QUANTIZED,
    load_dtype,
    pick_device,
    pick_draft_precision,
    pick_dtype,
    quantize_int8,
    surgery_for,
)
from depctl_runtime.model.runner import ModelRunner  # noqa: E402
from depctl_runtime.speculation import (
    DraftModelProposer,
    EngineConfig,
    GenerationParams,
    NgramProposer,
    SpeculativeEngine,
    generate,
)  # noqa: E402


@dataclass
class Result:
    name: str
    method: str  # plain | ngram | draft: which of ours a transformers row is compared with
    ours: bool
    seconds: float = 0.0
    tokens: int = 0
    exact: bool = True
    drafted: int = 0
    accepted: int = 0
    drafts: int = 0
    peak_mb: float | None = None
    outputs: list = field(default_factory=list)
    engine: SpeculativeEngine | None = None  # ours: whose counters give acceptance


def load(ref: str, device, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = models.materialize(models.resolve(ref, "--model"))
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).to(device).eval()
    return model, tokenizer


def encode(tokenizer, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def run_ours(engine: SpeculativeEngine, ids: list[int], max_tokens: int) -> list[int]:
    return [t for out in generate(engine, ids, GenerationParams(max_tokens=max_tokens)) for t in out.token_ids]


def run_hf(model, ids: list[int], max_tokens: int, eos: list[int], **kwargs) -> list[int]:
    input_ids = torch.tensor([ids], device=model.device)
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos[0],
        **kwargs,
    )[0, len(ids) :].tolist()
    while out and out[-1] in eos:  # transformers keeps the EOS token; ours stops before it
        out.pop()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument(
        "--draft", default=None, help="a draft model: adds ours/draft and transformers' assisted generation"
    )
    parser.add_argument("--workload", default="grounded,chat", help="comma-separated: grounded, chat, code")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=8, help="--draft-token-count")
    parser.add_argument("--draft-k", type=int, default=4, help="K for the draft model")
    parser.add_argument(
        "--draft-precision",
        default="auto",
        help="--draft-precision (auto: int8 on CPU); transformers' assisted row gets the same draft, "
        "and a second row with the draft in the target's dtype, as users run it by default",
    )
    parser.add_argument("--ngram", type=int, default=3, help="--ngram-speculation-length")
    parser.add_argument("--no-ngram", action="store_true")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers' rows")
    parser.add_argument("--limit", type=int, default=None, help="first N prompts of each workload")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--quantization",
        default="none",
        choices=["none", "int8", "int4"],
        help="the target's weights as --quantization holds them (transformers' rows keep bf16 weights)",
    )
    parser.add_argument(
        "--no-surgery",
        action="store_true",
        help="run our engine on the models as transformers loads them (no weight-major or split-K linears)",
    )
    parser.add_argument(
        "--no-fuse",
        action="store_true",
        help="keep transformers' forward for our engine (no fused projections, depctl_runtime.model.decoder)",
    )
    parser.add_argument(
        "--compile",
        default="auto",
        choices=["auto", "off", "both"],
        help="our passes: auto = compiled where the loader would compile them (int8 weights on a CPU), "
        "off = eager, both = auto plus eager rows of plain and n-gram decoding in the same run",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()

    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device, args.quantization)
    t0 = time.perf_counter()
    model, tokenizer = load(args.model, device, dtype)
    precision = pick_draft_precision(args.draft_precision, device, dtype) if args.draft else None

    surgery = device.type == "cpu" and not args.no_surgery

    def load_draft(ours: bool = False):
        d = load(args.draft, device, load_dtype(precision))[0]
        if ours and surgery:
            return surgery_for(d, precision, exact=False, fuse=not args.no_fuse)
        return quantize_int8(d) if precision == "int8" else d

    draft = load_draft(ours=True) if args.draft else None
    if surgery:  # what the loader does for a deployment (depctl_runtime.backends.precision.surgery_for)
        target_precision = QUANTIZED.get(args.quantization, str(dtype).removeprefix("torch."))
        model = surgery_for(model, target_precision, exact=True, fuse=not args.no_fuse)
    # transformers' rows get their own copies, as users run them (no module swaps)
    hf_model = None if args.no_hf else load(args.model, device, dtype)[0]
    hf_draft = None if args.no_hf or not args.draft else load_draft()
    # transformers with the draft as it comes (the target's dtype), when ours is held differently
    hf_draft_plain = None
    if hf_draft is not None and precision != str(dtype).removeprefix("torch."):
        hf_draft_plain = load(args.draft, device, dtype)[0]
    print(
        f"loaded in {time.perf_counter() - t0:.1f}s on {device}/{str(dtype).removeprefix('torch.')}"
        f"{', ' + QUANTIZED[args.quantization] if args.quantization in QUANTIZED else ''}, "
        f"{torch.get_num_threads()} threads",
        file=sys.stderr,
    )
    vocab = len(tokenizer)
    eos = sorted({tokenizer.eos_token_id} | set(_as_list(model.generation_config.eos_token_id)))
    config = dict(eos_token_ids=tuple(eos), max_context=8192)

    weights = QUANTIZED.get(args.quantization, str(dtype).removeprefix("torch."))

    def engine(proposer, k, compiled=args.compile != "off"):
        passes = compile_passes(ModelRunner(model, vocab), weights, compiled)  # as the loader: compiled where faster
        e = SpeculativeEngine(passes.target, proposer, EngineConfig(num_draft_tokens=k, **config))
        e.calibrate()
        print(f"ours K={k}: compiled passes {passes.describe()}", file=sys.stderr)
        return e

    plain_engine = engine(None, 0)
    configs: list[tuple[Result, callable]] = [
        (
            Result("ours plain", "plain", True, engine=plain_engine),
            lambda ids: run_ours(plain_engine, ids, args.max_tokens),
        ),
    ]
    if args.compile == "both":  # the same rows through the eager pass, in the same run
        eager_plain = engine(None, 0, compiled=False)
        configs.append(
            (
                Result("ours plain, eager", "plain", True, engine=eager_plain),
                lambda ids: run_ours(eager_plain, ids, args.max_tokens),
            )
        )
        if not args.no_ngram:
            eager_ngram = engine(NgramProposer(args.ngram), args.k, compiled=False)
            configs.append(
                (
                    Result(f"ours ngram n={args.ngram} K={args.k}, eager", "ngram", True, engine=eager_ngram),
                    lambda ids: run_ours(eager_ngram, ids, args.max_tokens),
                )
            )
    if not args.no_hf:
        configs.append(
            (Result("transformers plain", "plain", False), lambda ids: run_hf(hf_model, ids, args.max_tokens, eos))
        )
    if not args.no_ngram:
        ngram_engine = engine(NgramProposer(args.ngram), args.k)
        configs.append(
            (
                Result(f"ours ngram n={args.ngram} K={args.k}", "ngram", True, engine=ngram_engine),
                lambda ids: run_ours(ngram_engine, ids, args.max_tokens),
            )
        )
        if not args.no_hf:
            configs.append(
                (
                    Result(f"transformers prompt lookup K={args.k}", "ngram", False),
                    lambda ids: run_hf(
                        hf_model,
                        ids,
                        args.max_tokens,
                        eos,
                        prompt_lookup_num_tokens=args.k,
                        max_matching_ngram_size=args.ngram,
                    ),
                )
            )
    if draft is not None:
        draft_engine = engine(DraftModelProposer(ModelRunner(draft, vocab)), args.draft_k)
        configs.append(
            (
                Result(f"ours draft K={args.draft_k} ({precision} draft)", "draft", True, engine=draft_engine),
                lambda ids: run_ours(draft_engine, ids, args.max_tokens),
            )
        )
        if not args.no_hf:
            hf_draft.generation_config.num_assistant_tokens = args.draft_k
            configs.append(
                (
                    Result(f"transformers assisted K={args.draft_k} ({precision} draft)", "draft", False),
                    lambda ids: run_hf(hf_model, ids, args.max_tokens, eos, assistant_model=hf_draft),
                )
            )
        if hf_draft_plain is not None:
            hf_draft_plain.generation_config.num_assistant_tokens = args.draft_k
            plain_name = str(dtype).removeprefix("torch.")
            configs.append(
                (
                    Result(f"transformers assisted K={args.draft_k} ({plain_name} draft)", "draft-as-is", False),
                    lambda ids: run_hf(hf_model, ids, args.max_tokens, eos, assistant_model=hf_draft_plain),
                )
            )

    tables = {}
    for workload in args.workload.split(","):
        prompts = [json.loads(line)["prompt"] for line in (prompts_dir() / f"{workload}.jsonl").open()]
        prompts = prompts[: args.limit] if args.limit else prompts
        results = [Result(r.name, r.method, r.ours) for r, _ in configs]
        for _, fn in configs:  # warm-up: lazy initialisation is not what we measure
            fn(encode(tokenizer, "Hello")[:16])
        for i, prompt in enumerate(prompts):
            ids = encode(tokenizer, prompt)
            order = list(range(len(configs)))
            order = order[i % len(order) :] + order[: i % len(order)]  # rotate who goes first
            for j in order:
                _, fn = configs[j]
                res = results[j]
                engine_obj = configs[j][0].engine
                before = _snapshot(engine_obj)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                    torch.cuda.synchronize()
                start = time.perf_counter()
                out = fn(ids)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                res.seconds += time.perf_counter() - start
                res.tokens += len(out)
                res.outputs.append(out)
                res.peak_mb = max(res.peak_mb or 0, _peak_mb(device))
                after = _snapshot(engine_obj)
                if after is not None:
                    res.drafts += after[0] - before[0]
                    res.drafted += after[1] - before[1]
                    res.accepted += after[2] - before[2]
            print(
                f"  [{workload} {i + 1}/{len(prompts)}] "
                + ", ".join(f"{r.name}: {len(r.outputs[-1])} tok" for r in results),
                file=sys.stderr,
            )
        # "exact": the same tokens as our plain decoding through the same pass (eager rows: the eager plain row)
        baselines = {r.name.endswith(", eager"): r.outputs for r in reversed(results) if r.method == "plain" and r.ours}
        for r in results:
            baseline = baselines.get(r.name.endswith(", eager"), results[0].outputs) if r.ours else results[0].outputs
            r.exact = all(o == b for o, b in zip(r.outputs, baseline))
        tables[workload] = results
        print_table(workload, results, args)
    if args.json:
        args.json.write_text(json.dumps({w: summarize(rs) for w, rs in tables.items()}, indent=1))
    return 0 if all(r.exact for rs in tables.values() for r in rs) else 1


def _as_list(x):
    return [] if x is None else (list(x) if isinstance(x, (list, tuple)) else [x])


def _snapshot(engine):
    if engine is None:
        return None
    s = engine.stats
    return (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens)


def _peak_mb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # process peak RSS (Linux: KiB)


def _summary(r: Result, results: list[Result]) -> dict:
    tps = r.tokens / r.seconds if r.seconds else 0.0
    ours_plain = next(x for x in results if x.ours and x.method == "plain")
    base_tps = ours_plain.tokens / ours_plain.seconds
    return {
        "config": r.name,
        "tokens": r.tokens,
        "seconds": round(r.seconds, 2),
        "tok_s": round(tps, 2),
        "vs_ours_plain": round(tps / base_tps, 3),
        # for our rows: ratio to transformers doing the same method; for transformers' rows: blank
        "vs_transformers": None,
        "acceptance": round(r.accepted / r.drafted, 3) if r.drafted else None,
        "mean_accept_len": round(1 + r.accepted / r.drafts, 2) if r.drafts else None,
        "peak_mb": round(r.peak_mb or 0),
        "exact": r.exact,
    }


def summarize(results: list[Result]) -> list[dict]:
    rows = [_summary(r, results) for r in results]
    for row, r in zip(rows, results):
        if r.ours:
            hf = next((x for x in results if not x.ours and x.method == r.method), None)
            if hf is not None and hf.seconds:
                row["vs_transformers"] = round(row["tok_s"] / (hf.tokens / hf.seconds), 3)
    return rows


def print_table(workload: str, results: list[Result], args) -> None:
    rows = summarize(results)
    print(
        f"\n### {workload}: {args.model}"
        + (f" + draft {args.draft}" if args.draft else "")
        + f", {len(results[0].outputs)} prompts, max_tokens {args.max_tokens}, greedy, batch 1\n"
    )
    print(
        "| configuration | tokens | tok/s | vs our plain | vs transformers (same method) | acceptance "
        "| mean accepted length | peak MB | exact |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        vs_hf = "-" if row["vs_transformers"] is None else f"{row['vs_transformers']:.2f}x"
        acc = "-" if row["acceptance"] is None else f"{row['acceptance']:.0%}"
        print(
            f"| {row['config']} | {row['tokens']} | {row['tok_s']:.1f} | {row['vs_ours_plain']:.2f}x | {vs_hf} | "
            f"{acc} | {row['mean_accept_len'] or '-'} | {row['peak_mb']} | {'yes' if row['exact'] else 'NO'} |"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
