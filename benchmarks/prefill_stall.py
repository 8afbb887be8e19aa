"""What a long prompt costs the streams already running: inter-token latency of N decoding requests before and while
a long prompt is read, in process (depctl's engine, no HTTP), with the prompt read a whole chunk before each step (as
depctl once read it) and with the scheduler's share of a step (stopping between parts of layers). Prints p50 and p99.

    .venv/bin/python benchmarks/prefill_stall.py        # SmolLM2 float32, 4 streams, an 8000-token prompt, both ways
    .venv/bin/python benchmarks/prefill_stall.py --quantization int4 --prompt-tokens 4096 --shares 1
    .venv/bin/python benchmarks/prefill_stall.py --shares 1 --narrowest 16,128  # narrower chunks, and whole ones
"""

from __future__ import annotations

import argparse
import statistics
import time

from depctl.spec import DeploymentSpec
from depctl_runtime.backends.loader import load_deployment
from depctl_runtime.speculation import GenerationParams
from depctl_runtime.speculation.scheduler import NARROWEST_CHUNK, PREFILL_SHARE, Scheduler


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run(engine, streams: int, prompt_tokens: int, warm_steps: int, share: float, narrowest: int, seed: int):
    """Gaps between the running streams' tokens before and while the long prompt is read, and its read time."""
    scheduler = Scheduler(engine, streams + 1, prefill_share=share, narrowest_chunk=narrowest)
    decoding = GenerationParams(max_tokens=100_000, ignore_eos=True)
    running = [engine.new_sequence([100 + i, 200, 300, 400], decoding) for i in range(streams)]
    for seq in running:
        scheduler.add(seq)
    last: dict[int, float] = {}
    gaps = {"before": [], "during": []}
    long_seq, phase, steps = None, "before", 0
    while phase != "done":
        for seq, out in scheduler.step():
            now = time.perf_counter()
            if seq is long_seq:
                if out.token_ids:  # its first token: the prompt is read
                    phase = "done"
                continue
            if seq.id in last and out.token_ids and phase != "done":
                gaps[phase].append(now - last[seq.id])
            last[seq.id] = now
        steps += 1
        if steps == warm_steps:
            prompt = [(i * 7919 + seed) % 20000 + 100 for i in range(prompt_tokens)]  # unlike any cached one
            long_seq = engine.new_sequence(prompt, GenerationParams(max_tokens=1))
            t_prompt = time.perf_counter()
            scheduler.add(long_seq)
            phase = "during"
    read = time.perf_counter() - t_prompt
    for seq in running:
        scheduler.cancel(seq)
    while scheduler.has_work():
        scheduler.step()
    return gaps, read


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=8000)  # SmolLM2 holds 8192 positions
    parser.add_argument("--warm-steps", type=int, default=40)
    parser.add_argument(
        "--shares",
        default=f"inf,{PREFILL_SHARE:g}",
        help="prompt work per step, in steps' time, one run each: inf reads a whole chunk before each step",
    )
    parser.add_argument(
        "--narrowest",
        default=f"{NARROWEST_CHUNK}",
        help="narrowest chunk beside streams, one run each per share: 128 keeps whole chunks",
    )
    args = parser.parse_args()
    spec = DeploymentSpec(id="stall", model=args.model, quantization=args.quantization, max_batch_size=args.streams + 1)
    loaded = load_deployment(spec)
    rows = []
    runs = [(float(s), int(n)) for s in args.shares.split(",") for n in args.narrowest.split(",")]
    for seed, (share, narrowest) in enumerate(runs):
        gaps, read = run(loaded.engine, args.streams, args.prompt_tokens, args.warm_steps, share, narrowest, seed)
        rows.append((share, narrowest, gaps, read))
    print(f"\n{args.model}, {loaded.target.precision}, {args.streams} streams, a {args.prompt_tokens}-token prompt")
    print(
        "| prompt work a step | narrowest chunk | streams' gap before, p50 ms | while read: p50 ms | p99 ms | "
        "p99 / p50 while read | prompt read, s | prompt tokens/s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for share, narrowest, gaps, read in rows:
        before = statistics.median(gaps["before"]) * 1000
        p50, p99 = statistics.median(gaps["during"]) * 1000, percentile(gaps["during"], 0.99) * 1000
        name = "a whole chunk" if share == float("inf") else f"{share:g} x a step"
        print(
            f"| {name} | {narrowest} | {before:.1f} | {p50:.1f} | {p99:.1f} | {p99 / p50:.1f}x | {read:.1f} | "
            f"{args.prompt_tokens / read:.0f} |"
        )


if __name__ == "__main__":
    main()
