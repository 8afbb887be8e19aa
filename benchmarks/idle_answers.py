"""How fast a learning deployment answers prompts of its own in idle time: tokens a second (prompt and answer, every
position the head will train on) at 1 to 32 rows side by side, through the deployment's compiled library (as the
daemon runs them) and eagerly, for the shipped prompts and for requests the target writes; and the longest pass, which
a request arriving in idle time may wait for. One table.

    .venv/bin/python benchmarks/idle_answers.py
    .venv/bin/python benchmarks/idle_answers.py --model qwen2.5-coder-1.5b-instruct --quantization int4 --seconds 30

Loads the deployment as the daemon does (``--learn-draft-head`` beside n-gram speculation) and drives its
``IdleAnswers`` directly, as idle time would, for ``--seconds`` a cell. Run on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--rows", default="1,4,8,16,32")
    parser.add_argument("--passes", default="compiled,eager")
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    os.environ["DEPCTL_HOME"] = tempfile.mkdtemp(prefix="depctl-idle-answers-")

    from depctl.spec import DeploymentSpec, LearnDraftHead, NgramSpeculation
    from depctl_runtime.backends import learning
    from depctl_runtime.backends.loader import load_deployment

    loaded = load_deployment(
        DeploymentSpec(
            id="idle",
            model=args.model,
            quantization=args.quantization,
            speculation=NgramSpeculation(ngram_length=3, num_draft_tokens=4),
            learn_draft_head=LearnDraftHead(),
            prefix_cache_bytes=0,
        ),
        calibrate=False,
    )
    learner, target = loaded.learner, loaded.target
    print(f"{args.model} ({args.quantization}), {args.seconds:g} s a cell, torch threads {torch.get_num_threads()}\n")
    fast = loaded.engine.target.fast_pass
    print(f"the deployment's passes: {loaded.compiled}\n")
    print("| prompts | passes | rows | tokens/s | answers/min | vs the fewest rows | longest pass ms |")
    print("|---|---|---:|---:|---:|---:|---:|")
    base = {}
    for kind in ("shipped", "written"):
        for passes in args.passes.split(","):
            if passes == "compiled" and not hasattr(fast, "another"):
                print(f"| {kind} | compiled | - | no compiled library for this deployment | | | |")
                continue
            for rows in [int(r) for r in args.rows.split(",")]:
                answers = learning.idle_answers(
                    learner,
                    target.model,
                    target.tokenizer,
                    loaded.engine.target.vocab_size,
                    loaded.engine.config.eos_token_ids,
                    fast.another if passes == "compiled" else None,
                )
                answers.max_rows = rows
                if kind == "written":
                    answers.done = len(answers.prompts)
                for _ in range(4):  # the runner's cache allocated, and the prompt chunk settled, outside the clock
                    answers.piece()
                got, start, before, longest = [], time.perf_counter(), answers.positions_read, 0.0
                while time.perf_counter() - start < args.seconds:
                    t0 = time.perf_counter()
                    got += answers.piece()
                    longest = max(longest, time.perf_counter() - t0)
                seconds = time.perf_counter() - start
                rate = (answers.positions_read - before) / seconds
                first = base.setdefault((kind, passes), rate)
                print(
                    f"| {kind} | {passes} | {rows} | {rate:.0f} | {len(got) * 60 / seconds:.1f} | "
                    f"{rate / first:.2f}x | {longest * 1000:.0f} |",
                    flush=True,
                )
                answers.release()  # its compiled pass; not its runner's weights, which are the target's
    loaded.release()


if __name__ == "__main__":
    main()
