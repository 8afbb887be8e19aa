"""Held-out acceptance against minutes trained, for runs of ``depctl draft train`` side by side. One table.

    python -m depctl_runtime.training smollm2-135m-instruct --out a --minutes 30 > a.log
    python -m depctl_runtime.training smollm2-135m-instruct --out b --minutes 30 --samples 3 > b.log
    .venv/bin/python benchmarks/train_curve.py now=a.log samples-3=b.log

Each argument is LABEL=LOG, the JSON lines a run printed (``depctl draft train`` runs the same trainer). A row is a
whole minute of training; each run's cell is its held-out measurement at or just after that minute: the mean
accepted length at the run's K, the share of first drafts accepted, and the epochs over its training answers. The
last row is each run's end. Under the table: how many answers each run generated (tokens, and the minutes of the
budget that took) before training.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read(log: Path) -> dict:
    """A run's measurements, answers and the time it took to start training."""
    history, answers, written, tokens = [], 0, 0, 0
    for line in log.read_text().splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("event") == "train":
            history.append(event)
        elif event.get("event") == "answers":
            written, tokens = event.get("written", 0), event["tokens"]
            answers = event["done"] + written
        elif event.get("event") == "done":
            answers = event.get("examples", answers)
    if not history:
        raise SystemExit(f"{log}: no held-out measurement in it (is it the output of a training run?)")
    total = history[-1].get("total_minutes")
    return {"history": history, "answers": answers, "written": written, "tokens": tokens, "total": total}


def cell(entry: dict | None) -> str:
    if entry is None:
        return "| | |"
    first = entry["acceptance"][0] if entry.get("acceptance") else 0.0
    return f"| {entry['mean_accepted']:.3f} | {first:.0%} | {entry.get('epochs', 0):.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", metavar="LABEL=LOG")
    args = parser.parse_args()
    runs = {}
    for item in args.runs:
        label, _, path = item.partition("=")
        if not path:
            raise SystemExit(f"{item!r}: give LABEL=LOG")
        runs[label] = read(Path(path))
    longest = max(r["history"][-1]["minutes"] for r in runs.values())
    header = "| minutes trained |" + "".join(f" {k}: mean accepted | first drafts | epochs |" for k in runs)
    print(header)
    print("|---:|" + "---:|---:|---:|" * len(runs))
    marks = [m for m in (1, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) if m < longest]
    for minute in marks:
        cells = []
        for run in runs.values():
            later = [h for h in run["history"] if h["minutes"] >= minute - 0.05]
            cells.append(cell(later[0] if later and later[0]["minutes"] < minute + 1 else None))
        print(f"| {minute} " + " ".join(cells) + " |")
    ends = " ".join(cell(run["history"][-1]) for run in runs.values())
    print("| end (" + ", ".join(f"{r['history'][-1]['minutes']:.1f}" for r in runs.values()) + ") " + ends + " |")
    print()
    for label, run in runs.items():
        trained = run["history"][-1]["minutes"]
        own = f", {run['written']} of them to requests the target wrote" if run["written"] else ""
        generated = f"({run['tokens']} tokens generated), {trained:.1f} minutes trained"
        print(f"- {label}: {run['answers']} answers{own} {generated}")


if __name__ == "__main__":
    main()
