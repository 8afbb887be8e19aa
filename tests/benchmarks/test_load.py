"""The load benchmark: its measure of the time every client was busy, and the modes a deployment runs."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from load import Cell, tokens_before  # noqa: E402


def test_tokens_before_an_instant_count_each_requests_share_of_its_chunks_by_then():
    streams = [
        ([1.0, 2.0, 3.0, 4.0], 8),  # four chunks of eight tokens: two chunks by 2.5, so half its tokens
        ([0.5, 1.5], 3),  # done before
        ([3.0, 5.0], 6),  # nothing yet
        ([], 0),  # streamed nothing
    ]
    assert tokens_before(streams, 2.5) == pytest.approx(4 + 3)
    assert tokens_before(streams, 10.0) == pytest.approx(17)
    assert tokens_before(streams, 0.0) == 0


def test_runs_merge_their_busy_tokens_over_their_busy_seconds():
    a = Cell(tokens=100, seconds=10.0, busy_tokens=60.0, busy_seconds=5.0)
    b = Cell(tokens=100, seconds=10.0, busy_tokens=30.0, busy_seconds=5.0)
    assert a.merged(b).busy == pytest.approx(9.0) and a.merged(b).aggregate == pytest.approx(10.0)
    assert Cell().busy == 0.0


def test_a_control_run_decodes_plainly_between_plain_and_speculating():
    from load import CONTROL, depctl_modes

    args = SimpleNamespace(control=True, draft_model=None)
    assert depctl_modes(args) == {
        "plain": {"speculate": False},
        CONTROL: {"speculate": False},
        "n-gram": {"speculate": True},
    }
    args.control = False
    assert list(depctl_modes(args)) == ["plain", "n-gram"]


def test_a_cell_reports_the_steps_each_band_drafted_during_it():
    from load import drafted

    before = {"sizes": "8-15", "steps": {"plain": 100, "free": 40}}
    after = {"sizes": "8-15", "steps": {"plain": 160, "free": 45}}
    assert drafted(before, after) == (5, 65)
    assert drafted(None, after) == (45, 205)  # a band first measured in this cell
    assert drafted(after, after) == (0, 0)
