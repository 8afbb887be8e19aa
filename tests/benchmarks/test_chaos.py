"""A short chaos run (benchmarks/chaos.py): traffic, bad and hostile requests, pickles, idle bursts, disconnects, spec
churn and corruption, two kill -9s and a graceful stop. Nothing may be lost, wedged, left running, answered outside the
error envelope, or changed in another user's output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # a daemon in a subprocess, restarts and kills: minutes


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
    # traffic flowed (how much in 30 s depends on the machine: not checked beyond that)
    assert counts["completed"] >= 10, counts
    assert not [k for k in counts if "NOT in the envelope" in k or k.startswith("failed 500")], counts
    bad = {k: v for k, v in counts.items() if k.startswith("bad request")}
    assert set(bad) <= {"bad request -> 400", "bad request -> 401", "bad request -> 404", "bad request -> 413"}, bad
    # the memory table: a phase between each restart, and one after deleting every churn deployment
    phases = result["phases"]
    assert len(phases) == 5 and all(p["rss_start"] and p["rss_peak"] >= p["rss_start"] for p in phases), phases
    assert phases[-1]["rss_end"] == result["rss_settled_mb"]
    # hostile users: each refused with a 4xx and a code, no pickle ever run, and everyone else's greedy text unchanged
    assert counts["greedy text as alone"] > 10 and not counts.get("greedy text DIFFERS from alone"), counts
    hostile = [k for k in counts if k.startswith("hostile")]
    assert hostile and all(k.startswith(("hostile -> 4", "hostile -> 503")) for k in hostile), hostile
    assert counts["pickled weights refused"] >= 1 and not counts.get("pickled weights NOT refused")
    assert not result["pickle_ran"] and not counts.get("pickle payloads run")
    bursts = [k for k in counts if k.startswith("idle burst: ") and "answered" in k]
    assert bursts, counts  # (every burst member answered, unless a restart cut it: counted apart)
