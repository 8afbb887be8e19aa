"""Load benchmark: the daemon over HTTP, with the ``openai`` client, at several concurrencies, speculation off and
on, through one deployment (a request can ask to decode plainly, so both modes use the same engine).

    .venv/bin/python benchmarks/load.py                                    # SmolLM2, chat + grounded, 1..16 clients
    .venv/bin/python benchmarks/load.py --workload chat --concurrency 1,8 --max-tokens 64

Each concurrency level runs N clients in a closed loop (a client sends its next request when the previous one
ends) over the workload's prompts, streaming, greedy, chat template applied by the server. One table per workload:
aggregate tokens/s, per-request decode tokens/s (median), time to first token (median, p95), acceptance, and the
ratio to plain decoding at the same concurrency. Before the daemon starts and after it stops, the same engine runs
the same prompts in this process, one at a time (the "in-process" line, the mean of both runs, since the machine's
speed drifts): the daemon's single stream should match it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from depctl import models  # noqa: E402
from depctl.spec import DeploymentSpec, NgramSpeculation  # noqa: E402
from depctl.store import SpecStore  # noqa: E402


@dataclass
class Cell:
    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0
    ttft: list = field(default_factory=list)
    decode_rates: list = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0

    @property
    def aggregate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def one_request(client, prompt: str, max_tokens: int, speculate: bool, cell: Cell, lock: threading.Lock) -> None:
    t0 = time.perf_counter()
    first = last = None
    usage = None
    stream = client.chat.completions.create(
        model="bench", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"speculate": speculate},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            now = time.perf_counter()
            first = first or now
            last = now
        if chunk.usage is not None:
            usage = chunk.usage
    tokens = usage.completion_tokens
    spec = (usage.model_extra or {}).get("speculation") or {}
    with lock:
        cell.requests += 1
        cell.tokens += tokens
        if first is not None:
            cell.ttft.append(first - t0)
            if tokens > 1 and last > first:
                cell.decode_rates.append((tokens - 1) / (last - first))
        cell.drafted += spec.get("drafted_tokens") or 0
        cell.accepted += spec.get("accepted_tokens") or 0


def run_cell(url: str, prompts: list[str], concurrency: int, requests: int, max_tokens: int, speculate: bool) -> Cell:
    import openai

    cell, lock = Cell(), threading.Lock()
    counter = iter(range(requests))

    def client_loop(c: int) -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        for i in counter:  # shared iterator: each request index is taken once (next() on a range iterator is atomic)
            one_request(client, prompts[(i + c) % len(prompts)], max_tokens, speculate, cell, lock)

    threads = [threading.Thread(target=client_loop, args=(c,)) for c in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cell.seconds = time.perf_counter() - t0
    return cell


def in_process(spec: DeploymentSpec, prompts: list[str], max_tokens: int) -> tuple[float, int]:
    """The same engine, loaded and run in this process's main thread, one request at a time (plain decoding)."""
    from runtime.engine import GenerationParams
    from runtime.loader import load_deployment

    loaded = load_deployment(spec)
    tok = loaded.tokenizer
    tokens, seconds = 0, 0.0
    for prompt in prompts:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        params = GenerationParams(max_tokens=max_tokens, speculate=False)
        t0 = time.perf_counter()
        tokens += sum(len(o.token_ids) for o in loaded.engine.generate(ids, params))
        seconds += time.perf_counter() - t0
    return tokens / seconds, tokens


def start_daemon(home: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "DEPCTL_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    log = open(home / "daemon.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "runtime", "--port", "0", "--log-level", "warning"], env=env,
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    import httpx

    for _ in range(600):
        try:
            info = json.loads((home / "daemon.json").read_text())
            url = f"http://{info['host']}:{info['port']}"
            if httpx.get(url + "/depctl/v1/deployments/bench", timeout=5).json().get("state") == "READY":
                return proc, url
        except Exception:  # not up yet
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the daemon exited: {(home / 'daemon.log').read_text()[-2000:]}")
        time.sleep(0.5)
    raise RuntimeError("the deployment did not become READY")


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def p95(xs):
    return sorted(xs)[max(0, int(round(0.95 * len(xs))) - 1)] if xs else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--workload", default="chat,grounded")
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument("--requests", type=int, default=0, help="requests per cell (default: max(6, 2 x concurrency))")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ngram", type=int, default=3)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--dtype", default="auto", help="the deployment's --dtype (auto: bfloat16 on CPUs with bf16 "
                        "instructions, else float32)")
    parser.add_argument("--no-in-process", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    workloads = args.workload.split(",")
    prompts = {w: [json.loads(line)["prompt"] for line in (ROOT / "benchmarks" / "prompts" / f"{w}.jsonl").open()]
               for w in workloads}
    spec = DeploymentSpec(id="bench", model=args.model, max_batch_size=max(levels), dtype=args.dtype,
                          speculation=NgramSpeculation(ngram_length=args.ngram, num_draft_tokens=args.k))

    reference = {}
    if not args.no_in_process:
        for w in workloads:
            reference[w] = in_process(spec, prompts[w], args.max_tokens)
            print(f"in-process {w}: {reference[w][0]:.1f} tok/s", file=sys.stderr)
        import gc

        gc.collect()

    home = Path(tempfile.mkdtemp(prefix="depctl-load-"))
    SpecStore(home / "deployments").create(spec)
    proc, url = start_daemon(home)
    results = {}
    try:
        run_cell(url, prompts[workloads[0]][:1], 1, 1, 8, True)  # warm-up
        for w in workloads:
            for i, c in enumerate(levels):
                n = args.requests or max(6, 2 * c)
                order = (False, True) if i % 2 == 0 else (True, False)
                for speculate in order:
                    cell = run_cell(url, prompts[w], c, n, args.max_tokens, speculate)
                    results[(w, c, speculate)] = cell
                    print(f"  [{w} c={c} {'ngram' if speculate else 'plain'}] {cell.aggregate:.1f} tok/s", file=sys.stderr)
    finally:
        proc.terminate()
        proc.wait(30)
    if not args.no_in_process:  # again after the daemon: the machine's speed drifts; the tables use both runs
        for w in workloads:
            again = in_process(spec, prompts[w], args.max_tokens)
            reference[w] = ((reference[w][0] + again[0]) / 2, reference[w][1], reference[w][0], again[0])
    for w in workloads:
        print_table(w, levels, results, reference.get(w), args)
    if args.json:
        args.json.write_text(json.dumps({f"{w}/{c}/{'ngram' if s else 'plain'}": vars(cell) | {"aggregate": cell.aggregate}
                                         for (w, c, s), cell in results.items()}, indent=1))
    return 0


def print_table(workload, levels, results, reference, args) -> None:
    print(f"\n### {workload}: {args.model} ({args.dtype}), n-gram n={args.ngram} K={args.k}, max_tokens {args.max_tokens}, greedy, "
          f"streaming over HTTP\n")
    if reference is not None:
        plain1 = results[(workload, levels[0], False)].aggregate if levels[0] == 1 else None
        ratio = f" (daemon, 1 client: {plain1 / reference[0]:.2f}x of it)" if plain1 else ""
        runs = f" (before the daemon {reference[2]:.1f}, after {reference[3]:.1f})" if len(reference) > 2 else ""
        print(f"Same engine in-process, one request at a time, plain: {reference[0]:.1f} tok/s{runs}{ratio}\n")
    print("| clients | mode | requests | aggregate tok/s | per-request tok/s (median) | TTFT median s | TTFT p95 s | "
          "acceptance | vs plain (same clients) | vs 1 client |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c in levels:
        for speculate in (False, True):
            cell = results[(workload, c, speculate)]
            plain = results[(workload, c, False)].aggregate
            one = results.get((workload, levels[0], speculate))
            acc = f"{cell.accepted / cell.drafted:.0%}" if cell.drafted else "-"
            print(f"| {c} | {'n-gram' if speculate else 'plain'} | {cell.requests} | {cell.aggregate:.1f} | "
                  f"{median(cell.decode_rates):.1f} | {median(cell.ttft):.2f} | {p95(cell.ttft):.2f} | {acc} | "
                  f"{cell.aggregate / plain:.2f}x | {cell.aggregate / one.aggregate:.2f}x |")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
