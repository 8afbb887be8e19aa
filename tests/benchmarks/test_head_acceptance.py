"""benchmarks/head_acceptance.py: heads side by side on the benchmark prompts, measured on the same answers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # trains a head for the tiny model first: a process of its own
def test_two_heads_on_the_same_answers(tiny_model_dir, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(12)))
    head = tmp_path / "head"
    train = [sys.executable, "-m", "depctl_runtime.training", str(tiny_model_dir), "--out", str(head)]
    train += ["--data", str(data), "--minutes", "0.2", "--max-tokens", "8", "--draft-vocab", "64", "--no-compile"]
    subprocess.run(train, cwd=ROOT, capture_output=True, check=True, timeout=600)
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
