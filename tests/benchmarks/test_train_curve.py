"""benchmarks/train_curve.py: two runs' logs side by side, minute by minute, each cell the measurement at or just
after the minute."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def log(path: Path, minutes: list[float], means: list[float], answers: int, written: int = 0) -> Path:
    given = answers - written
    lines = [{"event": "answers", "done": given, "total": given, "written": written, "tokens": 100 * answers}]
    for m, mean in zip(minutes, means):
        lines.append(
            {"event": "train", "minutes": m, "acceptance": [mean - 1, 0.0], "mean_accepted": mean, "epochs": m}
        )
    lines.append({"event": "done", "examples": answers, "mean_accepted": means[-1]})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_two_runs_side_by_side(tmp_path):
    a = log(tmp_path / "a.log", [1.0, 2.01, 3.5, 4.02], [1.1, 1.2, 1.3, 1.4], 50)
    b = log(tmp_path / "b.log", [1.02, 2.0, 5.5, 6.0], [1.15, 1.25, 1.45, 1.6], 80, written=30)
    run = subprocess.run(
        [sys.executable, "benchmarks/train_curve.py", f"old={a}", f"new={b}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    rows = [line for line in run.stdout.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| minutes trained | old: mean accepted")
    assert rows[1].startswith("| 1 | 1.100 | 10% | 1.0 | 1.150 | 15% | 1.0")
    # minute 4: the old run's measurement at 4.02; the new one has none within the minute after 4
    assert rows[3].startswith("| 4 | 1.400 | 40% | 4.0 | | |")
    assert "| end (4.0, 6.0) | 1.400 | 40% | 4.0 | 1.600 | 60% | 6.0 |" in run.stdout
    assert "- old: 50 answers (5000 tokens generated), 4.0 minutes trained" in run.stdout
    assert "- new: 80 answers, 30 of them to requests the target wrote (8000 tokens generated), 6.0" in run.stdout


def test_a_log_without_measurements_is_refused_by_name(tmp_path):
    empty = tmp_path / "empty.log"
    empty.write_text('{"event": "stage", "name": "loading"}\n')
    run = subprocess.run(
        [sys.executable, "benchmarks/train_curve.py", f"x={empty}"], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode != 0 and "empty.log: no held-out measurement" in run.stderr
