"""What a long prompt costs the streams already running: inter-token latency of N decoding requests before and while
a long prompt is read, in process (depctl's engine, no HTTP). Prints p50 and p99 of each phase.

    .venv/bin/python benchmarks/prefill_stall.py                     # SmolLM2 float32, 4 streams, an 8000-token prompt
    .venv/bin/python benchmarks/prefill_stall.py --quantization int4 --prompt-tokens 4096
"""

from __future__ import annotations

import argparse
import statistics
import time

from depctl.spec import DeploymentSpec
from depctl_runtime.backends.loader import load_deployment
from depctl_runtime.speculation import GenerationParams
from depctl_runtime.speculation.scheduler import Scheduler


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=8000)  # SmolLM2 holds 8192 positions
    parser.add_argument("--warm-steps", type=int, default=40)
    args = parser.parse_args()
    spec = DeploymentSpec(id="stall", model=args.model, quantization=args.quantization, max_batch_size=args.streams + 1)
    loaded = load_deployment(spec)
    engine = loaded.engine
    scheduler = Scheduler(engine, args.streams + 1)
    decoding = GenerationParams(max_tokens=100_000, ignore_eos=True)
    for i in range(args.streams):
        scheduler.add(engine.new_sequence([100 + i, 200, 300, 400], decoding))
    last: dict[int, float] = {}
    gaps = {"before": [], "during": []}
    long_seq, phase, steps = None, "before", 0
    while True:
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
        if phase == "done":
            break
        if steps == args.warm_steps:
            prompt = [(i * 7919) % 20000 + 100 for i in range(args.prompt_tokens)]
            long_seq = engine.new_sequence(prompt, GenerationParams(max_tokens=1))
            t_prompt = time.perf_counter()
            scheduler.add(long_seq)
            phase = "during"
    read = time.perf_counter() - t_prompt
    print(f"\n{args.model}, {loaded.target.precision}, {args.streams} streams, a {args.prompt_tokens}-token prompt")
    print("| phase | inter-token p50, ms | p99, ms | p99 / p50 |")
    print("|---|---:|---:|---:|")
    for name, values in gaps.items():
        p50, p99 = statistics.median(values) * 1000, percentile(values, 0.99) * 1000
        print(f"| {name} the long prompt | {p50:.1f} | {p99:.1f} | {p99 / p50:.1f}x |")
    print(f"\nthe prompt took {read:.1f} s to its first token ({args.prompt_tokens / read:.0f} tokens/s)")


if __name__ == "__main__":
    main()
