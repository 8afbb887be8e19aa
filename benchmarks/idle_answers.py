"""How fast a learning deployment answers prompts of its own in idle time: tokens a second (prompt and answer, every
position the head will train on) at 1, 2, 4 and 8 rows side by side, for the shipped prompts and for requests the
target writes. One table.

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
    parser.add_argument("--rows", default="1,2,4,8")
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
    print("| prompts | rows | tokens/s | answers/min | vs 1 row |")
    print("|---|---:|---:|---:|---:|")
    for kind in ("shipped", "written"):
        base = None
        for rows in [int(r) for r in args.rows.split(",")]:
            answers = learning.idle_answers(
                learner,
                target.model,
                target.tokenizer,
                loaded.engine.target.vocab_size,
                loaded.engine.config.eos_token_ids,
            )
            answers.max_rows = rows
            if kind == "written":
                answers.done = len(answers.prompts)
            answers.piece()  # the runner's cache allocated outside the clock
            got, start, before = [], time.perf_counter(), answers.positions_read
            while time.perf_counter() - start < args.seconds:
                got += answers.piece()
            seconds = time.perf_counter() - start
            rate = (answers.positions_read - before) / seconds
            base = base or rate
            print(f"| {kind} | {rows} | {rate:.0f} | {len(got) * 60 / seconds:.1f} | {rate / base:.2f}x |", flush=True)
            del answers  # its runner and cache (release() would empty the weights it shares with the target)
    loaded.release()


if __name__ == "__main__":
    main()
