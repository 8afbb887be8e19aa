"""A burst at an idle deployment: every client's first request arrives at once. How long each waits for its first
token, with and without a floor on the prompt time an iteration gives while more requests wait than run
(``scheduler.PREFILL_FLOOR``). One table.

    .venv/bin/python benchmarks/burst.py --quantization int4 --workload code --clients 32
    .venv/bin/python benchmarks/burst.py --workload chat,code --clients 16,32 --repeat 4

The deployment is loaded as the daemon loads it; the bursts run in this process, on one engine, the settings
alternating burst by burst. Requests decode plainly (the floor is the prompt side's). Both settings' outputs are
compared. Run on a quiet machine.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--quantization", default="int4")
    parser.add_argument("--workload", default="code")
    parser.add_argument("--clients", default="32")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3, help="bursts per setting, the settings alternating")
    args = parser.parse_args()

    from learning import chat_ids

    from depctl import workloads
    from depctl.spec import DeploymentSpec
    from depctl_runtime.backends.loader import load_deployment
    from depctl_runtime.speculation import GenerationParams
    from depctl_runtime.speculation.scheduler import PREFILL_FLOOR, Scheduler

    levels = [int(c) for c in args.clients.split(",")]
    spec = DeploymentSpec(id="bench", model=args.model, quantization=args.quantization, max_batch_size=max(levels))
    loaded = load_deployment(spec)
    engine, tokenizer = loaded.engine, loaded.tokenizer
    gc.collect()
    gc.freeze()  # as the daemon does after a load
    params = GenerationParams(max_tokens=args.max_tokens)
    settings = {"a share of the step": 0.0, f"a floor of {PREFILL_FLOOR * 1000:.0f} ms": PREFILL_FLOOR}
    print(f"{args.model} {args.quantization}, {args.max_tokens} tokens, greedy, {args.repeat} bursts a setting\n")
    head = "| workload | clients | prompt time an iteration | first token, median s | p95 s | last s | tok/s"
    print(head + " | identical |")
    print("|---|---:|---|---:|---:|---:|---:|---|")
    for workload in args.workload.split(","):
        texts = workloads.load(workload)
        prompts = [chat_ids(tokenizer, [{"role": "user", "content": t}]) for t in texts]
        for clients in levels:
            burst = [prompts[i % len(prompts)] for i in range(clients)]
            kept: dict[str, list] = {name: [] for name in settings}
            outputs: dict[str, list] = {}
            for r in range(args.repeat):
                order = list(settings) if r % 2 == 0 else list(reversed(settings))
                for name in order:
                    first, seconds, tokens, out = _burst(engine, Scheduler, burst, params, clients, settings[name])
                    kept[name].append((first, seconds, tokens))
                    outputs.setdefault(name, out)
                    if out != outputs[name]:
                        outputs[name] = None  # a setting whose bursts differ from one another
            same = len({repr(o) for o in outputs.values()}) == 1 and None not in outputs.values()
            for name, runs in kept.items():
                firsts = sorted(f for first, _, _ in runs for f in first)
                p95 = firsts[min(len(firsts) - 1, int(0.95 * len(firsts)))]
                last = statistics.mean(max(first) for first, _, _ in runs)
                rate = sum(t for _, _, t in runs) / sum(s for _, s, _ in runs)
                print(
                    f"| {workload} | {clients} | {name} | {statistics.median(firsts):.2f} | {p95:.2f} | {last:.2f} "
                    f"| {rate:.1f} | {'yes' if same else '**no**'} |"
                )
            sys.stdout.flush()


def _burst(engine, scheduler_type, prompts, params, rows: int, floor: float):
    """Every prompt queued at once on a fresh scheduler of ``rows`` rows, stepped to the end: each request's seconds
    to its first token, the burst's seconds, its tokens, and each request's output."""
    scheduler = scheduler_type(engine, rows, prefill_floor=floor)
    seqs = [engine.new_sequence(p, params) for p in prompts]
    got = {s.id: [] for s in seqs}
    first: dict[int, float] = {}
    start = time.perf_counter()
    for s in seqs:
        scheduler.add(s)
    while scheduler.has_work():
        for s, o in scheduler.step():
            if o.token_ids and s.id not in first:
                first[s.id] = time.perf_counter() - start
            got[s.id] += o.token_ids
    seconds = time.perf_counter() - start
    return [first[s.id] for s in seqs], seconds, sum(len(t) for t in got.values()), [got[s.id] for s in seqs]


if __name__ == "__main__":
    main()
