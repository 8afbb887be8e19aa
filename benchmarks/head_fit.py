"""How well a trained head drafts the answers it trained on against the prompts held out from it: whether more
answers or a larger head is what it needs next. One table.

    .venv/bin/python benchmarks/head_fit.py smollm2-135m-instruct DIR
    .venv/bin/python benchmarks/head_fit.py smollm2-135m-instruct DIR --answers 300 --steps 4

DIR is a folder ``depctl draft train`` wrote: its head, and the answers it trained on (``DIR/.train``), split into
held-out and training prompts as the trainer split them (``--seed`` and ``--heldout`` as the run had them). Every
group's answers are drafted greedily at K, as the trainer measures its held-out prompts: the mean accepted length and
the share of first drafts accepted (a sampled answer's next token is a draw, so a draft matching it is partly luck);
and the share of first drafts equal to the target's most likely token there (its distribution is kept with each
answer), which compares greedy and sampled answers alike. A head far better on its training answers than on held-out
ones has learned those answers more than the target: more answers, not more training or a larger head, is the lever.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from depctl_runtime.backends.weights import resolve_source  # noqa: E402
from depctl_runtime.model import eagle_format  # noqa: E402
from depctl_runtime.training.data import load_conversations  # noqa: E402
from depctl_runtime.training.eagle import _first, _reference_model, evaluate, heldout_prompts  # noqa: E402
from depctl_runtime.training.state import load_rows  # noqa: E402


def groups(rows: list[dict], given: int, held: set[int], cap: int) -> dict[str, list[dict]]:
    """The answers by what the head saw of them: held-out prompts' greedy answers (what the trainer measures), the
    training prompts' greedy and sampled answers, and answers to requests the target wrote (trained on too)."""
    trained = [r for r in rows if r["index"] < given and r["index"] not in held]
    out = {
        "held-out prompts, greedy": [r for r in rows if r["index"] in held and r["sample"] == 0],
        "training prompts, greedy": [r for r in trained if r["sample"] == 0],
        "training prompts, sampled": [r for r in trained if r["sample"]],
        "requests the target wrote": [r for r in rows if r["index"] >= given],
    }
    return {name: group[:cap] for name, group in out.items() if group}


@torch.inference_mode()
def first_draft_is_likeliest(head, rows: list[dict]) -> tuple[int, int]:
    """Answer positions whose first draft is the target's most likely token there, and the positions."""
    hit = total = 0
    for row in rows:
        start, first = row["start"], _first(row)
        logits = head.ttt_logits(row["tokens"], row["features"].float(), 1, first=first)[0]
        drafted = head.target_ids[logits.argmax(-1)]
        at = torch.arange(first + 2, first + 2 + drafted.shape[0]) - start  # the kept distribution labelling a row
        has = (at >= 0) & (at < row["top_ids"].shape[0])
        likeliest = row["top_ids"][at.clamp(0, row["top_ids"].shape[0] - 1), 0].long()
        hit += int(((drafted == likeliest) & has).sum())
        total += int(has.sum())
    return hit, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("target")
    parser.add_argument("folder", type=Path)
    parser.add_argument("--data", type=Path, default=None, help="the prompts the run was given (the shipped set)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--answers", type=int, default=300, help="answers measured a group at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heldout", type=float, default=0.1)
    args = parser.parse_args()

    conversations = load_conversations(args.data)
    held = heldout_prompts(len(conversations), args.heldout, random.Random(args.seed))
    shards = sorted((args.folder / ".train").glob("answers-*.safetensors"), key=lambda p: int(p.stem.split("-")[1]))
    if not shards:
        raise SystemExit(f"{args.folder}/.train holds no answers: give the folder a training run wrote")
    rows = [row for shard in shards for row in load_rows(shard)]
    source = resolve_source(args.target, "TARGET", lambda stage: None)
    embeddings = _reference_model(source).get_input_embeddings().weight.detach().float().clone()
    head, _ = eagle_format.load(args.folder, embeddings)

    print(f"{args.folder}: {len(rows)} answers, K={args.steps}\n")
    print("| answers | count | positions | mean accepted | first drafts accepted | first drafts = target's likeliest |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, group in groups(rows, len(conversations), held, args.answers).items():
        got = evaluate(head, group, args.steps)
        hit, total = first_draft_is_likeliest(head, group)
        print(
            f"| {name} | {len(group)} | {total} | {got['mean_accepted']:.3f} | {got['acceptance'][0]:.0%} "
            f"| {hit / max(total, 1):.0%} |"
        )


if __name__ == "__main__":
    main()
