"""Where one client's time goes in a learning deployment, step by step: plain steps, the index's copies and the head's
drafts, each with its pass, its drafting and its tokens, beside a plain deployment on the same prompts. Three tables.

    .venv/bin/python benchmarks/step_kinds.py --home DIR
    .venv/bin/python benchmarks/step_kinds.py --home DIR --workload chat --repeat 2

``--home`` is a DEPCTL_HOME whose learning deployment ``learning`` has a head (``benchmarks/learning.py --home DIR``
leaves one); nothing is trained or recorded here. Both deployments are loaded as ``benchmarks/learning.py`` loads
them (n-gram n=3 beside the head, K as the CLI gives it, compiled passes where they pay) and answer the held-out
workload one request at a time, greedy, the modes alternating prompt by prompt. Each step of one row is timed apart:
its drafting (the index's lookup, the head's catch-up and forwards, the policy), the target's pass, and the rest
(accepting, bookkeeping); the second table splits the head's steps by how many drafts the confidence cut left to
verify; the third says why the policy drafted nothing in the learning deployment's plain steps (nothing to draft,
every draft cut as too unsure, no width expected to pay, or the guard), then how often the head's first draft was
accepted after a head step that was wholly accepted and after one with a rejection. The output is checked against
plain decoding. Run on a quiet machine.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--home", required=True)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--workload", default="chat")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    os.environ["DEPCTL_HOME"] = args.home

    from learning import chat_ids, load_pair

    from depctl import workloads
    from depctl.spec import default_draft_tokens
    from depctl_runtime.speculation import GenerationParams
    from depctl_runtime.speculation.scheduler import generate

    k = default_draft_tokens("--ngram-speculation-length")
    plain, learning = load_pair(args.model, "none", 16, k)  # as benchmarks/learning.py loads them
    # as the daemon does after a load: a full collection over a loaded model's objects stalls whichever pass it hits
    gc.collect()
    gc.freeze()
    if learning.learner.serving is None:
        raise SystemExit(f"{args.home}: the learning deployment has no head yet (run benchmarks/learning.py first)")
    tokenizer = learning.tokenizer

    held = [chat_ids(tokenizer, [{"role": "user", "content": p}]) for p in workloads.load(args.workload)]
    steps = {"plain": [], "learning": []}
    for name, loaded in (("plain", plain), ("learning", learning)):
        _time_steps(loaded.engine, steps[name])
    params = GenerationParams(max_tokens=args.max_tokens)
    totals, exact = collections.Counter(), True
    starts = set()  # where each request's steps begin in the learning deployment's
    for r in range(args.repeat):
        for prompt in held:
            got = {}
            for name in ("plain", "learning") if r % 2 == 0 else ("learning", "plain"):
                engine = (plain if name == "plain" else learning).engine
                if name == "learning":
                    starts.add(len(steps["learning"]))
                t0 = time.perf_counter()
                got[name] = [t for out in generate(engine, prompt, params) for t in out.token_ids]
                totals[name, "seconds"] += time.perf_counter() - t0
                totals[name, "tokens"] += len(got[name])
            exact &= got["plain"] == got["learning"]
    rates = {name: totals[name, "tokens"] / totals[name, "seconds"] for name in steps}
    print(
        f"{args.model}, held-out workload {args.workload!r} ({len(held)} prompts, {args.max_tokens} tokens, "
        "one client), "
        f"{args.repeat} runs, K={k}: plain {rates['plain']:.1f} tok/s, learning {rates['learning']:.1f} tok/s, "
        f"{rates['learning'] / rates['plain']:.2f}x, {'identical output' if exact else 'OUTPUT DIFFERS'}\n"
    )
    print(
        "| deployment | step | steps | tokens a step | tokens in the pass | drafting ms | pass ms | rest ms | step ms |"
        " tok/s | share of the time |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, kept in steps.items():
        whole = sum(s["seconds"] for s in kept)
        kinds = collections.defaultdict(list)
        for s in kept:
            kinds[s["kind"]].append(s)
        for kind in ("plain", "free", "model"):
            if kinds[kind]:
                print(f"| {name} | {_KINDS[kind]} | " + _row(kinds[kind], whole))
    head = collections.defaultdict(list)
    for s in steps["learning"]:
        if s["kind"] == "model":
            head[s["pass_tokens"] - 1].append(s)
    print("\nthe head's steps by drafts verified (the rest cut as too unsure to pay for)\n")
    print(
        "| drafts verified | steps | tokens a step | tokens in the pass | drafting ms | pass ms | rest ms | step ms |"
        " tok/s | share of the head's time |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    whole = sum(s["seconds"] for group in head.values() for s in group)
    for drafts in sorted(head):
        print(f"| {drafts} | " + _row(head[drafts], whole))
    print("\nthe learning deployment's plain steps: why the policy drafted nothing\n")
    print("| row's proposer | why | steps | share of its plain steps | the row's acceptance estimate | realism |")
    print("|---|---|---:|---:|---:|---:|")
    plain_steps = [s for s in steps["learning"] if s["kind"] == "plain"]
    why = collections.defaultdict(list)
    for s in plain_steps:
        why[s["source"], s["why"]].append(s)
    for (source, reason), kept in sorted(why.items(), key=lambda item: -len(item[1])):
        rates = [s["rate"] for s in kept if s["rate"] is not None]
        realism = [s["realism"] for s in kept if s["realism"] is not None]
        rate = f"{statistics.mean(rates):.2f} ({min(rates):.2f}-{max(rates):.2f})" if rates else "-"
        real = f"{statistics.mean(realism):.2f}" if realism else "-"
        print(f"| {source} | {reason} | {len(kept)} | {len(kept) / len(plain_steps):.2f} | {rate} | {real} |")
    print("\n" + _first_drafts(steps["learning"], starts))
    learning.release()
    plain.release()


def _first_drafts(kept: list[dict], starts: set[int]) -> str:
    """How often the head's first verified draft was accepted, after a head step of the same request whose drafts
    were all accepted and after one with a rejection: what a request's acceptance estimate, kept apart by that
    state, can learn from its own steps."""
    counts, previous = collections.Counter(), None
    for i, s in enumerate(kept):
        if i in starts:
            previous = None
        if s["kind"] != "model" or s["pass_tokens"] < 2:
            continue
        accepted = s["tokens"] - 1
        if previous is not None:
            counts[previous] += 1
            counts[previous, "first"] += accepted >= 1
        previous = "full" if accepted == s["pass_tokens"] - 1 else "rejected"

    def share(state: str) -> str:
        return f"{counts[state, 'first'] / counts[state]:.0%} of {counts[state]}" if counts[state] else "-"

    return (
        f"the head's first verified draft accepted: {share('full')} steps after a head step whose drafts were all "
        f"accepted, {share('rejected')} after one with a rejection"
    )


_KINDS = {"plain": "plain", "free": "the index's copies", "model": "the head's drafts"}


def _row(kept: list[dict], whole: float) -> str:
    seconds = sum(s["seconds"] for s in kept)
    tokens = sum(s["tokens"] for s in kept)

    def ms(key: str) -> str:
        return f"{1000 * statistics.mean(s[key] for s in kept):.2f}"

    return (
        f"{len(kept)} | {tokens / len(kept):.2f} | {statistics.mean(s['pass_tokens'] for s in kept):.2f}"
        f" | {ms('drafting')} | {ms('pass')} | {ms('rest')} | {ms('seconds')} | {tokens / seconds:.1f}"
        f" | {seconds / whole:.2f} |"
    )


def _time_steps(engine, into: list[dict]) -> None:
    """Append each one-row step's parts to ``into``, from what the step reports to its policy and stats: the pass's
    tokens and seconds (``verify_cost``), the whole step's seconds, tokens and kind (``observe_step_time``), and its
    drafting seconds (``stats.record_step``, the last of them in a step)."""
    policy, step = engine.policy, {}
    observe_pass, observe_step, record = policy.verify_cost.observe, policy.observe_step_time, engine.stats.record_step

    def on_pass(n: int, seconds: float) -> None:
        step.update(pass_tokens=n, pass_seconds=seconds)
        observe_pass(n, seconds)

    def on_step(seconds: float, batch: int, emitted=None, kind=None) -> None:
        step.update(seconds=seconds, batch=batch, tokens=emitted, kind=kind or "plain")
        observe_step(seconds, batch, emitted, kind)

    def on_record(drafting: float, after: float) -> None:
        if step.get("batch") == 1 and "pass_seconds" in step:
            into.append(
                {
                    "kind": step["kind"],
                    "tokens": step["tokens"],
                    "pass_tokens": step["pass_tokens"],
                    "drafting": drafting,
                    "pass": step["pass_seconds"],
                    "rest": after - step["pass_seconds"],
                    "seconds": step["seconds"],
                    "source": step.get("source"),
                    "why": step.get("why"),
                    "rate": step.get("rate"),
                    "realism": step.get("realism"),
                }
            )
        step.clear()
        record(drafting, after)

    policy.verify_cost.observe, policy.observe_step_time, engine.stats.record_step = on_pass, on_step, on_record
    _explain_widths(policy, step)


def _explain_widths(policy, step: dict) -> None:
    """Record in ``step`` why a one-row step's policy drafted nothing, from what ``width`` saw: the row's proposer,
    its acceptance estimate and realism, what ``_best`` chose and what the guard allowed."""
    from depctl_runtime.speculation.policy import FREE, MODEL, _clamped

    width, best, allows = policy.width, policy._best, policy.guard.allows
    verdicts = {}

    def on_best(rows, trees):
        chosen = best(rows, trees)
        verdicts["best"] = chosen[0]
        return chosen

    def on_allows(batch, kind):
        verdicts["allowed"] = allowed = allows(batch, kind)
        verdicts["off"] = policy.guard.is_off(batch, kind)
        return allowed

    def on_width(rows, trees=False):
        verdicts.clear()
        chosen = width(rows, trees)
        if len(rows) != 1:
            return chosen
        row = rows[0]
        kind = MODEL if row.model else FREE
        step.update(source="head" if row.model else "index", realism=policy.realism(kind, 1))
        step["rate"] = _clamped(row) if row.available else None
        if not row.available:
            step["why"] = "nothing to draft"
        elif chosen[0]:
            step["why"] = "every draft cut as too unsure"  # kept only if the step ends plain
        elif not verdicts.get("best"):
            step["why"] = "no width expected to pay"
        elif verdicts.get("off"):
            step["why"] = "the guard: measured a loss here"
        elif verdicts.get("allowed") is False:
            step["why"] = "the guard's plain step"
        else:
            step["why"] = "other"
        return chosen

    policy.width, policy._best, policy.guard.allows = on_width, on_best, on_allows


if __name__ == "__main__":
    main()
