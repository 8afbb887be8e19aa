"""Does a request's greedy output depend on its neighbours in the batch? Measured on a real model.

    .venv/bin/python benchmarks/batch_invariance.py [--model M] [--max-tokens 128] [--no-surgery]

Every prompt of the benchmark sets is decoded alone (batch of one) and then all of them together (one batch,
prompts joining as rows free up), plain and with n-gram speculation. Prints, per configuration, how many outputs
differ from the solo plain output and where they first diverge, and the largest logit difference between one row
computed alone and the same row computed in a batch of 8 (0.0 means the kernels are batch-invariant on that path).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from depctl import models  # noqa: E402
from depctl.spec import DeploymentSpec, NgramSpeculation  # noqa: E402
from depctl.workloads import prompts_dir  # noqa: E402
from depctl_runtime.backends.loader import load_deployment  # noqa: E402
from depctl_runtime.speculation import GenerationParams, Scheduler, generate  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rows", type=int, default=8)
    args = parser.parse_args()
    spec = DeploymentSpec(
        id="inv",
        model=args.model,
        max_batch_size=args.rows,
        speculation=NgramSpeculation(ngram_length=3, num_draft_tokens=8),
    )
    loaded = load_deployment(spec, calibrate=True)
    engine, tok = loaded.engine, loaded.tokenizer
    prompts = [
        json.loads(line)["prompt"]
        for w in ("chat", "grounded", "code")
        for line in (prompts_dir() / f"{w}.jsonl").open()
    ]
    ids = [
        tok(
            tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        for p in prompts
    ]

    def solo(i, speculate):
        params = GenerationParams(max_tokens=args.max_tokens, speculate=speculate)
        return [t for o in generate(engine, ids[i], params) for t in o.token_ids]

    def together(speculate):
        params = GenerationParams(max_tokens=args.max_tokens, speculate=speculate)
        return Scheduler(engine, args.rows).run_all(ids, params)

    reference = [solo(i, False) for i in range(len(ids))]
    runs = {
        "n-gram, alone": [solo(i, True) for i in range(len(ids))],
        f"plain, batch of {args.rows}": together(False),
        f"n-gram, batch of {args.rows}": together(True),
    }
    print(f"\n{args.model}: {len(ids)} prompts, max_tokens {args.max_tokens}, greedy; reference = plain, alone\n")
    print("| configuration | outputs identical | differing (first divergence at token) |")
    print("|---|---|---|")
    for name, outs in runs.items():
        diffs = []
        for i, (a, b) in enumerate(zip(outs, reference)):
            if a != b:
                at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                diffs.append(f"#{i} at {at}")
        print(f"| {name} | {len(ids) - len(diffs)}/{len(ids)} | {', '.join(diffs) or '-'} |")

    # one forward: row 0 alone vs the same row among 7 others, same positions
    runner = engine.target
    with torch.inference_mode():
        for r in range(args.rows):
            runner.set_length(r, 0)
        runner.forward(0, [ids[0]])
        alone = runner.forward(0, [[ids[0][-1]]])[0]
        for r in range(args.rows):
            runner.set_length(r, 0)
        for r in range(args.rows):
            runner.forward(r, [ids[0] if r == 0 else ids[r % len(ids)]])
        batched = runner.forward(0, [[ids[0][-1]]] + [[ids[r % len(ids)][-1]] for r in range(1, args.rows)])[0]
        for r in range(args.rows):
            runner.set_length(r, 0)
    print(
        f"\nlargest |logit difference|, one row alone vs in a batch of {args.rows}: "
        f"{float((alone - batched).abs().max()):.3g} "
        f"(argmax {'equal' if alone.argmax() == batched.argmax() else 'DIFFERENT'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
