"""benchmarks/head_acceptance.py: heads side by side on the benchmark prompts, measured on the same answers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny import train_tiny_head

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # trains a head for the tiny model first: a process of its own
def test_two_heads_on_the_same_answers(tiny_model_dir, tmp_path):
    train_tiny_head(tiny_model_dir, tmp_path)
    head = tmp_path / "head"
    run = subprocess.run(
        [sys.executable, "benchmarks/head_acceptance.py", str(tiny_model_dir), f"a={head}", f"b={head}"]
        + ["--workload", "chat,code", "--max-tokens", "8"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in run.stdout.splitlines()]
    rows = [row for row in rows if row[0] in ("chat", "code")]
    assert [row[0] for row in rows] == ["chat", "code"]
    for row in rows:
        assert int(row[1]) == {"chat": 6, "code": 5}[row[0]]  # every prompt answered
        assert row[3:5] == row[5:7]  # the same head measured twice on the same answers: the same cells
        assert 1.0 <= float(row[3]) <= 5.0
