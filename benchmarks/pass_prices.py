"""What the policy priced each target pass at when it chose it, against what the pass took: one n-gram deployment in
process, a workload's prompts in a closed loop (``learning.py``'s), every pass logged. Prints, per token count in the
pass, what calibration measured at load, the plain passes' time, and the drafting passes' price and time (medians);
then, per band of batch sizes, the steps the guard compares: plain steps' and drafting steps' tokens a second over
whole steps, what the policy expected of its drafting steps when it chose them (its extra tokens, tempered by
realism, over the pass's price, against a plain pass's price) and where the difference went: the extra tokens
delivered against expected, the pass's time against its price, and the host's time around the pass.

    .venv/bin/python benchmarks/pass_prices.py --clients 16 --workload code --dtype float32
    .venv/bin/python benchmarks/pass_prices.py --clients 4 --workload chat --quantization int4

A plain pass over n tokens is n rows of one token; a drafting pass over n tokens holds fewer rows, each with its drafts.
Calibration times passes at a context of 64 tokens; serving's are longer.
"""

from __future__ import annotations

import argparse
import gc
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
    # as the daemon does after a load: a full collection over a loaded model's objects stalls whichever pass it hits
    gc.collect()
    gc.freeze()
    calibrated = dict(engine.policy.verify_cost.samples)
    prompts = [chat_ids(deployment.tokenizer, [{"role": "user", "content": p}]) for p in workloads.load(args.workload)]

    passes: list[tuple[int, int, float, float]] = []  # (rows, tokens, seconds, the price before it was observed)
    steps: list[dict] = []  # per step: rows, kind, its seconds and tokens, its pass, and what drafting expected
    cost, policy, target = engine.policy.verify_cost, engine.policy, engine.target
    observe_pass, observe_time, observe_drafts, score = (
        cost.observe,
        policy.observe_step_time,
        policy.observe_step,
        target.score,
    )
    rows_now, step = [0], {}

    def scored(row, tokens, trees=None):
        rows_now[0] = len(tokens)
        return score(row, tokens, trees=trees)

    def observed_pass(n, seconds):
        passes.append((rows_now[0], n, seconds, cost(n)))
        step.update(tokens_in_pass=n, pass_seconds=seconds, price=cost(n), plain_price=cost(rows_now[0]))
        observe_pass(n, seconds)

    def observed_drafts(predicted, realised, batch=1):
        step.update(
            expected=sum(policy.realism(kind, batch) * extra for kind, extra in predicted.items()),
            delivered=sum(realised.values()),
        )
        observe_drafts(predicted, realised, batch)

    def observed_step(seconds, batch, emitted=None, kind=None):
        steps.append({**step, "rows": batch, "kind": kind, "seconds": seconds, "emitted": emitted})
        step.clear()
        observe_time(seconds, batch, emitted, kind)

    target.score, cost.observe, policy.observe_step, policy.observe_step_time = (
        scored,
        observed_pass,
        observed_drafts,
        observed_step,
    )
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
    _bands(steps)
    deployment.release()


def _bands(steps: list[dict]) -> None:
    """Per band, plain steps against drafting steps, and the drafting steps' expectation against what they did."""
    bands: dict[int, dict[str, list[dict]]] = {}
    for st in steps:
        kind = "plain" if st["kind"] is None else "draft"
        bands.setdefault(1 << (st["rows"].bit_length() - 1), {"plain": [], "draft": []})[kind].append(st)
    print(
        "\n| batch sizes | plain steps | plain tok/s | plain host ms | drafting steps | drafting vs plain | expected "
        "| extra tokens delivered / expected | pass took / priced | drafting host ms |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def rate(group):
        return sum(s["emitted"] for s in group) / sum(s["seconds"] for s in group)

    def host_ms(group):
        timed = [s for s in group if "pass_seconds" in s]
        return 1000 * statistics.mean(s["seconds"] - s["pass_seconds"] for s in timed) if timed else float("nan")

    for low, kinds in sorted(bands.items()):
        plain, draft = kinds["plain"], kinds["draft"]
        sizes = str(low) if low == 1 else f"{low}-{2 * low - 1}"
        cells = [sizes, str(len(plain)), "-", "-", str(len(draft)), "-", "-", "-", "-", "-"]
        if plain:
            cells[2], cells[3] = f"{rate(plain):.1f}", f"{host_ms(plain):.2f}"
        priced = [s for s in draft if "expected" in s and "price" in s]
        if draft:
            cells[9] = f"{host_ms(draft):.2f}"
            if plain:
                cells[5] = f"{rate(draft) / rate(plain):.2f}x"
        if priced:
            # the rate the policy expected of each drafting step, against a plain step's at the same rows, both priced
            expected = [((s["rows"] + s["expected"]) / s["price"]) / (s["rows"] / s["plain_price"]) for s in priced]
            cells[6] = f"{statistics.mean(expected):.2f}x"
            delivered = sum(s["delivered"] for s in priced) / max(sum(s["expected"] for s in priced), 1e-9)
            cells[7] = f"{delivered:.2f}"
            cells[8] = f"{sum(s['pass_seconds'] for s in priced) / sum(s['price'] for s in priced):.2f}"
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
