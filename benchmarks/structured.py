"""Structured outputs under load: JSON extraction from a passage, function calls whose arguments come from the prompt,
and free JSON (the ``structured`` workload), through the ``openai`` client at several concurrencies.

    .venv/bin/python benchmarks/structured.py                               # SmolLM2, depctl only, 1, 8, 16 clients
    .venv/bin/python benchmarks/structured.py --llama-server $LLAMA/build/bin/llama-server --gguf F32=smol-f32.gguf \
        --vllm-python $VLLM/bin/python

Rows, each at every concurrency, greedy, streaming:
- depctl plain, unconstrained: the same prompts without ``response_format`` (the cost of decoding alone);
- depctl plain, constrained: ``response_format`` with speculation off for the request;
- depctl constrained with n-gram, suffix, and grammar-forced drafts only (a deployment without a proposer);
- peers on the same model, with ``response_format``, with and without their own n-gram speculation: llama.cpp's
  server (``--llama-server`` with ``--gguf``) and vLLM's CPU build (``--vllm-python``).

Each row reports aggregate tokens/s, the median request's decode rate, the share of replies that are valid JSON
matching their schema, and the ratio to depctl's constrained plain row at the same concurrency. Servers run one at
a time, so no two share the cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from load import llama_servers, median, start_daemon, start_server, vllm_servers  # noqa: E402

from depctl import models  # noqa: E402
from depctl.spec import DeploymentSpec, NgramSpeculation, NoSpeculation, SuffixSpeculation  # noqa: E402
from depctl.store import SpecStore  # noqa: E402
from depctl.workloads import prompts_dir  # noqa: E402


@dataclass
class Cell:
    requests: int = 0
    tokens: int = 0
    valid: int = 0
    complete: int = 0  # ended by the model (finish_reason "stop"), not cut by max_tokens
    outputs: dict = field(default_factory=dict)  # item index -> text
    seconds: float = 0.0
    decode_rates: list = field(default_factory=list)
    grammar_drafted: int = 0
    grammar_accepted: int = 0

    @property
    def aggregate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def load_items() -> list[dict]:
    return [json.loads(line) for line in (prompts_dir() / "structured.jsonl").read_text().splitlines() if line]


def response_format(item: dict) -> dict:
    if item["schema"] is None:
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": item["kind"], "schema": item["schema"], "strict": True}}


def valid(text: str, schema: dict | None) -> bool:
    import jsonschema

    try:
        value = json.loads(text)
        if schema is None:
            return isinstance(value, dict)
        jsonschema.validate(value, schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def one_request(client, model: str, index: int, item: dict, mode: dict, max_tokens: int, cell: Cell, lock) -> None:
    body = dict(mode.get("extra", {}))
    kwargs = {}
    if mode["constrained"]:
        kwargs["response_format"] = response_format(item)
    first = last = None
    parts, usage, chunks, finish = [], None, 0, None
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": item["prompt"]}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=body,
        **kwargs,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            now = time.perf_counter()
            first, last = first or now, now
            parts.append(chunk.choices[0].delta.content)
            chunks += 1
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if chunk.usage is not None:
            usage = chunk.usage
    tokens = usage.completion_tokens if usage is not None else chunks
    text = "".join(parts)
    spec = ((usage.model_extra or {}).get("speculation") or {}) if usage is not None else {}
    with lock:
        cell.requests += 1
        cell.tokens += tokens
        cell.valid += valid(text, item["schema"])
        cell.complete += finish == "stop"
        cell.outputs[index] = text
        if first is not None and tokens > 1 and last > first:
            cell.decode_rates.append((tokens - 1) / (last - first))
        cell.grammar_drafted += spec.get("grammar_drafted_tokens") or 0
        cell.grammar_accepted += spec.get("grammar_accepted_tokens") or 0


def run_cell(url: str, model: str, items: list[dict], mode: dict, concurrency: int, requests: int, max_tokens: int):
    import openai

    cell, lock = Cell(), threading.Lock()
    counter = iter(range(requests))

    def loop(c: int) -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=900)
        for i in counter:
            index = (i + c) % len(items)
            one_request(client, model, index, items[index], mode, max_tokens, cell, lock)

    threads = [threading.Thread(target=loop, args=(c,)) for c in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cell.seconds = time.perf_counter() - t0
    return cell


def start_depctl(home: Path, args) -> tuple[subprocess.Popen, str]:
    store = SpecStore(home / "deployments")
    common = dict(model=args.model, max_batch_size=max(args.levels))
    store.create(DeploymentSpec(id="grammar", speculation=NoSpeculation(), **common))
    ngram = NgramSpeculation(ngram_length=args.ngram, num_draft_tokens=args.k)
    store.create(DeploymentSpec(id="ngram", speculation=ngram, **common))
    store.create(DeploymentSpec(id="suffix", speculation=SuffixSpeculation(num_draft_tokens=args.k), **common))
    return start_daemon(home, ("grammar", "ngram", "suffix"))


OFF = {"speculation": {"enabled": False}}
DEPCTL_ROWS = [
    ("depctl", "plain, unconstrained", "grammar", {"constrained": False, "extra": OFF}),
    ("depctl", "plain, constrained", "grammar", {"constrained": True, "extra": OFF}),
    ("depctl", "grammar-forced drafts", "grammar", {"constrained": True}),
    ("depctl", "n-gram", "ngram", {"constrained": True}),
    ("depctl", "suffix", "suffix", {"constrained": True}),
]


def overhead(args) -> None:
    """Per output token, constrained against unconstrained plain decoding in this process: each item is first
    decoded under its schema, then without it for exactly as many tokens (``ignore_eos``), so both runs decode the
    same number of tokens at the same context lengths; the decode time (prefill excluded) is compared."""
    from depctl_runtime.backends import Constraint
    from depctl_runtime.backends.loader import load_deployment
    from depctl_runtime.backends.structured import compile_constraint
    from depctl_runtime.speculation import GenerationParams, generate

    loaded = load_deployment(DeploymentSpec(id="overhead", model=args.model, speculation=NoSpeculation()))
    tok, engine = loaded.tokenizer, loaded.engine
    rows = []
    for _ in range(args.repeats):
        for item in load_items():
            text = tok.apply_chat_template(
                [{"role": "user", "content": item["prompt"]}], add_generation_prompt=True, tokenize=False
            )
            ids = tok(text, add_special_tokens=False)["input_ids"]
            grammar = compile_constraint(loaded.grammars, Constraint("json", item["schema"], "response_format"))
            timed = []
            for params in (GenerationParams(max_tokens=args.max_tokens, grammar=grammar, speculate=False), None):
                if params is None:  # unconstrained, as many tokens as the constrained run wrote
                    params = GenerationParams(max_tokens=timed[0][0], ignore_eos=True, speculate=False)
                before = engine.stats.decode_seconds, engine.stats.grammar_seconds
                n = sum(len(o.token_ids) for o in generate(engine, ids, params))
                timed.append((n, engine.stats.decode_seconds - before[0], engine.stats.grammar_seconds - before[1]))
            rows.append(timed)
    (nc, dc, gc), (nu, du, _) = [tuple(map(sum, zip(*runs))) for runs in zip(*rows)]
    print(f"\nPer output token, plain decoding, {args.model}, {len(rows)} requests, {nc} tokens each way\n")
    print("| decoding | decode ms/token | matcher ms/token |")
    print("|---|---|---|")
    print(f"| unconstrained, same lengths | {1000 * du / nu:.2f} | - |")
    print(f"| constrained | {1000 * dc / nc:.2f} ({dc / nc / (du / nu):.3f}x) | {1000 * gc / nc:.3f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--concurrency", default="1,8,16")
    parser.add_argument("--requests", type=int, default=0, help="per cell (default: every item, at least 2 x clients)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--ngram", type=int, default=3)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", help="the peers' precision (depctl uses the auto precision)")
    parser.add_argument("--llama-server", type=Path)
    parser.add_argument("--gguf", action="append", default=[], help="LABEL=FILE.gguf of the same model")
    parser.add_argument("--vllm-python", type=Path)
    parser.add_argument(
        "--overhead",
        action="store_true",
        help="only the per-token cost of a grammar, in process (constrained against unconstrained, same lengths)",
    )
    parser.add_argument("--repeats", type=int, default=2, help="with --overhead: passes over the items")
    args = parser.parse_args()
    if args.overhead:
        overhead(args)
        return 0
    args.levels = [int(x) for x in args.concurrency.split(",")]
    items = load_items()
    model_dir = models.materialize(models.resolve(args.model, "--model"))
    results: dict[tuple[str, str], dict[int, Cell]] = {}

    def measure(name: str, label: str, url: str, model: str, mode: dict) -> None:
        for level in args.levels:
            requests = args.requests or max(len(items), 2 * level)
            run_cell(url, model, items[:2], mode, 1, 2, 16)  # warm-up: compile paths, first grammar
            cell = run_cell(url, model, items, mode, level, requests, args.max_tokens)
            results.setdefault((name, label), {})[level] = cell
            print(
                f"# {name} {label} x{level}: {cell.aggregate:.1f} tok/s, valid {cell.valid}/{cell.requests}",
                file=sys.stderr,
            )

    with tempfile.TemporaryDirectory(prefix="depctl-structured-") as tmp:
        proc, url = start_depctl(Path(tmp), args)
        try:
            for name, label, dep, mode in DEPCTL_ROWS:
                measure(name, label, url, dep, mode)
        finally:
            proc.terminate()
            proc.wait(60)
        peers = []
        for spec in args.gguf:
            label, path = spec.split("=", 1)
            peers += llama_servers(args.llama_server.resolve(), label, Path(path).resolve(), args, max(args.levels))
        if args.vllm_python:
            peers += vllm_servers(args.vllm_python, model_dir, args)
        for name, label, argv, peer_url, env in peers:
            log = Path(tmp) / f"{name.replace(' ', '-')}-{label}.log"
            server = start_server(argv, peer_url, log, env, timeout=900)
            try:
                measure(name, f"{label}, constrained", peer_url, "bench", {"constrained": True})
            finally:
                server.terminate()
                server.wait(60)
    print_table(results, args)
    return 0


def print_table(results, args) -> None:
    base = results.get(("depctl", "plain, constrained"), {})
    levels = args.levels
    head = "| system | decoding |" + "".join(f" x{n} tok/s (vs plain constrained) |" for n in levels)
    head += " valid / complete / requests | same text as plain constrained |"
    print(
        f"\nStructured workload ({len(load_items())} requests: extraction, function calls, free JSON), "
        f"{args.model}, greedy, max_tokens {args.max_tokens}, k={args.k}, n={args.ngram}\n"
    )
    print(head + " median request tok/s (x1) | forced drafts accepted |")
    print("|---|---|" + "---|" * len(levels) + "---|---|---|---|")
    for (name, label), cells in results.items():
        row = f"| {name} | {label} |"
        for n in levels:
            cell, ref = cells.get(n), base.get(n)
            ratio = f" ({cell.aggregate / ref.aggregate:.2f}x)" if cell and ref and ref.aggregate else ""
            row += f" {cell.aggregate:.1f}{ratio} |" if cell else " - |"
        total = sum(c.requests for c in cells.values())
        ok = sum(c.valid for c in cells.values())
        complete = sum(c.complete for c in cells.values())
        same = "-"
        if name == "depctl" and "unconstrained" not in label:  # greedy: every row writes plain constrained's text
            pairs = [(c.outputs, base[n].outputs) for n, c in cells.items() if n in base]
            hits = [text == ref[i] for out, ref in pairs for i, text in out.items() if i in ref]
            same = f"{sum(hits)}/{len(hits)}"
        one = cells.get(levels[0])
        forced = sum(c.grammar_accepted for c in cells.values())
        rate = median(one.decode_rates) if one else float("nan")
        row += f" {ok} / {complete} / {total} | {same} | {rate:.1f} | {forced or '-'} |"
        print(row)


if __name__ == "__main__":
    raise SystemExit(main())
