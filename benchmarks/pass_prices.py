"""What the policy priced each target pass at when it chose it, against what the pass took: one n-gram deployment in
process, a workload's prompts in a closed loop (``learning.py``'s), every pass logged. Prints, per token count in the
pass, what calibration measured at load, the plain passes' time, and the drafting passes' price and time (medians);
then the steps by band of batch sizes, plain and drafting.

    .venv/bin/python benchmarks/pass_prices.py --clients 16 --workload code --dtype float32
    .venv/bin/python benchmarks/pass_prices.py --clients 4 --workload chat --quantization int4

A plain pass over n tokens is n rows of one token; a drafting pass over n tokens holds fewer rows, each with its drafts.
Calibration times passes at a context of 64 tokens; serving's are longer.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--workload", default="code")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("DEPCTL_HOME", tempfile.mkdtemp(prefix="depctl-pass-prices-"))

    from learning import _closed_loop, chat_ids

    from depctl import workloads
    from depctl.spec import DeploymentSpec, NgramSpeculation
    from depctl_runtime.backends.loader import load_deployment
    from depctl_runtime.speculation import GenerationParams, Scheduler

    spec = DeploymentSpec(
        id="prices",
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        max_batch_size=args.clients,
        speculation=NgramSpeculation(ngram_length=3, num_draft_tokens=8),
        prefix_cache_bytes=0,
    )
    deployment = load_deployment(spec)
    engine = deployment.engine
    calibrated = dict(engine.policy.verify_cost.samples)
    prompts = [chat_ids(deployment.tokenizer, [{"role": "user", "content": p}]) for p in workloads.load(args.workload)]

    passes: list[tuple[int, int, float, float]] = []  # (rows, tokens, seconds, the price before it was observed)
    steps: list[tuple[int, str | None]] = []  # (rows, kind)
    cost, policy, target = engine.policy.verify_cost, engine.policy, engine.target
    observe_pass, observe_step, score = cost.observe, policy.observe_step_time, target.score
    rows_now = [0]

    def scored(row, tokens, trees=None):
        rows_now[0] = len(tokens)
        return score(row, tokens, trees=trees)

    def observed_pass(n, seconds):
        passes.append((rows_now[0], n, seconds, cost(n)))
        observe_pass(n, seconds)

    def observed_step(seconds, batch, emitted=None, kind=None):
        steps.append((batch, kind))
        observe_step(seconds, batch, emitted, kind)

    target.score, cost.observe, policy.observe_step_time = scored, observed_pass, observed_step
    params = GenerationParams(max_tokens=args.max_tokens)
    for _ in range(args.runs):
        _closed_loop(engine, Scheduler(engine, args.clients), prompts, args.clients, params)

    by: dict[int, dict[str, list]] = {}
    for rows, n, seconds, price in passes:
        by.setdefault(n, {"plain": [], "draft": []})["plain" if n == rows else "draft"].append((seconds, price))
    print(
        f"{args.model} ({args.dtype}, {args.quantization}), {args.workload}, {args.clients} clients, {args.runs} runs,"
        f" n-gram n=3 K=8"
    )
    print(
        "\n| tokens in the pass | calibrated ms | plain passes | took ms | drafting passes | priced ms | took ms "
        "| priced / took |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in sorted(by):
        plain, draft = by[n]["plain"], by[n]["draft"]
        cal = f"{calibrated[n] * 1000:.2f}" if n in calibrated else "-"
        took_plain = f"{statistics.median(s for s, _ in plain) * 1000:.2f}" if plain else "-"
        if draft:
            priced, took = (statistics.median(x[i] for x in draft) * 1000 for i in (1, 0))
            drafting = f"{len(draft)} | {priced:.2f} | {took:.2f} | {priced / took:.2f}"
        else:
            drafting = "0 | - | - | -"
        print(f"| {n} | {cal} | {len(plain)} | {took_plain} | {drafting} |")
    bands: dict[int, list[int]] = {}
    for batch, kind in steps:
        counts = bands.setdefault(1 << (batch.bit_length() - 1), [0, 0])
        counts[kind is not None] += 1
    print("\n| batch sizes | plain steps | drafting steps |")
    print("|---|---:|---:|")
    for low, (plain, drafting) in sorted(bands.items()):
        print(f"| {low if low == 1 else f'{low}-{2 * low - 1}'} | {plain} | {drafting} |")
    deployment.release()


if __name__ == "__main__":
    main()
