"""The draft-length policy's bookkeeping, with made-up costs (no model, no timing)."""

from __future__ import annotations

import pytest

from runtime.engine.policy import DraftLengthPolicy, RequestAcceptance, _track


def test_acceptance_is_kept_per_state():
    # a step's outcome counts towards the state the request was in when it drafted
    acc = RequestAcceptance(0.5, 3.0)
    assert acc.rate == pytest.approx(0.5)
    for _ in range(30):  # outside a run: misses
        acc.observe(0, 1)
    assert acc.rate < 0.05
    acc.observe(3, 3)  # a full accept: the request is now in the "copying" state, which still has its prior
    assert acc.rate == pytest.approx(0.5)
    for _ in range(20):  # copying: every draft accepted
        acc.observe(4, 4)
    assert acc.rate > 0.95
    acc.observe(1, 2)  # the copy ends; back in the other state, whose misses are remembered
    assert acc.rate < 0.4  # 30 misses and one hit
    acc.observe(2, 2)  # and a new run starts from the run's high rate, not from an average of both
    assert acc.rate > 0.9
    assert 0.3 < acc.overall < 0.95  # both states, weighted by their (decayed) trials


def test_policy_drafts_long_inside_a_run_and_stops_outside():
    policy = DraftLengthPolicy(max_k=8, draft_costs_per_token=False)
    policy.verify_cost = {0: 1.0, 1: 1.2, 2: 1.25, 4: 1.3, 8: 1.6}
    acc = policy.new_request(prior=0.5)
    for _ in range(30):
        acc.observe(0, 1)
    assert policy.choose(acc, limit=100) == 0
    acc.observe(1, 1)
    for _ in range(20):
        acc.observe(8, 8)
    assert policy.choose(acc, limit=100) == 8
    assert policy.choose(acc, limit=3) == 3  # the limit caps the length
    acc.observe(0, 1)
    assert policy.choose(acc, limit=100) == 0


def test_draft_cost_shortens_drafts():
    policy = DraftLengthPolicy(max_k=8, draft_costs_per_token=True)
    policy.verify_cost = {0: 1.0, 8: 1.5}
    acc = policy.new_request(prior=0.8)
    policy.draft_cost = 0.01
    cheap = policy.choose(acc, limit=100)
    policy.draft_cost = 0.3
    dear = policy.choose(acc, limit=100)
    assert cheap > dear >= 1


def test_cost_tracking_averages_noise_and_recovers_from_contention():
    cost = _track(None, 0.060)
    assert cost == 0.060
    cost = _track(cost, 0.050)  # a lucky sample is averaged, not taken
    assert 0.050 < cost < 0.060
    cost = _track(cost, 5.0)  # one slow sample (a busy machine) moves it only part of the way
    assert cost < 1.1
    assert _track(5.0, 0.060) == 0.060  # a calibration taken under contention is replaced at once
