"""benchmarks/head_fit.py: a head on the answers it trained on against the prompts held out from it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from random import Random

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from head_fit import groups  # noqa: E402

from depctl_runtime.training.eagle import heldout_prompts  # noqa: E402
from depctl_runtime.training.state import load_rows  # noqa: E402
from tests.tiny import train_tiny_head  # noqa: E402


def test_answers_are_grouped_by_what_the_head_saw_of_them():
    rows = [{"index": i, "sample": s} for i in range(4) for s in range(2) if not (i == 1 and s)]
    rows += [{"index": 4, "sample": 0}, {"index": 5, "sample": 0}]  # requests the target wrote, after the 4 given
    got = groups(rows, given=4, held={1}, cap=100)
    assert got["held-out prompts, greedy"] == [{"index": 1, "sample": 0}]
    assert [r["index"] for r in got["training prompts, greedy"]] == [0, 2, 3]
    assert [(r["index"], r["sample"]) for r in got["training prompts, sampled"]] == [(0, 1), (2, 1), (3, 1)]
    assert [r["index"] for r in got["requests the target wrote"]] == [4, 5]
    assert [len(g) for g in groups(rows, given=4, held={1}, cap=2).values()] == [1, 2, 2, 2]


@pytest.mark.slow  # trains a head for the tiny model first: a process of its own
def test_the_held_out_answers_are_the_ones_the_trainer_measured(tiny_model_dir, tmp_path):
    # the answering budget is a share of wall time: on a slow machine it may cut prompts, so the counts expected are
    # those of the answers the trainer saved, and most of the short budget goes to answering
    extra = ("--samples", "2", "--steps", "3", "--answer-share", "0.9")
    done = json.loads(train_tiny_head(tiny_model_dir, tmp_path, *extra).strip().splitlines()[-1])
    head, data = tmp_path / "head", tmp_path / "prompts.jsonl"
    assert done["event"] == "done"
    run = subprocess.run(
        [sys.executable, "benchmarks/head_fit.py", str(tiny_model_dir), str(head), "--data", str(data), "--steps", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    table = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in run.stdout.splitlines() if "|" in line}
    held = table["held-out prompts, greedy"]
    assert held[1] == "1"  # a tenth of 12 prompts
    assert float(held[3]) == pytest.approx(done["mean_accepted"], abs=1e-3)  # the split the trainer measured
    saved = [row for shard in (head / ".train").glob("answers-*.safetensors") for row in load_rows(shard)]
    trained = [row for row in saved if row["index"] < 12 and row["index"] not in heldout_prompts(12, 0.1, Random(0))]
    greedy = sum(row["sample"] == 0 for row in trained)
    assert greedy >= 9  # the trainer answers at least ten prompts, however slow the machine
    assert table["training prompts, greedy"][1] == str(greedy)
    sampled = len(trained) - greedy
    assert table.get("training prompts, sampled", ["", "0"])[1] == str(sampled)
