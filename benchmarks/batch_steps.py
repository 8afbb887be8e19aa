"""Where a batch's time goes in one speculative deployment, plain requests against speculating ones: every step by
the guard's band of batch sizes and by kind (plain, free guesses, a draft model's), with the prompts read between
them, so a cell that loses can be traced to the steps that lose it. One table.

    .venv/bin/python benchmarks/batch_steps.py --quantization int4 --workload chat --clients 16
    .venv/bin/python benchmarks/batch_steps.py --clients 8,16 --repeat 4

The deployment is loaded as the daemon loads it (n-gram n=3, K=8 unless given, compiled passes where they pay) and
answers ``2 x clients`` requests of the workload per run (at least every prompt once), queued at once with
``clients`` rows, so a row that finishes takes the next request as a closed loop of clients does. The modes alternate
run by run on one engine: a request either decodes plainly or speculates, as ``benchmarks/load.py`` asks it over
HTTP, so the policy and guard carry over between runs as they do in a daemon. Each step is what the engine reports to
its guard (batch size, tokens, seconds, kind); a prompt read is timed where the scheduler reads it. The output of
both modes is compared. Run on a quiet machine.
"""

from __future__ import annotations

import argparse
import collections
import gc
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--workload", default="chat")
    parser.add_argument("--clients", default="16")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ngram", type=int, default=3)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=4, help="runs per mode and level, the modes alternating")
    parser.add_argument(
        "--no-freeze",
        action="store_true",
        help="leave the loaded model in the garbage collector's reach (the daemon freezes its heap after a load)",
    )
    parser.add_argument(
        "--one-width",
        action="store_true",
        help="a third mode: speculating with one width for every row of the batch, where each row otherwise verifies "
        "its own count of drafts",
    )
    args = parser.parse_args()
    levels = [int(c) for c in args.clients.split(",")]

    from learning import chat_ids, queue_requests

    from depctl import workloads
    from depctl.spec import DeploymentSpec, NgramSpeculation
    from depctl_runtime.backends.loader import load_deployment
    from depctl_runtime.speculation import GenerationParams
    from depctl_runtime.speculation.policy import band
    from depctl_runtime.speculation.scheduler import Scheduler

    spec = DeploymentSpec(
        id="bench",
        model=args.model,
        quantization=args.quantization,
        max_batch_size=max(levels),
        speculation=NgramSpeculation(ngram_length=args.ngram, num_draft_tokens=args.k),
    )
    loaded = load_deployment(spec)
    engine, tokenizer = loaded.engine, loaded.tokenizer
    prompts = [chat_ids(tokenizer, [{"role": "user", "content": p}]) for p in workloads.load(args.workload)]
    steps: list[dict] = []
    _time_steps(engine, steps)
    if not args.no_freeze:  # as the daemon does: a full collection would walk every object of the loaded model
        gc.collect()
        gc.freeze()
    collecting = _time_collections()
    print(
        f"{args.model} {args.quantization}, workload {args.workload!r}, n-gram n={args.ngram} K={args.k}, "
        f"{args.max_tokens} tokens, {args.repeat} runs a mode\n"
    )
    print(
        "| clients | mode | band | kind | steps | rows a step | tokens a step | ms a step | ms proposing "
        "| ms in the pass | tok/s | share of the time |"
    )
    print("|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    modes = ["plain", "speculating"] + (["one width"] if args.one_width else [])
    policy = engine.policy

    def one_width(rows):  # every row verifies up to the width the batch's best single width
        return policy._best(rows, False)[0], rows

    summary = []
    for level in levels:
        kept = {mode: [] for mode in modes}
        wall, tokens, collected = collections.Counter(), collections.Counter(), collections.Counter()
        faults = collections.Counter()  # pages the process touched for the first time: memory the allocator got anew
        steady, steady_tokens = collections.Counter(), collections.Counter()
        outputs = {}
        for r in range(-1, len(modes) * args.repeat):  # run -1 warms the prefix cache and the passes: not counted
            mode = modes[(r + level) % len(modes)]
            params = GenerationParams(max_tokens=args.max_tokens, speculate=mode != "plain")
            if mode == "one width":
                policy._row_drafts = one_width
            else:
                policy.__dict__.pop("_row_drafts", None)
            scheduler = Scheduler(engine, max_batch_size=level)
            got, number = queue_requests(engine, scheduler, prompts, level, params)
            steps.clear()
            t0, gc0, faults0 = time.perf_counter(), collecting[0], resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            steady_until = None  # when the last request was admitted: every row busy until then
            while scheduler.has_work():
                for seq, out in scheduler.step():
                    got[number[seq.id]].extend(out.token_ids)
                if steady_until is None and not scheduler.waiting and scheduler.prefilling is None:
                    steady_until = time.perf_counter(), sum(map(len, got.values()))
            if r < 0:
                continue
            wall[mode] += time.perf_counter() - t0
            collected[mode] += collecting[0] - gc0
            faults[mode] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
            tokens[mode] += sum(map(len, got.values()))
            steady[mode] += steady_until[0] - t0
            steady_tokens[mode] += steady_until[1]
            kept[mode] += steps
            outputs.setdefault(mode, got)
        policy.__dict__.pop("_row_drafts", None)
        rate = {mode: tokens[mode] / wall[mode] for mode in modes}
        busy = {mode: steady_tokens[mode] / steady[mode] for mode in modes}
        after = {mode: 1 - steady[mode] / wall[mode] for mode in modes}
        for mode in modes[1:]:
            summary.append(
                f"{level} clients, {mode}: {rate[mode]:.1f} tok/s against plain {rate['plain']:.1f}, "
                f"{rate[mode] / rate['plain']:.3f}x; until the last request was admitted (every row busy) "
                f"{busy[mode]:.1f} against {busy['plain']:.1f}, {busy[mode] / busy['plain']:.3f}x; after it "
                f"{after[mode]:.0%} of the time against {after['plain']:.0%}; the garbage collector "
                f"{collected[mode] / wall[mode]:.1%} of the time against {collected['plain'] / wall['plain']:.1%}; "
                f"{faults[mode] / tokens[mode]:.1f} page faults a token against "
                f"{faults['plain'] / tokens['plain']:.1f}; "
                f"{'identical output' if outputs['plain'] == outputs[mode] else 'OUTPUT DIFFERS'}"
            )
        for mode, mode_steps in kept.items():
            groups = collections.defaultdict(list)
            for st in mode_steps:
                key = ("prompt", "-") if st["kind"] == "prompt" else (_band_name(band(st["batch"])), st["kind"])
                groups[key].append(st)
            stepped = sum(st["seconds"] for st in mode_steps)
            for key in sorted(groups, key=lambda k: (k[0] == "prompt", k)):
                print(f"| {level} | {mode} | {key[0]} | {key[1]} | " + _row(groups[key], wall[mode]))
            print(f"| {level} | {mode} | all | rest | | | | | | | | {1 - stepped / wall[mode]:.3f} |")
    print()
    print("\n".join(summary))
    loaded.release()


def _band_name(low: int) -> str:
    return "1" if low == 1 else f"{low}-{2 * low - 1}"


def _row(kept: list[dict], whole: float) -> str:
    seconds = sum(s["seconds"] for s in kept)
    tokens = sum(s["tokens"] for s in kept)
    rows = sum(s["batch"] for s in kept)
    proposing = sum(s.get("proposing", 0.0) for s in kept)
    in_pass = sum(s.get("pass", 0.0) for s in kept)
    rate = f"{tokens / seconds:.1f}" if tokens else ""
    return (
        f"{len(kept)} | {rows / len(kept):.2f} | {tokens / len(kept):.2f} | {1000 * seconds / len(kept):.2f}"
        f" | {1000 * proposing / len(kept):.2f} | {1000 * in_pass / len(kept):.2f} | {rate} | {seconds / whole:.3f} |"
    )


def _time_collections() -> list[float]:
    """A one-item list that the garbage collector's time accumulates into, in seconds."""
    total, started = [0.0], [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            total[0] += time.perf_counter() - started[0]

    gc.callbacks.append(on_gc)
    return total


def _time_steps(engine, into: list[dict]) -> None:
    """Append each step as the engine reports it to its guard (``observe_step_time``: seconds, batch size, tokens,
    kind) with the parts of it spent proposing (guesses, planning, the draft model: ``stats.record_step``) and in the
    target's pass (what it reports to its cost model), and each prompt chunk the scheduler reads (``prefill``), to
    ``into``."""
    observe, prefill, record = engine.policy.observe_step_time, engine.prefill, engine.stats.record_step
    passes = engine.policy.verify_cost.observe
    in_pass = [0.0]

    def on_pass(n: int, seconds: float) -> None:  # the step's target pass, before its observe_step_time
        in_pass[0] = seconds
        passes(n, seconds)

    def on_record(draft_s: float, verify_s: float) -> None:  # right after the step's observe_step_time
        into[-1]["proposing"], into[-1]["pass"] = draft_s, in_pass[0]
        record(draft_s, verify_s)

    def on_step(seconds: float, batch: int, emitted=None, kind=None) -> None:
        into.append({"seconds": seconds, "batch": batch, "tokens": emitted or 0, "kind": kind or "plain"})
        observe(seconds, batch, emitted, kind)

    def on_prefill(*args, **kwargs):
        t0 = time.perf_counter()
        out = prefill(*args, **kwargs)
        seconds = time.perf_counter() - t0
        into.append({"seconds": seconds, "pass": seconds, "batch": 1, "tokens": 0, "kind": "prompt"})
        return out

    engine.policy.observe_step_time, engine.prefill, engine.stats.record_step = on_step, on_prefill, on_record
    engine.policy.verify_cost.observe = on_pass


if __name__ == "__main__":
    main()
