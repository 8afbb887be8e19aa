"""The draft-length policy's bookkeeping, with made-up costs (no model, no timing)."""

from __future__ import annotations

import random

import pytest

from depctl_runtime.speculation.policy import (
    PROBE_BUDGET,
    REGIME_PROBE,
    REGIME_PROBE_MAX,
    REGIME_VERDICT,
    CostModel,
    DraftLengthPolicy,
    RegimeGuard,
    RequestAcceptance,
    RowPlan,
    rate_for_mean_accepted,
)


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


def test_a_rate_not_checked_for_a_while_returns_towards_where_the_request_started():
    # a draft model's (or head's) row has no free guess to check while it does not draft: a run of misses once left
    # its rate under what drafting needs for the rest of the request, while its next drafts were accepted as often as
    # anywhere else (a learned head: 37% after a rejection, its rate read 14%)
    acc = RequestAcceptance(0.4, 3.0)
    for _ in range(6):
        acc.observe(0, 1)
    low = acc.rate
    assert low < 0.2
    acc.unchecked()
    assert low < acc.rate < 0.4  # one step: part of the way
    for _ in range(30):
        acc.unchecked()
    assert acc.rate == pytest.approx(0.4, abs=0.01)
    acc.observe(0, 1)  # a miss counts again at once
    assert acc.rate < 0.4


def test_a_draft_heads_row_that_stopped_drafting_after_misses_drafts_again_before_any_probe():
    policy = DraftLengthPolicy(max_k=4)
    _cpu_like(policy)
    policy.draft_cost.observe(1, 0.004)
    policy.probe_debt = 1.0  # no probe: only the row's own rate may bring it back
    acc = policy.new_request(prior=0.4)
    row = [RowPlan(acc, 4, True)]
    assert policy.width(row)[0] > 0
    for _ in range(6):
        acc.observe(0, 1)
    assert policy.width(row)[0] == 0
    steps = 0
    while policy.width(row)[0] == 0:
        acc.unchecked()  # what the engine does for a row that could have drafted and did not
        steps += 1
        assert steps < 20
    assert steps > 1  # the misses still count for a while


def _rows(policy, rates_and_available, model=False):
    rows = []
    for rate, available in rates_and_available:
        acc = policy.new_request(prior=rate)
        rows.append(RowPlan(acc, available, model))
    return rows


def _cpu_like(policy):
    # seconds for a pass over n token rows: flat while memory-bound, then growing (SmolLM2 on 2 cores, roughly)
    for n, s in {1: 0.050, 2: 0.052, 4: 0.055, 8: 0.080, 16: 0.110, 32: 0.150, 64: 0.250, 128: 0.480}.items():
        policy.verify_cost.observe(n, s)


def test_policy_drafts_long_inside_a_run_and_stops_outside():
    policy = DraftLengthPolicy(max_k=8)
    _cpu_like(policy)
    [row] = _rows(policy, [(0.5, 8)])
    for _ in range(30):
        row.acceptance.observe(0, 1)
    assert policy.width([row])[0] == 0
    row.acceptance.observe(1, 1)
    for _ in range(20):
        row.acceptance.observe(8, 8)
    assert policy.width([row])[0] == 8
    assert policy.width([RowPlan(row.acceptance, 3, False)])[0] == 3  # a row's guess (or its room) caps the width
    row.acceptance.observe(0, 1)
    # back among the misses: at most one draft (a 2-token pass costs 4% more than 1 here, so a long shot can pay)
    assert policy.width([row])[0] <= 1


def test_the_same_drafts_that_pay_alone_do_not_pay_in_a_full_batch():
    # a 60% acceptance pays at batch 1 (a 9-token pass costs ~2x one token) but not at batch 8, where the plain step
    # already fills the memory-bound part of the pass and 8 more tokens cost 40% more
    policy = DraftLengthPolicy(max_k=8)
    _cpu_like(policy)
    assert policy.width(_rows(policy, [(0.6, 8)]))[0] > 0
    assert policy.width(_rows(policy, [(0.6, 8)] + [(0.0, 0)] * 7))[0] == 0
    # ...while a batch that copies (grounded edits) still drafts, just shorter than alone
    alone = policy.width(_rows(policy, [(0.95, 8)]))[0]
    full = policy.width(_rows(policy, [(0.95, 8)] * 8))[0]
    assert alone == 8 and 0 < full < alone


def test_steps_that_deliver_less_than_predicted_make_the_policy_draft_less():
    # per-row rates said 60%; the drafting steps then delivered a third of the extra tokens that implied. The policy
    # believes the steps, not the rates: at batch 4 the same drafts no longer pay
    policy = DraftLengthPolicy(max_k=8)
    _cpu_like(policy)
    rows = _rows(policy, [(0.6, 8)] * 4)
    width, predicted = policy.width(rows)
    assert width > 0 and predicted["free"] > 0
    for _ in range(40):
        policy.observe_step(predicted, {"free": round(predicted["free"] / 3)}, batch=4)
    assert policy.realism("free", 4) < 0.5
    assert policy.width(rows)[0] < width


def _proportional(policy, fixed: float = 0.020, per_token: float = 0.001):
    # a pass that costs nearly in proportion to its tokens past a fixed part (4-bit weights at 16 rows on a CPU)
    for n in (1, 8, 16, 32, 64, 128, 256):
        policy.verify_cost.samples[n] = fixed + per_token * n


def test_in_a_batch_each_row_verifies_as_many_of_its_guesses_as_pay_for_their_place_in_the_pass():
    # one row copying (95%) among fifteen whose guesses are accepted 40% of the time, where each token in the pass
    # costs 1 ms: no one width for every row pays (the fifteen's drafts cost more than they bring), but the copying
    # row's eight drafts alone do, so it verifies eight and the others none
    policy = DraftLengthPolicy(max_k=8)
    _proportional(policy)
    rows = _rows(policy, [(0.95, 8)] + [(0.4, 8)] * 15)
    width, predicted = policy.width(rows)
    assert width == 8 and policy.row_drafts == [8] + [0] * 15
    assert predicted["free"] == pytest.approx(sum(0.95**j for j in range(1, 9)), rel=1e-3)
    # the same batch with no row copying drafts nothing, and says no row may
    rows = _rows(policy, [(0.4, 8)] * 16)
    assert policy.width(rows)[0] == 0 and policy.row_drafts is None
    # rows alike take their drafts level by level: the first of every row before anyone's second
    width, _ = policy.width(_rows(policy, [(0.95, 8)] * 16))
    assert width > 0 and max(policy.row_drafts) - min(policy.row_drafts) <= 1
    # and one row alone drafts as the one width for the batch would have it
    alone = DraftLengthPolicy(max_k=8)
    _proportional(alone)
    assert alone.width(_rows(alone, [(0.95, 8)]))[0] == 8 and alone.row_drafts is None


def test_what_drafting_delivered_at_one_batch_size_tempers_the_prediction_there_and_fades_over_plain_steps():
    # at 16 rows the batch's likeliest guesses are the ones whose rates were read highest, and they delivered a third
    # of what those rates said; alone the same rates held. Only the 16-row steps draft less, and the plain steps that
    # follow there bring the prediction back, or a band that once over-predicted would never draft again
    policy = DraftLengthPolicy(max_k=8)
    _proportional(policy, fixed=0.040)
    wide = _rows(policy, [(0.9, 8)] * 4 + [(0.3, 8)] * 12)
    width, predicted = policy.width(wide)
    assert width > 0
    for _ in range(40):
        policy.observe_step(predicted, {"free": round(predicted["free"] / 3)}, batch=16)
        policy.observe_step({"free": 2.0}, {"free": 2}, batch=1)
    assert policy.realism("free", 16) < 0.5 and policy.realism("free", 1) == 1.0
    assert policy.width(wide)[0] == 0
    assert policy.width(_rows(policy, [(0.9, 8)]))[0] == 8
    for _ in range(2000):
        policy.observe_step_time(0.05, 16, 16, None)
    assert policy.realism("free", 16) > 0.9 and policy.width(wide)[0] > 0


def test_rows_without_guesses_do_not_make_the_batch_draft():
    policy = DraftLengthPolicy(max_k=8)
    _cpu_like(policy)
    assert policy.width(_rows(policy, [(0.9, 0)] * 4))[0] == 0


def test_draft_cost_shortens_drafts():
    policy = DraftLengthPolicy(max_k=8)
    policy.verify_cost.observe(1, 1.0)
    policy.verify_cost.observe(9, 1.5)
    policy.draft_cost.observe(1, 0.01)
    cheap = policy.width(_rows(policy, [(0.8, 8)], model=True))[0]
    policy = DraftLengthPolicy(max_k=8)
    policy.verify_cost.observe(1, 1.0)
    policy.verify_cost.observe(9, 1.5)
    policy.draft_cost.observe(1, 0.3)
    dear = policy.width(_rows(policy, [(0.8, 8)], model=True))[0]
    assert cheap > dear >= 1


def test_a_draft_model_is_not_probed_where_even_perfect_drafts_would_lose():
    # 4-bit weights on a CPU: the products are compute-bound, so a pass costs in proportion to its tokens and a
    # batch of 4 gains nothing from drafts that are all accepted. A probe there pays a draft forward and the draft's
    # catch-up on every token it missed, for nothing
    policy = DraftLengthPolicy(max_k=4)
    for n in range(1, 21):
        policy.verify_cost.observe(n, 0.05 * n)
    policy.draft_cost.observe(4, 0.02)
    rows = _rows(policy, [(0.9, 4)] * 4, model=True)
    assert [policy.width(rows)[0] for _ in range(200)] == [0] * 200
    # where perfect drafts would pay, a draft model is still probed now and then (its acceptance is only learned
    # by drafting)
    policy = DraftLengthPolicy(max_k=4)
    _cpu_like(policy)
    policy.draft_cost.observe(4, 0.02)
    rows = _rows(policy, [(0.05, 4)] * 4, model=True)
    assert 0 < sum(policy.width(rows)[0] for _ in range(200)) <= 200 // (4 * 8) + 1


def test_probes_that_cost_a_lot_come_less_often_so_they_cost_at_most_a_small_share():
    # a draft model's probe catches up on every token each row missed since the last one: at 4 rows of a 4-bit 1.5B
    # that measured over a second against a 0.14 s plain step, a third of the time at one probe every 32 steps
    policy = DraftLengthPolicy(max_k=4)
    _cpu_like(policy)
    policy.draft_cost.observe(4, 0.02)
    rows = _rows(policy, [(0.05, 4)] * 4, model=True)
    plain = policy.verify_cost(4)
    probes, elapsed = 0, 0.0
    for _ in range(2000):
        w = policy.width(rows)[0]
        seconds = plain + (1.5 if w else 0.0)  # the probe: a plain step's work plus 1.5 s of catch-up
        elapsed += seconds
        if w:
            probes += 1
        policy.observe_step_time(seconds, len(rows))
    assert probes >= 1  # still probed: acceptance is only learned by drafting
    assert probes * 1.5 <= (PROBE_BUDGET + 0.01) * elapsed + 1.5  # the first probe is free of the budget
    # a cheap probe keeps the usual cadence
    policy = DraftLengthPolicy(max_k=4)
    _cpu_like(policy)
    policy.draft_cost.observe(4, 0.02)
    probes = 0
    for _ in range(320):
        w = policy.width(rows)[0]
        probes += bool(w)
        policy.observe_step_time(policy.verify_cost(4) * (1.02 if w else 1.0), len(rows))
    assert probes == 320 // (4 * 8)


def test_cost_model_interpolates_and_extrapolates_upwards():
    cost = CostModel()
    cost.observe(8, 0.08)
    cost.observe(16, 0.11)
    assert cost(12) == pytest.approx(0.095)
    assert cost(4) == pytest.approx(0.08)  # below the smallest measurement: no cheaper than it
    assert cost(32) == pytest.approx(0.11 + 16 * (0.03 / 8))  # past the largest: the last slope continues


def test_cost_tracking_ignores_a_lone_slow_pass_and_follows_a_lasting_change():
    cost = CostModel()
    for n in range(1, 10):  # a calibration: 4 tokens cost about what 1 does (int8 takes rows four at a time)
        cost.samples[n] = (0.0067, 0.0069, 0.0071, 0.0074, 0.0124, 0.0125, 0.0126, 0.0127, 0.016)[n - 1]
    for _ in range(3):
        cost.observe(4, 0.0074)
    cost.observe(4, 0.044)  # one pass 6x slower (a page fault, the event loop holding the GIL): seen in a daemon
    assert cost(4) == pytest.approx(0.0074)
    assert cost(5) == pytest.approx(0.0124)  # and it did not push the wider passes' costs up either
    for _ in range(3):  # the machine really is slower now: followed within a few passes
        cost.observe(4, 0.015)
    assert cost(4) == pytest.approx(0.015)
    assert cost(5) >= 0.015  # more tokens never cost less
    for s in (0.0072, 0.0080, 0.0070, 0.0078, 0.0074):  # noise is averaged, not the luckiest sample taken
        cost.observe(1, s)
    assert 0.0070 < cost(1) < 0.0080


def test_a_cost_taken_under_contention_is_replaced_at_once():
    cost = CostModel()
    cost.samples[1] = 0.5  # a calibration while something else ran: 50x the real cost
    cost.observe(1, 0.010)
    assert cost(1) == 0.010


def test_a_fresh_cost_corrects_stale_neighbours_that_contradict_it():
    """Calibration measures a few token counts once, on uniform passes at a short context; real passes are measured
    at whatever counts the policy picks. A stale entry that says 16 tokens cost less than 15 made a one-row draft of 8
    at batch 8 look nearly free (SmolLM2, 2 cores: 38.5 ms calibrated for 16 tokens against 58 measured for 15)."""
    cost = CostModel()
    for n, ms in ((1, 8), (8, 23), (16, 38), (32, 68)):  # a calibration
        cost.samples[n] = ms / 1000
    for _ in range(10):  # the machine is slower now and contexts longer: 15 tokens take 58 ms, again and again
        cost.observe(15, 0.058)
    assert cost(16) >= cost(15) >= 0.057  # more tokens never cost less
    assert cost(32) == pytest.approx(0.068)  # still above: left alone
    for _ in range(10):  # and a measured pass over fewer tokens caps the stale larger counts' neighbours below it
        cost.observe(20, 0.040)
    assert cost(16) <= cost(20) + 1e-9 and cost(15) <= cost(20) + 1e-9
    assert cost(8) == pytest.approx(0.023)  # below it and not contradicting it: left alone


def test_one_slow_pass_at_a_new_count_does_not_reprice_the_larger_ones():
    # the bug: a first, 2.5 s pass at a count never measured before became its cost, and "more tokens never cost
    # less" copied it to every larger count, which were then too dear to draft and so never measured again
    costs = CostModel()
    costs.samples.update({1: 0.010, 8: 0.020, 16: 0.030, 72: 0.100})  # a calibration
    costs.observe(12, 2.5)
    assert costs.samples[16] == 0.030 and costs.samples[72] == 0.100
    for _ in range(3):  # a lasting change is confirmed, and then corrects the larger counts as before
        costs.observe(12, 0.2)
    assert costs.samples[12] == 0.2 and costs.samples[16] == 0.2 and costs.samples[72] == 0.2


def test_a_quiet_pass_bounds_the_costs_contention_left_on_wider_passes():
    # seen in a daemon beside another busy process: three 5-token passes took 1.1 s each (two processes' threads on
    # two cores), "more tokens never cost less" copied that to every larger count, and drafting at batch 2 or more
    # looked ruinous long after the other process went quiet, since those widths were then never run to re-measure
    costs = CostModel()
    costs.samples.update({1: 0.030, 2: 0.033, 4: 0.034, 8: 0.040, 16: 0.060, 64: 0.200})  # a calibration
    for _ in range(3):
        costs.observe(5, 1.13)
    assert costs(8) == costs(64) == pytest.approx(1.13)
    costs.observe(4, 0.034)  # a quiet pass over 4 tokens: 8 can be run as two of them, 64 as sixteen
    assert costs(8) <= 2 * 0.034 and costs(16) <= 4 * 0.034 and costs(64) <= 16 * 0.034
    assert costs(5) <= 2 * 0.034
    costs.observe(4, 0.050)  # a slower pass bounds nothing it does not already bound
    assert costs(8) <= 2 * 0.034


def test_a_wide_count_only_calibrated_follows_the_drift_live_counts_measured():
    # calibration reads passes at a context of 64; serving's grow longer and dearer, and the wide counts a batch
    # drafts at are picked too rarely to be re-measured: float32 at 8-16 rows drafted 22-token passes priced at 44 ms
    # that took 50, while the 10-row plain passes beside them ran 5-8% over their calibration
    costs = CostModel()
    costs.samples.update({1: 0.010, 8: 0.020, 16: 0.030, 32: 0.050})  # a calibration
    for _ in range(3):
        costs.observe(8, 0.024)  # 20% dearer than calibrated, confirmed
    assert costs(8) == pytest.approx(0.024)
    assert costs(16) == pytest.approx(0.036) and costs(32) == pytest.approx(0.060)  # the same drift
    assert costs(24) == pytest.approx(0.048)  # and what lies between them
    assert costs(1) == 0.010  # narrower counts are not moved by it
    for _ in range(3):
        costs.observe(32, 0.052)  # a wide count measured itself: its own passes price it from now on
    for _ in range(3):
        costs.observe(8, 0.030)
    assert costs(32) == pytest.approx(0.052)
    assert costs(16) == pytest.approx(0.045)  # still only calibrated: 50% dearer now, as 8 is
    for _ in range(5):
        costs.observe(8, 0.016)  # faster than calibrated: the bound on wider counts lowers them, the drift never does
    assert costs(16) <= 2 * 0.016 + 1e-12


def test_steps_that_gain_less_than_expected_raise_the_gain_a_step_must_be_expected_to_bring():
    # at 16 rows whole drafting steps delivered 0.88 of the gain over plain steps the policy expected of them when it
    # chose them (a pass a little dearer than priced, host work it does not price, acceptance a little high): drafts
    # expected to gain 20% gained 6%, under the margin a batch asks, though never a loss the guard would turn off.
    # Those stop, but for a step now and then that measures again; drafts expected to gain far more go on; alone,
    # where steps delivered, nothing changes
    policy = DraftLengthPolicy(max_k=8)
    _proportional(policy, fixed=0.040)
    marginal = _rows(policy, [(0.55, 8)] * 16)
    assert policy.width(marginal)[0] > 0
    assert 1.15 < policy.expected_gain < 1.25
    plain = 16 / policy.verify_cost(16)
    for _ in range(5):
        policy.observe_step_time(16 / plain, 16, 16, None)
    widths = []
    for _ in range(100):
        widths.append(policy.width(marginal)[0])
        if widths[-1]:
            tokens = 24
            policy.observe_step_time(tokens / (0.88 * policy.expected_gain * plain), 16, tokens, "free")
        else:
            policy.observe_step_time(16 / plain, 16, 16, None)
    assert not policy.guard.is_off(16, "free")
    assert policy.delivery("free", 16) < 0.92
    assert sum(1 for w in widths[-50:] if w) <= 6
    assert policy.width(_rows(policy, [(0.95, 8)] * 16))[0] > 0
    assert policy.delivery("free", 1) == 1.0 and policy.width(_rows(policy, [(0.55, 8)]))[0] > 0
    # alone a head's steps that gain, if less than expected, go on: the guard judges them there
    for _ in range(5):
        policy.observe_step_time(1 / 20, 1, 1, None)
    for _ in range(40):
        policy.expected_gain = 1.5
        policy.observe_step_time(2 / (1.1 * 20), 1, 2, "model")
    assert policy.delivery("model", 1) == 1.0
    # plain steps there bring the expectation back, or a band that once fell short would never draft again
    for _ in range(3000):
        policy.observe_step_time(16 / plain, 16, 16, None)
    assert policy.delivery("free", 16) > 0.98


def _steps(policy, batch: int, plain_rate: float, drafting_rate: float, n: int) -> list[int]:
    """``n`` steps of a batch whose rows would draft: each runs as the policy says, and the step takes 1/rate seconds
    a token at the rate of its kind. The widths it chose."""
    widths = []
    for _ in range(n):
        w = policy.width(_rows(policy, [(0.9, 8)] * batch))[0]
        tokens = batch * (3 if w else 1)
        rate = drafting_rate if w else plain_rate
        policy.observe_step_time(tokens / rate, batch, tokens, "free" if w else None)
        widths.append(w)
    return widths


def test_drafting_that_measured_a_loss_at_a_batch_size_turns_off_there_and_probes_back():
    # the cost model says drafting pays (a cheap pass, a 90% acceptance), but whole drafting steps at batch 8 deliver
    # 10% fewer tokens a second than plain ones (costs the model does not see): the guard turns drafting off at 8
    policy = DraftLengthPolicy(max_k=8)
    _cpu_like(policy)
    widths = _steps(policy, 8, plain_rate=100.0, drafting_rate=90.0, n=200)
    assert policy.guard.is_off(8, "free")
    late = widths[100:]
    assert 0 < sum(1 for w in late if w) <= len(late) // 40  # a probe every REGIME_PROBE steps at most
    assert policy.snapshot()["drafting_over_plain"][8]["free"]["off"]
    # batch 1 is another regime: drafting that gains there goes on
    assert sum(1 for w in _steps(policy, 1, plain_rate=20.0, drafting_rate=45.0, n=40) if w) > 30
    # the load changes and drafting gains at 8 again: the probes see it and drafting comes back
    widths = _steps(policy, 8, plain_rate=100.0, drafting_rate=160.0, n=REGIME_PROBE_MAX + 300)
    assert not policy.guard.is_off(8, "free") and sum(1 for w in widths[-100:] if w) > 90


def test_a_new_heads_first_misses_in_a_row_do_not_turn_it_off():
    # one row's head steps are coin tosses (one draft, accepted about 40% of the time): three misses in a row read as
    # a loss with no spread at all, and every new generation of a learning head started with a one-in-five chance of
    # being turned off for dozens of steps although its steps gained on average
    guard = RegimeGuard()
    for _ in range(20):
        guard.observe(1, None, 1, 1 / 80)  # plain steps: 80 tokens a second
    for _ in range(6):
        guard.observe(1, "model", 1, 1 / 72)  # misses: a plain step's token, a little dearer
    assert not guard.is_off(1, "model")
    for tokens in [2, 1, 2, 1, 1, 2] * 10:  # they gain on average: 96 tokens a second
        guard.observe(1, "model", tokens, tokens / 144 if tokens == 2 else 1 / 72)
    assert not guard.is_off(1, "model")
    # a head that then loses, step after step, is still turned off, within a few dozen steps: drafting steps' rate
    # follows their last ~100, and the gains before weigh in for a while
    for _ in range(60):
        guard.observe(1, "model", 1, 1 / 50)
    assert guard.is_off(1, "model")


def turn_off(guard: RegimeGuard, batch: int, kind: str = "free") -> None:
    """Plain steps at 100 tokens a second in ``batch``'s band, then drafting steps at 60 until the kind is off."""
    for _ in range(20):
        guard.observe(batch, None, batch, batch / 100)
    for _ in range(REGIME_VERDICT):
        guard.observe(batch, kind, batch, batch / 60)
    assert guard.is_off(batch, kind)


def test_an_off_band_looks_for_drafts_only_when_its_probe_is_due():
    # looking costs every row a lookup that the band would refuse; the steps that do not look count towards the
    # next probe as refusals do, so probes keep their pace
    guard = RegimeGuard()
    turn_off(guard, 8)
    assert [guard.proposes(8, "free") for _ in range(REGIME_PROBE)] == [False] * (REGIME_PROBE - 1) + [True]
    assert guard.allows(8, "free")  # the probe
    assert not guard.proposes(8, "free")
    assert guard.proposes(2, "free") and guard.proposes(8, "model")  # other bands and kinds look as before


def test_the_guards_own_plain_step_looks_for_no_drafts():
    # the plain steps the guard keeps in a drafting band are its measure of plain decoding: a step that looked for
    # drafts it would refuse paid every row's lookup, which a plain request does not
    guard = RegimeGuard()
    for _ in range(20):
        guard.observe(8, None, 8, 8 / 100)
    for _ in range(REGIME_PROBE):
        assert guard.proposes(8, "free")
        guard.observe(8, "free", 16, 16 / 120)
    assert not guard.proposes(8, "free") and not guard.allows(8, "free")  # the plain step is due
    guard.observe(8, None, 8, 8 / 100)
    assert guard.proposes(8, "free") and guard.allows(8, "free")


def test_a_band_that_keeps_losing_is_probed_less_and_less_often():
    # a probe drafts the whole batch at the width the cost model picks: at 31 rows on 4-bit weights a pass several
    # times a plain step's, so probing every 64 steps for good cost a band that stays off several percent
    policy = DraftLengthPolicy(max_k=8)
    _cpu_like(policy)
    widths = _steps(policy, 16, plain_rate=100.0, drafting_rate=60.0, n=3000)
    assert policy.guard.is_off(16, "free")
    probes = [i for i, w in enumerate(widths) if w and i > 100]
    assert 3 <= len(probes) <= 3000 // REGIME_PROBE_MAX + 5  # backing off to one in REGIME_PROBE_MAX
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] == REGIME_PROBE_MAX


def test_one_lucky_probe_does_not_turn_a_losing_band_back_on():
    policy = DraftLengthPolicy(max_k=8)
    _cpu_like(policy)
    # a loss near the margin: one probe's step folded into the average would lift it over and turn drafting back on
    _steps(policy, 8, plain_rate=100.0, drafting_rate=95.0, n=200)
    assert policy.guard.is_off(8, "free")
    lucky, widths = True, []
    for _ in range(2000):  # the first probe after that lands on a lucky step; every later one loses again
        w = policy.width(_rows(policy, [(0.9, 8)] * 8))[0]
        tokens = 8 * (3 if w else 1)
        rate = (200.0 if lucky else 95.0) if w else 100.0
        lucky = lucky and not w
        policy.observe_step_time(tokens / rate, 8, tokens, "free" if w else None)
        widths.append(w)
    assert policy.guard.is_off(8, "free")
    assert sum(1 for w in widths if w) <= 2000 // REGIME_PROBE + 1  # only probes drafted: the band never came on


def test_a_batch_whose_size_wanders_is_judged_as_one_regime():
    # 16 clients in a closed loop run batches of 9 to 16 rows, each size a few steps at a time: judged size by size,
    # each needed its own plain steps before anything was compared, and a loss ran on for most of a cell
    policy = DraftLengthPolicy(max_k=8)
    _cpu_like(policy)
    widths = []
    for i in range(240):
        batch = 9 + (i // 3) % 7
        widths += _steps(policy, batch, plain_rate=100.0, drafting_rate=80.0, n=1)
    assert sum(1 for w in widths[120:] if w) <= 120 // 40
    band = policy.snapshot()["drafting_over_plain"][8]
    assert band["sizes"] == "8-15" and band["free"] == {"ratio": 0.8, "off": True}
    assert sum(band["steps"].values()) == 240 and band["steps"]["free"] == sum(1 for w in widths if w)


def test_a_band_that_ran_only_plain_steps_reports_its_counts_so_a_reader_diffing_two_readings_sees_them():
    # a reader diffs two readings to see what one stretch of load drafted: a band missing from the first reading (no
    # drafting measured there yet) counted every step since the load as that stretch's
    policy = DraftLengthPolicy(max_k=8)
    _cpu_like(policy)
    for _ in range(30):
        policy.observe_step_time(0.01, 2, 2, None)
    before = policy.snapshot()["drafting_over_plain"]
    assert before[2] == {"sizes": "2-3", "steps": {"plain": 30}}
    _steps(policy, 2, plain_rate=100.0, drafting_rate=300.0, n=40)
    after = policy.snapshot()["drafting_over_plain"][2]
    assert sum(after["steps"].values()) - sum(before[2]["steps"].values()) == 40 and "free" in after


def test_where_drafting_gains_one_step_in_many_runs_plainly_to_keep_the_comparison_measured():
    policy = DraftLengthPolicy(max_k=8)
    _cpu_like(policy)
    widths = _steps(policy, 4, plain_rate=50.0, drafting_rate=120.0, n=400)
    plain = widths.count(0)
    assert 3 <= plain <= 3 + 400 // 64 + 1  # a few while the plain rate is unknown, then one per REGIME_PROBE
    assert not policy.guard.off


def test_a_policy_that_is_not_adaptive_keeps_drafting_whatever_it_measured():
    policy = DraftLengthPolicy(max_k=4, adaptive=False)
    assert all(_steps(policy, 2, plain_rate=100.0, drafting_rate=10.0, n=50))


def test_the_policy_drafts_a_tree_where_the_other_branches_pay_for_themselves():
    policy = DraftLengthPolicy(max_k=4)
    for n, ms in {1: 50, 4: 51, 8: 52, 16: 54, 32: 60}.items():  # memory-bound: more tokens nearly free
        policy.verify_cost.samples[n] = ms / 1000
    policy.draft_cost.samples.update({1: 0.005, 4: 0.0052})
    row = RowPlan(policy.new_request(prior=0.5), 4, True)
    assert policy.width([row], trees=True)[0] > 0 and policy.branches == 1  # a tree pass never measured: chains
    policy.tree_cost.samples.update(policy.verify_cost.samples)
    for _ in range(200):  # the target's token was the draft's second choice in half the misses
        policy.observe_first_choices([1, 2, 3, 4], 2)
        policy.observe_first_choices([1, 2, 3, 4], 9)
    assert policy.width([row], trees=True)[0] > 0 and policy.branches >= 2
    assert policy.width([row], trees=False)[0] > 0 and policy.branches == 1  # a row that cannot take a tree
    for n in (1, 2, 4, 8, 16, 32):  # compute-bound: every token costs as much as the first
        policy.verify_cost.samples[n] = policy.tree_cost.samples[n] = 0.05 * n
    assert policy.width([row], trees=True)[0] == 0 and policy.branches == 1


def test_a_draft_that_must_first_read_a_long_gap_drafts_only_where_the_rest_of_the_answer_repays_it():
    # Qwen2.5-Coder-1.5B with the 0.5B drafting, 4 clients: the batch decoded plainly, and when the last request of
    # the cell's drain decoded alone its first drafting step read its whole prompt and answer through the draft, a
    # step the guard then measured at 0.04x a plain one
    policy = DraftLengthPolicy(max_k=4)
    policy.verify_cost.samples.update({1: 0.040, 2: 0.041, 3: 0.042, 4: 0.043, 5: 0.044})
    policy.draft_cost.samples[1] = 0.010
    policy.draft_start_cost.samples[1] = 0.012

    def width(behind: int, remaining: int) -> int:
        return policy.width([RowPlan(policy.new_request(prior=0.8, model=True), 4, True, behind, remaining)])[0]

    assert width(behind=300, remaining=20) > 0  # a catch-up never measured is not priced (a head's is cheap)
    policy.catch_up_cost.samples.update({64: 0.150})  # calibration: a 64-token prompt read into one row
    assert width(behind=1, remaining=20) > 0  # a steady step: nothing to catch up on
    assert width(behind=300, remaining=20) == 0  # 20 tokens at 1.5x cannot repay reading 300
    assert width(behind=300, remaining=2000) > 0  # 2,000 can
    assert policy.snapshot()["catch_up_ms"] == {64: 150.0}


def test_a_tree_never_outgrows_what_a_cache_row_holds_past_its_length():
    policy = DraftLengthPolicy(max_k=32, adaptive=False, tree_branches=4)
    wide = [RowPlan(policy.new_request(prior=0.9), 32, True)]
    assert policy.width(wide, trees=True)[0] == 32 and policy.branches == 1  # 4 x 32 drafts: a chain instead
    narrow = [RowPlan(policy.new_request(prior=0.9), 8, True)]
    assert policy.width(narrow, trees=True)[0] == 8 and policy.branches == 4


def test_a_draft_head_that_loses_beside_free_guesses_stops_drafting_while_the_free_guesses_go_on():
    # a learning deployment: an n-gram index's copies where it finds one, a head's guesses elsewhere. The copies gain
    # (150 tokens a second against plain steps' 100), the head's steps lose (80): judged together, the copies hid the
    # head's loss and it drafted on
    policy = DraftLengthPolicy(max_k=4)
    _cpu_like(policy)
    policy.draft_cost.observe(1, 0.002)
    free, model = policy.new_request(prior=0.9), policy.new_request(prior=0.6, model=True)
    late = {"free": 0, "model": 0}
    for i in range(600):
        from_model = i % 2 == 1  # the index finds a copy every other step
        w = policy.width([RowPlan(model if from_model else free, 4, from_model)])[0]
        kind = ("model" if from_model else "free") if w else None
        tokens = 3 if w else 1
        policy.observe_step_time(tokens / {"free": 150.0, "model": 80.0, None: 100.0}[kind], 1, tokens, kind)
        if kind and i >= 300:
            late[kind] += 1
    assert policy.guard.is_off(1, "model") and not policy.guard.is_off(1, "free")
    assert late["free"] >= 150 - 150 // REGIME_PROBE - 1  # a plain step in REGIME_PROBE keeps plain's rate measured
    assert late["model"] <= 300 // REGIME_PROBE + 1  # the head's probes only
    snapshot = policy.snapshot()["drafting_over_plain"][1]
    assert snapshot["model"]["off"] and not snapshot["free"]["off"] and snapshot["free"]["ratio"] > 1.3


def test_a_new_draft_head_is_judged_afresh_where_its_predecessor_lost():
    # a learning deployment's head lost at one row and was turned off there, its probes backed off; the next
    # generation drafts better. Kept, the old verdict held it off until two of its rare probes in a row gained
    policy = DraftLengthPolicy(max_k=4)
    _cpu_like(policy)
    policy.draft_cost.observe(1, 0.002)
    free, model = policy.new_request(prior=0.9), policy.new_request(prior=0.6, model=True)

    def serve(steps: int, head_rate: float) -> int:
        drafted = 0
        for i in range(steps):
            from_model = i % 2 == 1
            w = policy.width([RowPlan(model if from_model else free, 4, from_model)])[0]
            kind = ("model" if from_model else "free") if w else None
            tokens = 3 if w else 1
            policy.observe_step_time(tokens / {"free": 150.0, "model": head_rate, None: 100.0}[kind], 1, tokens, kind)
            drafted += kind == "model"
        return drafted

    serve(1000, 80.0)
    assert policy.guard.is_off(1, "model") and not policy.guard.is_off(1, "free")
    for _ in range(40):  # and the old head delivered half of what its rates predicted
        policy.observe_step({"model": 2.0}, {"model": 1})
    policy.new_draft_model(2.4)
    assert not policy.guard.is_off(1, "model") and policy.realism("model") == 1.0
    assert serve(200, 130.0) >= 80  # the new head drafts where it gains
    assert not policy.guard.is_off(1, "model")
    assert policy.snapshot()["drafting_over_plain"][1]["free"]["ratio"] > 1.3  # the index's record is its own


def test_a_draft_models_optimism_does_not_shorten_the_free_guesses():
    # the head's steps delivered a third of what its rates implied; the n-gram index's copies delivered what theirs
    # did. Realism kept for both together cut the copies' drafts for the head's optimism
    policy = DraftLengthPolicy(max_k=8)
    _cpu_like(policy)
    policy.draft_cost.observe(4, 0.001)
    free = _rows(policy, [(0.6, 8)] * 4)
    heads = _rows(policy, [(0.6, 8)] * 4, model=True)
    width = policy.width(free)[0]
    head_width, predicted = policy.width(heads)
    assert width > 0 and head_width > 0 and set(predicted) == {"model"}
    for _ in range(40):
        policy.observe_step(predicted, {"model": round(predicted["model"] / 3)}, batch=4)
    assert policy.realism("model", 4) < 0.5 and policy.realism("free", 4) == 1.0
    assert policy.width(free)[0] == width
    assert policy.width(heads)[0] < head_width


def test_a_draft_head_starts_each_request_from_its_own_rate():
    # beside an n-gram index the head's requests started from the deployment's average of the index's copies (90%
    # here): every request's first drafts from the head were priced as copies
    policy = DraftLengthPolicy(max_k=4)
    for _ in range(5):
        copies, guesses = policy.new_request(), policy.new_request(model=True)
        for _ in range(10):
            copies.observe(4, 4)
            guesses.observe(0, 1)
        policy.end_request(copies, guesses)
    assert policy.new_request().rate > 0.8 and policy.new_request(model=True).rate < 0.3
    policy.new_draft_model(1.76)  # a new generation, measured on held-out answers at K=4
    a = policy.new_request(model=True).rate
    assert 1 + a + a**2 + a**3 + a**4 == pytest.approx(1.76, abs=1e-6)
    assert policy.new_request().rate > 0.8  # the index's prior is its own


@pytest.mark.parametrize("k", [1, 4, 8])
def test_the_rate_for_a_mean_accepted_length(k):
    for a in (0.0, 0.3, 0.75, 0.95):
        mean = sum(a**j for j in range(k + 1))
        assert rate_for_mean_accepted(mean, k) == pytest.approx(a, abs=1e-6)


def test_a_band_turned_off_comes_back_when_the_policys_own_probes_gain():
    # chat at one client turned drafting off at one row; then code came, where n-gram's copies deliver 2.25x plain
    # steps' tokens a second. The policy's own probes (a single request whose guesses keep hitting drafts once every
    # 8 plain steps) measured that, but only the guard's probes, one in up to 512 refused steps, could turn drafting
    # back on: the code cell ran at 1.00x
    policy = DraftLengthPolicy(max_k=8)
    _cpu_like(policy)
    _steps(policy, 1, plain_rate=100.0, drafting_rate=80.0, n=3000)
    assert policy.guard.is_off(1, "free")
    widths = _steps(policy, 1, plain_rate=100.0, drafting_rate=250.0, n=100)
    assert not policy.guard.is_off(1, "free")
    assert sum(1 for w in widths[-40:] if w) > 35


def _coin_steps(gain_every: float, drafting_seconds: float, n: int, seed: int = 0) -> tuple[RegimeGuard, list[bool]]:
    """``n`` steps of one row whose policy would draft every step, as the guard allows: a plain step is one token a
    second; a drafting step takes ``drafting_seconds`` and delivers two tokens with probability ``gain_every`` (its
    one draft accepted), else one: a weak head's steps, each a coin toss. The guard, and which steps drafted."""
    guard, rng, drafted = RegimeGuard(), random.Random(seed), []
    for _ in range(n):
        d = guard.allows(1, "model")
        tokens = (2 if rng.random() < gain_every else 1) if d else 1
        guard.observe(1, "model" if d else None, tokens, drafting_seconds if d else 1.0)
        drafted.append(d)
    return guard, drafted


def test_steps_that_gain_on_average_keep_drafting_although_each_is_a_coin_toss():
    # a head whose one draft is accepted 30% of the time, its steps 1.18x a plain one's time: 1.10x plain on average.
    # Judged on its last ten steps, a run of rejections read as a loss every few dozen steps, and two probes in a row
    # each had to gain (9% of pairs) before it drafted again: it was off most of the time
    for seed in range(3):
        _, drafted = _coin_steps(0.3, 1.18, 3000, seed)
        assert sum(drafted[500:]) > 0.85 * 2500, seed


def test_steps_that_lose_on_average_are_turned_off_although_some_gain():
    # the same coin with a 15% acceptance and steps at 1.25x a plain one's time: 0.92x plain on average
    for seed in range(3):
        guard, drafted = _coin_steps(0.15, 1.25, 3000, seed)
        assert guard.is_off(1, "model") and sum(drafted[500:]) < 0.1 * 2500, seed


def test_the_cheaper_the_draft_the_less_sure_of_a_draft_it_must_be_to_verify_it():
    p = DraftLengthPolicy(max_k=4)
    assert p.draft_threshold(1) == 0.0  # nothing measured: the width chosen is drafted whole
    p.verify_cost.samples.update({1: 0.010, 2: 0.0105, 8: 0.012, 16: 0.016})
    p.draft_cost.samples.update({1: 0.0005, 8: 0.001})  # a one-layer head
    assert p.draft_threshold(1) == pytest.approx(0.1)  # (0.5 ms + 0.5 ms) / 10 ms
    assert p.draft_threshold(8) == pytest.approx((0.001 + 0.004) / 0.012)  # a batch: verify tokens cost more
    p.draft_cost.samples.update({1: 0.0033})  # a draft model a third of the target's cost
    assert p.draft_threshold(1) == pytest.approx(0.38)


def test_a_draft_is_held_to_how_often_drafts_as_sure_as_its_own_were_accepted():
    # a learned head's own probability of its chain runs high: of its drafts it was 90-100% sure of, the target took
    # 70%; at 70-80% sure, 49%. Taken at its word against a break-even of 53%, it verified drafts that lost
    p = DraftLengthPolicy(max_k=4)
    p.verify_cost.samples.update({1: 0.010, 2: 0.0105, 8: 0.012, 16: 0.016})
    p.draft_cost.samples.update({1: 0.0005, 8: 0.001})
    break_even = (0.001 + 0.004) / 0.012
    assert p.draft_threshold(8) == pytest.approx(break_even)  # nothing measured: its probability at its word
    for accepted in [1, 0] * 200:  # sure of the first draft at 95%, taken half the time; of the second, never
        p.observe_confidence([0.95, 0.55], accepted)
    assert 0.6 < p.draft_threshold(8) < 0.7  # the chain must be surer: as sure as drafts accepted 42% of the time
    assert p.draft_threshold(1) > 0.55  # (a break-even of 10%: nothing under 55% sure was ever accepted)
    p.draft_cost.samples.update({8: 0.0025})  # a break-even of 54%: no draft it makes was accepted that often
    assert p.draft_threshold(8) == 1.0  # (the engine then runs no draft forward)
    snapshot = p.snapshot()["draft_confidence"]
    assert snapshot["0.9-1.0"] == pytest.approx(0.5, abs=0.02) and snapshot["0.5-0.6"] < 0.02

    p.new_draft_model(None)  # another head: its confidence is its own
    assert p.draft_threshold(1) == pytest.approx(0.1)


def test_a_draft_less_sure_than_its_drafts_deserve_verifies_more_of_them():
    p = DraftLengthPolicy(max_k=4)
    p.verify_cost.samples.update({1: 0.010, 2: 0.0105, 8: 0.012, 16: 0.016})
    p.draft_cost.samples.update({1: 0.0005, 8: 0.001})
    for accepted in [1, 1, 1, 1, 0] * 100:  # 35% sure, accepted 80% of the time
        p.observe_confidence([0.35], accepted)
    # lower than the break-even, though never below what surer, unmeasured drafts are taken to be worth
    assert 0.3 < p.draft_threshold(8) < (0.001 + 0.004) / 0.012


def test_beside_free_guesses_a_draft_models_rows_draft_only_where_they_add_to_the_step():
    # 16 rows on a CPU, where a pass costs nearly in proportion to its tokens: half the rows have an n-gram copy
    # (accepted 90%), half only a head (40%). Priced together, the copies' gain carried the head's rows, whose tokens
    # and forwards lost; priced apart, the copies draft alone
    policy = DraftLengthPolicy(max_k=4)
    policy.verify_cost.samples.update({16: 0.072, 24: 0.094, 32: 0.113, 48: 0.160, 80: 0.260})
    policy.draft_cost.samples.update({16: 0.012})
    copies = [RowPlan(policy.new_request(prior=0.9), 4, False) for _ in range(8)]
    heads = [RowPlan(policy.new_request(prior=0.4, model=True), 4, True) for _ in range(8)]
    w, predicted = policy.width(copies + heads)
    assert w > 0 and not policy.model_drafts and set(predicted) == {"free"}
    # a head whose rows are accepted as often as the copies, with a cheaper forward, adds to the step: both draft
    policy.draft_cost.samples.update({16: 0.002})
    sure = [RowPlan(policy.new_request(prior=0.95, model=True), 4, True) for _ in range(8)]
    w, predicted = policy.width(copies + sure)
    assert w > 0 and policy.model_drafts and set(predicted) == {"free", "model"}


def test_a_drafts_first_position_is_priced_apart_from_the_forwards_after_it():
    # a head's first position costs its catch-up on the tokens just accepted and the drafting around it (4 ms here);
    # each position after it one forward (1 ms). Priced at the first position's cost each, a draft of three cost 12 ms
    # and the policy drafted one or two; priced as it runs, three pay most
    policy = DraftLengthPolicy(max_k=4)
    policy.verify_cost.samples.update({1: 0.025, 2: 0.026, 3: 0.027, 4: 0.028, 5: 0.029})
    policy.draft_cost.samples.update({1: 0.001})
    policy.draft_start_cost.samples.update({1: 0.004})
    head = [RowPlan(policy.new_request(prior=0.5, model=True), 4, True)]
    assert policy.drafting_seconds(1, 3) == pytest.approx(0.006)
    assert policy.width(head)[0] == 3
    policy.draft_cost.samples.update({1: 0.004})  # a forward as dear as the start: fewer
    assert policy.width(head)[0] < 3
    kept = DraftLengthPolicy(max_k=4)
    kept.restore(policy.snapshot())
    assert kept.draft_start_cost.samples == {1: 0.004}


def test_an_unmeasured_first_position_is_priced_as_a_forward():
    policy = DraftLengthPolicy(max_k=4)
    policy.draft_cost.samples.update({1: 0.002})
    assert policy.drafting_seconds(1, 2) == pytest.approx(0.004)
    assert policy.drafting_seconds(1, 0) == 0.0


def _wide_steps(copy_share: float, miss_seconds: float, n: int, seed: int = 0) -> tuple[RegimeGuard, list[bool]]:
    """``n`` steps of an 8-row batch whose policy would draft every step, as the guard allows: n-gram steps on code,
    whose spread is wide. A plain step delivers 8 tokens in about 80 ms (100 a second, give or take the batch's mix);
    a drafting step copies (32 tokens in 160 ms) with probability ``copy_share``, else it misses: 8 tokens in
    ``miss_seconds``. The guard, and which steps drafted."""
    guard, rng, drafted = RegimeGuard(), random.Random(seed), []
    for _ in range(n):
        d = guard.allows(8, "free")
        if not d:
            guard.observe(8, None, 8, 0.08 * rng.uniform(0.85, 1.15))
        elif rng.random() < copy_share:
            guard.observe(8, "free", 32, 0.16)
        else:
            guard.observe(8, "free", 8, miss_seconds)
        drafted.append(d)
    return guard, drafted


def test_a_loss_hidden_in_a_wide_spread_is_found_over_a_longer_memory():
    # code at 8 clients: a fifth of the steps copy 4 tokens a row, the rest miss and cost 75% more than a plain step;
    # 0.89x plain on the whole. Each step's rate is 200 or 57 tokens a second: judged on its last ~10 steps alone,
    # the loss was never more than two standard errors under the margin, and a band at 0.79x drafted a whole cell
    for seed in range(3):
        guard, drafted = _wide_steps(0.2, 0.14, 3000, seed)
        assert guard.is_off(8, "free") and sum(drafted[1500:]) < 0.1 * 1500, seed


def test_a_gain_with_a_wide_spread_keeps_drafting():
    # the same spread at 1.08x plain: the longer memory must not read it as a loss
    for seed in range(3):
        _, drafted = _wide_steps(0.2, 0.108, 3000, seed)
        assert sum(drafted[500:]) > 0.9 * 2500, seed
