"""A short chaos run (benchmarks/chaos.py): traffic, bad requests, disconnects, spec churn and corruption, two kill -9s
and a graceful stop. Nothing may be lost, wedged, left running or answered outside the error envelope."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_short_chaos_run(tmp_path):
    out = tmp_path / "chaos.json"
    run = subprocess.run(
        [sys.executable, "benchmarks/chaos.py", "--duration", "30", "--clients", "4", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    counts = result["counts"]
    assert result["lost"] == [] and result["left"] == [] and result["unexplained_cuts"] == 0
    assert all(ready == valid for _, valid, ready, _ in result["restarts"]) and len(result["restarts"]) == 3
    assert counts["completed"] > 50
    assert not [k for k in counts if "NOT in the envelope" in k or k.startswith("failed 500")], counts
    bad = {k: v for k, v in counts.items() if k.startswith("bad request")}
    assert set(bad) <= {"bad request -> 400", "bad request -> 401", "bad request -> 404", "bad request -> 413"}, bad
    # the memory table: a phase between each restart, and one after deleting every churn deployment
    phases = result["phases"]
    assert len(phases) == 5 and all(p["rss_start"] and p["rss_peak"] >= p["rss_start"] for p in phases), phases
    assert phases[-1]["rss_end"] == result["rss_settled_mb"]
