"""A draft head's step, eager against compiled: what drafting costs a step, its first position (the catch-up on what
the rows accepted, the first forward) and each forward after it, at a few batch sizes and widths. One table.

    .venv/bin/python benchmarks/head_step.py --head DIR
    .venv/bin/python benchmarks/head_step.py --head $DEPCTL_HOME/learning/<deployment>/head --rows 1,8 --width 1,3

``--head`` is a head's folder (`depctl draft train --out DIR`, or a learning deployment's ``head``). One deployment
of ``--model`` with the head, loaded as the daemon loads it (compiled passes, the head's step compiled beside them);
the same head also drafts through an eager proposer. For each batch size and width, both proposers serve the held-out
workload (``--workload``) at that many clients in process, greedy, every step drafting exactly the width (nothing
cut, so every position's forward runs), the modes alternating prompt set by prompt set. Drafting costs are per step
that drafted; the output is the target's whichever drafts.
"""

from __future__ import annotations

import argparse
import gc
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head", required=True)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--workload", default="chat")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--width", default="1,3")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeat", type=int, default=2, help="runs of each cell, the modes alternating")
    args = parser.parse_args()
    levels = [int(r) for r in args.rows.split(",")]
    widths = [int(w) for w in args.width.split(",")]

    import torch

    from depctl import workloads
    from depctl.spec import DeploymentSpec, DraftModelSpeculation
    from depctl_runtime.backends import eagle
    from depctl_runtime.backends.loader import load_deployment
    from depctl_runtime.speculation import GenerationParams, Scheduler
    from depctl_runtime.speculation.eagle import EagleProposer

    spec = DeploymentSpec(
        id="head-step",
        model=args.model,
        max_batch_size=max(levels),
        prefix_cache_bytes=0,
        speculation=DraftModelSpeculation(draft_model=args.head, num_draft_tokens=max(widths)),
    )
    loaded = load_deployment(spec, calibrate=False)
    # as the daemon does after a load: a full collection over a loaded model's objects stalls whichever pass it hits
    gc.collect()
    gc.freeze()
    tokenizer, engine = loaded.tokenizer, loaded.engine
    compiled = engine.draft_model
    if compiled.compiled is None:
        raise SystemExit(f"the head's step did not compile here: {loaded.compiled}")
    vocab = compiled.vocabulary.size
    modes = {"eager": EagleProposer(compiled.head, max(levels), vocab), "compiled": compiled}
    policy = engine.policy
    engine._draft_threshold = lambda batch: 1e-9  # every position drafted is verified: none is cut
    prompts = []
    for text in workloads.load(args.workload):
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        prompts.append(tokenizer(chat, add_special_tokens=False)["input_ids"])
    greedy = GenerationParams(max_tokens=args.max_tokens)

    def run(proposer, rows: int, width: int) -> dict:
        engine.proposer = engine.draft_model = proposer
        for row in range(max(levels)):  # the engine cut the rows of whichever proposer was serving: not this one's
            proposer.set_length(row, 0)
        policy.width = lambda plans, trees=False: (width, policy.expected(plans, width))
        drafted = {"steps": 0, "seconds": 0.0, "forwards": 0, "forward_seconds": 0.0}
        propose = proposer.propose

        def timed(*a, **k):
            t0 = time.perf_counter()
            made = propose(*a, **k)
            drafted["steps"] += 1
            drafted["seconds"] += time.perf_counter() - t0
            drafted["forwards"] += made.forwards
            drafted["forward_seconds"] += made.forward_seconds
            return made

        proposer.propose = timed
        scheduler = Scheduler(engine, rows)
        tokens = 0
        start = time.perf_counter()
        try:
            outputs = scheduler.run_all([prompts[i % len(prompts)] for i in range(2 * rows)], greedy)
        finally:
            del proposer.propose
        drafted["elapsed"] = time.perf_counter() - start
        tokens = sum(len(o) for o in outputs)
        drafted["tokens"] = tokens
        return drafted

    print(
        f"{args.model}, head {args.head}: {args.workload!r} workload, greedy, {args.max_tokens} tokens, "
        f"2 x rows requests a cell, {args.repeat} runs a mode; torch threads {torch.get_num_threads()}; "
        f"{loaded.compiled}; the head's products at {eagle.HEAD_BITS} bits\n"
    )
    print(
        "| rows | width | step | drafting a step (ms) | first position (ms) | each later forward (ms) | tok/s "
        "| compiled vs eager |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for rows in levels:
        for width in widths:
            totals = {
                name: {"steps": 0, "seconds": 0.0, "forwards": 0, "forward_seconds": 0.0, "elapsed": 0.0, "tokens": 0}
                for name in modes
            }
            for _ in range(args.repeat):
                for name, proposer in modes.items():
                    for key, value in run(proposer, rows, width).items():
                        totals[name][key] += value
            rates = {name: t["tokens"] / t["elapsed"] for name, t in totals.items()}
            for name, t in totals.items():
                per_step = 1000 * t["seconds"] / max(t["steps"], 1)
                later = 1000 * t["forward_seconds"] / t["forwards"] if t["forwards"] else None
                first = per_step - 1000 * t["forward_seconds"] / max(t["steps"], 1)
                ratio = f"{rates[name] / rates['eager']:.2f}x" if name != "eager" else ""
                print(
                    f"| {rows} | {width} | {name} | {per_step:.2f} | {first:.2f} | "
                    f"{'-' if later is None else f'{later:.2f}'} | {rates[name]:.1f} | {ratio} |"
                )
    loaded.release()


if __name__ == "__main__":
    main()
