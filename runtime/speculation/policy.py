"""How many tokens to draft each step, for the whole batch, so that speculation does not lose to plain decoding.

One step runs ONE target pass over ``sum_i (1 + k_i)`` tokens, row i verifying ``k_i = min(w, what it has)`` drafts
(w = the step's draft width; the pass is one flat stream, so a row without drafts costs one token), plus, with a
draft model, its start over the B rows (a catch-up and the first forward) and ``w - 1`` forwards after it. Row i
then emits on average

    E_i(k) = 1 + a_i + a_i^2 + ... + a_i^k = (1 - a_i^(k+1)) / (1 - a_i)

tokens, k = its own drafts (at most w), a_i its acceptance rate (Leviathan et al. 2023, eq. 1). The policy picks the
w in ``0..K`` that maximises ``sum_i E_i(k_i) / cost(w)``; ``w = 0`` is a plain decode step for everyone (in a
batch of free guesses each row gets its own ``k_i`` instead: ``_row_drafts``). The cost
comes from measurements, not constants: a pass over n tokens (``CostModel``), measured at load and followed on
every step. On a CPU a pass over 8 tokens costs little more than over 1 while a pass over 72 costs several times
as much, so the same drafts that pay at batch 1 do not at batch 8: at high load the policy drafts less, or not at
all.

- costs: the median of the last few passes per measured token count (a lone slow pass moves nothing; a sample
  under half the estimate replaces it at once, so a calibration taken on a busy machine recovers), kept
  non-decreasing in the count (a fresh estimate corrects older entries that contradict it) and no dearer than
  running a wider pass as several narrower ones (a quiet pass undoes what contention left on wider counts); counts
  never measured are interpolated, and extrapolated past the largest.
- ``a_i`` is estimated per request from its own steps, starting from the deployment's running average, and kept
  separately for right after a fully accepted step and right after a rejection (``RequestAcceptance``); a head's
  drafts beside an n-gram index have a rate and an average of their own. The extra tokens these rates predict are
  scaled by what drafting steps actually delivered against their prediction (``realism``, per kind of row and band
  of batch sizes): per-row
  rates run optimistic when hits come in bursts, and a batch amplifies the error. A row that
  does not draft still has its free guess compared with the token the target produced, so the estimate keeps
  moving; after ``PROBE_EVERY`` x B plain steps the batch drafts once anyway (one token for a draft model, where
  drafts that were all accepted would pay; K for a single request whose free guesses keep hitting), re-measuring a
  cost that may have been taken on a busy machine. What a probe costs beyond a plain step (a draft model first
  catches up on every token it missed) is repaid at ``PROBE_BUDGET`` of each later step's time before the next.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from dataclasses import dataclass, field

WINDOW = 5  # a cost is the median of this many recent measurements
CONFIRMED = 3  # measurements behind a cost before it may correct the costs of other counts
REQUEST_DECAY = 0.85  # per-step decay of a request's acceptance counts: recent steps matter most
PRIOR_WEIGHT = 3.0  # how many pseudo-trials the deployment's average is worth at a request's start
PROBE_EVERY = 8
# probes may cost at most this share of the time: a draft model's probe first catches up on every token each row
# missed since the last one (a prefill of the whole batch), which can cost more than the plain steps between probes
PROBE_BUDGET = 0.02
REALISM_DECAY = 0.97  # per drafting step: the realised/predicted ratio follows the last ~30 drafting steps
REALISM_PRIOR = 4.0  # extra tokens, realised and predicted alike, added to a kind of row's sums in a band
# per plain step in a band: the gap between what its drafting steps delivered and what was predicted closes by this
# factor, or a band whose drafts once fell short would never draft again (drafting nothing, it measures nothing new)
REALISM_FORGET = 0.998
# per band of batch sizes and kind of drafting step: whole steps' gain over plain steps there against the gain the
# policy expected of them when it chose them (decayed sums; ``delivery``). In a batch a pass ran a few percent dearer
# than priced, host work unpriced and acceptance a little high, each within the margin and together past it
DELIVERY_DECAY = 0.97  # per drafting step: follows the last ~30
DELIVERY_PRIOR = 4.0  # steps that gained as expected, added to each band's sums
MIN_GAIN = 1.03  # alone: speculate only when it is expected to beat plain decoding by at least 3%
# in a batch: 10%. A wide pass's cost and the rows' acceptance are both estimates, and a batch's wide pass costs
# several plain steps, so a small predicted gain can be a real loss
MIN_GAIN_BATCH = 1.10
# the guard (``RegimeGuard``): drafting steps at a batch size that deliver under this share of plain steps' tokens a
# second there turn drafting off at that size
LOSS_MARGIN = 0.97
# per step of its kind: plain steps' rate in a band follows their last ~10 (one step in ``REGIME_PROBE`` while drafting
# runs); drafting steps' their last ~100, since a kind's steps spread wide (n-gram steps on code copy four tokens a row
# or none: 200 or 57 tokens a second), and over ten of them neither a 10% loss nor a 10% gain stood out of the noise:
# losses drafted whole cells, and gains were turned off after a run of misses
REGIME_DECAY_PLAIN, REGIME_DECAY_DRAFTING = 0.9, 0.99
REGIME_MIN_STEPS = 3  # steps of each kind at a batch size before its rates are compared
REGIME_PROBE = 64  # steps between a regime's probes: one drafting step where drafting is off, one plain step where on
REGIME_PROBE_MAX = 512  # a band that keeps losing is probed half as often after each losing probe, down to this
REGIME_CONFIRM = 2  # probes in a row that gain before a band turned off drafts again
REGIME_PROBES_KEPT = 64  # a band's last probes, judged together to bring a kind back
REGIME_SURE = 2.0  # standard errors by which a kind's rate must fall under the margin to turn it off
# the spread of a drafting step's rate, over its rate, that a verdict assumes before it measured one, worth
# ``REGIME_VERDICT`` steps: a few misses in a row (one row's head steps are coin tosses) have no spread at all, and
# read as a sure loss
REGIME_SPREAD = 0.25
# drafting steps of a kind in a band (since it started there, or its proposer changed) before it may be turned off
REGIME_VERDICT = 8
REGIME_WARMUP = 16  # drafting steps between plain ones at a batch size whose plain rate is not yet measured
MAX_BRANCHES = 4  # the widest draft tree's first position: the draft's best four tokens
MAX_TREE_TOKENS = 64  # a row's tokens in a pass over a tree, at most: what a cache row holds past its length
CHOICE_DECAY = 0.99  # per observation: how often the target took the draft's 2nd..4th choice follows ~100 misses
# before any: where the target's token ranks among the draft's choices when it is not the first (a prior, 4 misses'
# worth: 30% its second, 10% its third, 5% its fourth)
CHOICE_PRIOR = (0.0, 1.2, 0.4, 0.2)


# a draft model's own probability of its chain, against how often the target accepted chains that probable
# (``DraftConfidence``): per tenth of probability, decayed counts that follow its last ~500 drafts there, from a
# prior of a few drafts accepted as often as the draft said
CONFIDENCE_BINS = 10
CONFIDENCE_DECAY = 0.998
CONFIDENCE_PRIOR = 2.0


def _clamped(row) -> float:
    """A row's acceptance rate within [0, 0.999] (1 would make every sum of its powers endless)."""
    return min(max(row.acceptance.rate, 0.0), 0.999)


def rate_for_mean_accepted(mean_accepted: float, k: int) -> float:
    """The per-token acceptance rate a whose drafts of ``k`` give this mean accepted length, 1 + a + ... + a^k
    (bisection: the sum grows with a)."""
    low, high = 0.0, 0.999
    for _ in range(40):
        mid = (low + high) / 2
        if (1 - mid ** (k + 1)) / (1 - mid) < mean_accepted:
            low = mid
        else:
            high = mid
    return low


def _estimate(recent: deque, old: float | None, sample: float) -> float:
    """Follow a cost with the median of its last ``WINDOW`` samples (the lower one of an even count), seeded with the
    previous estimate. One slow pass (a page fault, a busy moment) is outvoted, where an average would leave a width
    that is rarely drafted, and so rarely re-measured, priced out for good; a lasting change wins within a few
    passes. A sample under half the estimate
    replaces it at once: a calibration taken on a busy machine (contention can make a pass 10x slower) must not
    switch speculation off for good. Not a running minimum, which would favour whichever count is measured most
    often (its luckiest sample) over counts measured rarely."""
    if old is None or sample < 0.5 * old:
        recent.clear()
    elif not recent:
        recent.append(old)
    recent.append(sample)
    return statistics.median_low(recent)


class RequestAcceptance:
    """A request's acceptance rate, kept in two states: after a step whose drafts were all accepted (the output is
    copying something: an n-gram match or a draft model that agrees, and the next draft is likely to pass too) and
    after a step with a rejection. Copying comes in runs, so one averaged rate drafts too short inside a run and too
    long outside it; the rate of the state the request is in now decides the next draft length."""

    def __init__(self, rate: float, weight: float):
        # [accepted, trials] after a full accept, and after a rejection (or at the start)
        self._counts = [[rate * weight, weight], [rate * weight, weight]]
        self._prior = (rate * weight, weight)
        self._state = 1

    @property
    def rate(self) -> float:
        accepted, trials = self._counts[self._state]
        return accepted / trials if trials > 0 else 0.0

    @property
    def overall(self) -> float:
        accepted = sum(c[0] for c in self._counts)
        trials = sum(c[1] for c in self._counts)
        return accepted / trials if trials > 0 else 0.0

    @property
    def trials(self) -> float:
        return sum(c[1] for c in self._counts)

    def observe(self, accepted: int, trials: int) -> None:
        """``accepted`` of ``trials`` draft tokens passed (trials = accepted + 1 on a rejection)."""
        counts = self._counts[self._state]
        counts[0] = counts[0] * REQUEST_DECAY + accepted
        counts[1] = counts[1] * REQUEST_DECAY + trials
        self._state = 0 if accepted == trials else 1

    def unchecked(self) -> None:
        """A step the row's proposer could have drafted for and did not, with no guess to check against the target's
        token (a draft model's or head's row): what the request's steps said ages as the text moves on, towards the
        rate it started from. Without it a run of misses left a head's row under what drafting needs for good (it
        drafts nothing, so nothing corrects its rate), while its next drafts were accepted as often as anywhere."""
        for counts in self._counts:
            for i, prior in enumerate(self._prior):
                counts[i] = counts[i] * REQUEST_DECAY + prior * (1 - REQUEST_DECAY)


class CostModel:
    """Seconds for a forward over ``n`` token rows, from measurements (the median of recent passes per n),
    interpolated between them."""

    def __init__(self):
        self.samples: dict[int, float] = {}  # the estimate per token count (calibration writes it directly)
        self._recent: dict[int, deque] = {}
        self._counts: list[int] = []  # sorted(samples), kept while no count is added (counts are never removed)
        # what calibration (or a restored snapshot) said of each count it wrote, and the counts since confirmed by
        # passes of their own: a count only calibrated follows the drift the live counts under it measured
        self._calibrated: dict[int, float] = {}
        self._observed: set[int] = set()
        self._live: set[int] = set()
        self._synced = 0  # len(samples) when the calibrated entries were last taken

    def observe(self, n: int, seconds: float) -> None:
        if self._synced != len(self.samples):  # entries written directly since: calibration's
            for m, value in self.samples.items():
                if m not in self._observed:
                    self._calibrated.setdefault(m, value)
        self._observed.add(n)
        # A pass over m > n tokens could run as ceil(m / n) passes over n, so a pass that took ``seconds`` bounds
        # every wider count's cost. A slow sample may be contention, a fast one is not: costs that contention left
        # on counts the policy then never picked (too dear to draft, so never re-measured) fall at the first quiet
        # pass over fewer tokens.
        for m, old in self.samples.items():
            bound = seconds * -(-m // n)
            if m > n and old > bound:
                self.samples[m] = bound
                self._recent.pop(m, None)
        recent = self._recent.setdefault(n, deque(maxlen=WINDOW))
        value = self.samples[n] = _estimate(recent, self.samples.get(n), seconds)
        if len(recent) < CONFIRMED:
            return  # one or two passes (a count's first, say) may be an outlier: they never reprice other counts
        self._live.add(n)
        # Calibration reads passes at a short context; serving's are longer, and a wide count the policy rarely
        # picks would keep its calibrated cost while the counts it does pick grow dearer. Wider counts not yet
        # measured live take the drift this one measured.
        calibrated = self._calibrated.get(n)
        if calibrated:
            drift = max(value / calibrated, 1.0)  # only upwards: the bound above already lowers what runs faster
            for m, old in self._calibrated.items():
                if m > n and m not in self._live:
                    self.samples[m] = min(old * drift, seconds * -(-m // n))
        # More tokens never cost less. An entry that says otherwise is older than this one (a calibration at a short
        # context, a count the policy has not picked since): the fresh estimate corrects it, upwards for larger
        # counts and downwards for smaller ones. Without this, a stale 16-token entry under a measured 15 made
        # drafts at batch 8 look nearly free. (The value is the median, so one slow pass moves nothing.)
        for m, old in self.samples.items():
            if (m > n and old < value) or (m < n and old > value):
                self.samples[m] = value
                self._recent.pop(m, None)
        self._synced = len(self.samples)

    def __call__(self, n: int) -> float:
        known = self.samples
        if not known:
            return float(n)  # unmeasured: proportional to work, which is all a ratio needs
        value = known.get(n)
        if value is not None:
            return value
        if len(self._counts) != len(known):
            self._counts = sorted(known)
        xs = self._counts
        i = bisect.bisect_left(xs, n)  # xs[i - 1] < n < xs[i]
        if i == 0:
            return known[xs[0]]
        lower = xs[i - 1]
        if i == len(xs):  # past the largest measurement: extend the last segment's slope (never downwards)
            if len(xs) < 2:
                return known[lower] * n / lower
            x0, x1 = xs[-2], xs[-1]
            slope = max((known[x1] - known[x0]) / (x1 - x0), 0.0)
            return known[lower] + slope * (n - lower)
        upper = xs[i]
        w = (n - lower) / (upper - lower)
        return (1 - w) * known[lower] + w * known[upper]

    def snapshot(self) -> dict[int, float]:
        return {n: round(v * 1000, 2) for n, v in sorted(dict(self.samples).items())}  # a copy: read off-thread


class DraftConfidence:
    """How often the target accepted a draft model's drafts (or a head's), against the draft's own probability of its
    chain up to them: a draft's word calibrated by its record. A head trained for minutes is far surer than it is
    right (BENCHMARKS.md, "What a learned head's confidence is worth"), and a cut at its own word verified drafts
    that lost under load. The map is kept non-decreasing from the top down (a less sure chain is never taken to be
    worth more than a surer one measured), so it errs towards verifying less."""

    def __init__(self):
        n = CONFIDENCE_BINS
        self._counts = [[(i + 0.5) / n * CONFIDENCE_PRIOR, CONFIDENCE_PRIOR] for i in range(n)]  # [accepted, trials]
        self._curve: list[float] | None = None  # per bin, the rate kept non-decreasing; None: to be recomputed

    def observe(self, chain: list[float], accepted: int) -> None:
        """A row's verified drafts: the draft's probability of its chain up to each, and how many the target took."""
        for j, p in enumerate(chain):
            counts = self._counts[min(int(p * CONFIDENCE_BINS), CONFIDENCE_BINS - 1)]
            counts[0] = counts[0] * CONFIDENCE_DECAY + (j < accepted)
            counts[1] = counts[1] * CONFIDENCE_DECAY + 1
        self._curve = None

    def _rates(self) -> list[float]:
        if self._curve is None:
            curve, floor = [], 1.0
            for accepted, trials in reversed(self._counts):
                floor = min(floor, accepted / trials)
                curve.append(floor)
            self._curve = curve[::-1]
        return self._curve

    def needed(self, accepted: float) -> float:
        """The draft's own probability of a chain that the target accepts with probability ``accepted``: linear
        between the bins' middles (and 0 at 0); 1.0 where no chain the draft makes is accepted that often."""
        if accepted <= 0:
            return 0.0
        x0, y0 = 0.0, 0.0
        for i, y in enumerate(self._rates()):
            x = (i + 0.5) / CONFIDENCE_BINS
            if y >= accepted:
                return x0 + (x - x0) * (accepted - y0) / (y - y0)
            x0, y0 = x, y
        return 1.0

    def snapshot(self) -> dict[str, float]:
        n = CONFIDENCE_BINS
        return {f"{i / n:.1f}-{(i + 1) / n:.1f}": round(a / t, 3) for i, (a, t) in enumerate(self._counts)}


@dataclass
class RowPlan:
    """What one row offers this step: its acceptance estimate and the most drafts it can verify."""

    acceptance: RequestAcceptance
    available: int  # a free guess's length, or the row's room for a draft model's tokens
    model: bool  # drafts would come from the draft model (cost per token)
    behind: int = 0  # tokens the draft model must read for this row before it drafts (its catch-up)
    remaining: int = 0  # output tokens the row may still produce: what drafting from here on can speed up


def band(batch: int) -> int:
    """The regime a batch size belongs to: sizes from a power of two to just under the next (1, 2-3, 4-7, 8-15, ...),
    named by the power of two. A closed loop of 16 clients runs batches of 9 to 16 rows, a few steps at each size."""
    return 1 << (batch.bit_length() - 1)


FREE, MODEL = "free", "model"  # a drafting step's kind: free guesses only, or the draft model's forwards too


class _Rate:
    """Tokens a second of one kind of step, as decayed sums of its steps' tokens and seconds (a ratio of sums: a long
    step weighs by its length), with what its standard error needs: the sums of squares decayed at the square of the
    rate's decay, so the error is that of the decayed ratio, sqrt(sum w^2 (t - R s)^2) / sum w s, at no cost a step."""

    __slots__ = ("decay", "prior", "steps", "tokens", "seconds", "tt", "ts", "ss")

    def __init__(self, decay: float, prior: float = 0.0):
        self.decay, self.prior = decay, prior  # prior: the spread over the rate assumed, worth REGIME_VERDICT steps
        self.steps = 0
        self.tokens = self.seconds = self.tt = self.ts = self.ss = 0.0

    def add(self, tokens: float, seconds: float) -> None:
        d, d2 = self.decay, self.decay * self.decay
        self.steps += 1
        self.tokens = self.tokens * d + tokens
        self.seconds = self.seconds * d + seconds
        self.tt = self.tt * d2 + tokens * tokens
        self.ts = self.ts * d2 + tokens * seconds
        self.ss = self.ss * d2 + seconds * seconds

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    def error(self) -> float:
        r = self.rate
        n = self.seconds**2 / self.ss  # the steps the decayed sums are worth
        spread = max(self.tt - 2 * r * self.ts + r * r * self.ss, 0.0) / self.ss  # a step's, squared
        spread = (n * spread + REGIME_VERDICT * (self.prior * r) ** 2) / (n + REGIME_VERDICT)
        return math.sqrt(spread / n)


@dataclass
class _Probes:
    """A kind turned off in a band: its probes' spacing, the gains in a row, and its last ``REGIME_PROBES_KEPT``
    probes' (tokens, seconds)."""

    every: int = REGIME_PROBE  # refusals between probes
    gains: int = 0
    steps: deque = field(default_factory=lambda: deque(maxlen=REGIME_PROBES_KEPT))


class RegimeGuard:
    """What drafting delivered in each band of batch sizes (``band``), against plain steps in the same band: the tokens
    a second of whole steps (proposing, the pass, accepting), so a loss anything else misprices (a pass cost taken at
    another load, host work the cost model does not see, acceptance the rows over-estimate) shows here. Drafting steps
    are judged by kind: steps that ran the draft model (or head) apart from steps of free guesses only (n-gram, suffix,
    a prediction, a grammar), so a head whose guesses lose is turned off where it loses while the copies an n-gram index
    finds go on (judged together, the copies' gain hid the head's loss). Where a kind of drafting step measured under
    ``LOSS_MARGIN`` of plain ones by more than ``REGIME_SURE`` standard errors (the error of both rates, each a ratio of
    decayed sums: drafting over its last ~100 steps, plain over its last ~10; and over ``REGIME_VERDICT`` steps at
    least: a loss, not a run of bad luck), that kind stops drafting in that band and
    probes: one drafting step after ``REGIME_PROBE`` steps it was refused, then twice as many after each probe that
    loses while its probes together clearly lose (up to ``REGIME_PROBE_MAX``: a probe drafts the whole batch, at 31 rows
    several plain steps' worth). The kind comes back after ``REGIME_CONFIRM`` probes in a row each gain on their own, or
    once its probes together gain by more than their standard error: one lucky step must not undo a measured loss, and a
    kind whose steps gain on average although most single ones lose (a weak head's one draft, accepted a third of the
    time) must not stay off. The policy's own probes of a kind turned off are judged the same way. Where drafting runs,
    one step in ``REGIME_PROBE`` runs plainly, looking for no drafts, to keep the plain rate measured (one in
    ``REGIME_WARMUP`` until it is). Plain steps cost what they cost whatever the text, and within a band both kinds of
    step come at the same mix of sizes (plain ones are spread over time), so the comparison is fair although the policy
    drafts only where it expects a gain. Judged size by size, each size needed plain steps of its own before anything
    was compared, and a loss at a wandering size ran on for most of a load test's cell."""

    def __init__(self):
        self._rates: dict[tuple[int, str | None], _Rate] = {}  # (band, kind) -> its rate; kind None for plain steps
        self.off: dict[tuple[int, str], int] = {}  # (band, kind) that measured a loss -> refusals since its last probe
        self._probes: dict[tuple[int, str], _Probes] = {}  # the probes of each kind turned off
        self._since_plain: dict[int, int] = {}  # drafting steps since the last plain one, per band
        self.steps: dict[tuple[int, str | None], int] = {}  # (band, kind) -> steps seen, for a reader to diff

    def rate(self, batch: int, kind: str | None) -> float | None:
        """Tokens a second of this kind of step in this batch size's band (None: too few steps yet)."""
        kept = self._rates.get((band(batch), kind))
        if kept is None or kept.steps < REGIME_MIN_STEPS or kept.seconds <= 0:
            return None
        return kept.rate

    def is_off(self, batch: int, kind: str) -> bool:
        return (band(batch), kind) in self.off

    def allows(self, batch: int, kind: str) -> bool:
        """Whether a step at this batch size may draft this kind of step (called when the policy would): not where it
        measured a loss, except for its probes; and not for the plain step that keeps the plain rate measured, once
        every ``REGIME_PROBE`` drafting steps."""
        key = (band(batch), kind)
        if key in self.off:
            self.off[key] += 1
            if self.off[key] < self._probes[key].every:
                return False
            self.off[key] = 0
            return True
        return not self._plain_due(batch)

    def _plain_due(self, batch: int) -> bool:
        """Whether this band's next step is the plain one that keeps its plain rate measured."""
        since = self._since_plain.get(band(batch), 0)
        return since >= (REGIME_WARMUP if self.rate(batch, None) is None else REGIME_PROBE)

    def proposes(self, batch: int, kind: str) -> bool:
        """Whether a step at this batch size looks for drafts of this kind at all: not where the kind is off and its
        next probe is not yet due (a step that does not look counts as one of ``allows``'s refusals, so probes keep
        their pace), nor for the plain step that keeps the plain rate measured, which is then a plain request's step.
        Looking costs every row a lookup, and the batch the planning of its drafts, that the step would refuse."""
        key = (band(batch), kind)
        if key not in self.off:
            return not self._plain_due(batch)
        if self.off[key] + 1 >= self._probes[key].every:
            return True
        self.off[key] += 1
        return False

    def observe(self, batch: int, kind: str | None, tokens: int, seconds: float) -> None:
        batch = band(batch)
        self._since_plain[batch] = self._since_plain.get(batch, 0) + 1 if kind else 0
        self.steps[(batch, kind)] = self.steps.get((batch, kind), 0) + 1
        if seconds <= 0:
            return
        key = (batch, kind)
        if key not in self._rates:
            self._rates[key] = _Rate(REGIME_DECAY_DRAFTING, REGIME_SPREAD) if kind else _Rate(REGIME_DECAY_PLAIN)
        self._rates[key].add(tokens, seconds)
        if kind is None:
            return
        plain = self.rate(batch, None)
        if key in self.off:
            # a kind turned off drafts only in probes, the guard's or the policy's own (a single request whose guesses
            # keep hitting, every few plain steps). Judged only when the guard's came, drafting stayed off through a
            # whole cell where the policy's probes measured 2.25x plain
            self._judge_probe(key, tokens, seconds, plain)
            return
        drafting = self._rates[key]
        if plain is None or drafting.steps < REGIME_VERDICT or drafting.rate >= LOSS_MARGIN * plain:
            return
        # both rates are estimates: the plain one's error counts as well as the drafting one's
        error = math.hypot(drafting.error(), LOSS_MARGIN * self._rates[(batch, None)].error())
        if drafting.rate + REGIME_SURE * error < LOSS_MARGIN * plain:
            self.off[key] = 0
            self._probes[key] = _Probes()

    def forget(self, kind: str) -> None:
        """What this kind of drafting step measured in every band: its proposer changed."""
        for kept in (self._rates, self.off, self._probes):
            for key in [k for k in kept if k[1] == kind]:
                del kept[key]

    def _judge_probe(self, key: tuple[int, str], tokens: int, seconds: float, plain: float | None) -> None:
        """A probe's step against the plain rate, on its own and with the probes before it since the kind was turned
        off: after ``REGIME_CONFIRM`` gains in a row, or once the probes together gain by more than their standard
        error, the kind drafts again, measured afresh (the losing steps before it would turn it off again); a loss
        backs the probes off while the probes together clearly lose."""
        probes = self._probes[key]
        gained = plain is not None and tokens / seconds >= LOSS_MARGIN * plain
        probes.gains = probes.gains + 1 if gained else 0
        probes.steps.append((tokens, seconds))
        together, error = None, 0.0
        if len(probes.steps) >= REGIME_MIN_STEPS:
            measured = _Rate(1.0, REGIME_SPREAD)
            for t, s in probes.steps:
                measured.add(t, s)
            together, error = measured.rate, measured.error()
        if probes.gains >= REGIME_CONFIRM or (together is not None and plain and together - error >= plain):
            del self.off[key], self._probes[key]
            self._rates.pop(key, None)
        elif gained:
            probes.every = REGIME_PROBE
        elif together is None or plain is None or together + error < LOSS_MARGIN * plain:
            probes.every = min(2 * probes.every, REGIME_PROBE_MAX)

    def snapshot(self) -> dict:
        """Per band that ran a step: its sizes, the steps of each kind it has seen (plain, free, model: counts since
        the load, which a reader diffs to see what one stretch of load drafted, so a band is listed from its first step)
        and, per kind of drafting step measured against plain ones there, its tokens a second over plain steps' and
        whether it is off there."""
        out = {}
        steps = dict(self.steps)  # a copy: read off-thread
        for low in sorted({b for b, _ in steps}):
            plain = self.rate(low, None)
            kinds = {}
            for kind in (FREE, MODEL):
                drafting = self.rate(low, kind)
                if plain and drafting:
                    kinds[kind] = {"ratio": round(drafting / plain, 3), "off": (low, kind) in self.off}
            counts = {k or "plain": n for (b, k), n in steps.items() if b == low}
            out[low] = {"sizes": str(low) if low == 1 else f"{low}-{2 * low - 1}", "steps": counts, **kinds}
        return out


class DraftLengthPolicy:
    def __init__(self, max_k: int, adaptive: bool = True, tree_branches: int = 0):
        self.max_k = max_k
        self.adaptive = adaptive
        self.tree_branches = tree_branches  # 0: chain or tree as the costs say; 1: chains; b: b branches where possible
        self.branches = 1  # the step just planned drafts a tree of this many branches (1: a chain)
        # the step just planned: how many drafts each row verifies, where rows of free guesses in a batch are each
        # given their own (``_row_drafts``); None: every row verifies up to the width
        self.row_drafts: list[int] | None = None
        self.model_drafts = True  # the step just planned runs the draft model for its rows (``width``)
        # where the target's first token ranked among the draft's first choices when it was not the draft's first
        # (decayed counts per rank, and the misses they come from): what a tree's other branches would have caught
        self._choice_hits = list(CHOICE_PRIOR)
        self._choice_misses = 4.0
        self.guard = RegimeGuard()
        self.verify_cost = CostModel()  # target pass over n token rows
        self.draft_cost = CostModel()  # one draft-model forward over n rows: a drafted position after the first
        # a step's first drafted position over n rows: the draft's catch-up on what the rows accepted (several tokens
        # a row, and for a head its fused features), its first forward and the drafting around it. Priced as one
        # more forward, it made every position as dear as the first and deeper drafts look worse than they are
        self.draft_start_cost = CostModel()
        # a step's first drafted position where the draft first reads what it missed, by the tokens it reads (over
        # all rows): a row's prompt and answer so far, where the batch had decoded plainly since it joined. Priced
        # apart, and paid only where the rows' remaining tokens repay it: a lone request left at the end of a busy
        # spell otherwise reads its whole context through a draft model for one step's gain
        self.catch_up_cost = CostModel()
        # a target pass over n token rows that verifies draft trees: attended apart from chains (compiled passes
        # and CUDA graphs attend chains only), so priced apart; unmeasured, trees are not drafted
        self.tree_cost = CostModel()
        # running average of requests' acceptance, the prior for the next one: of their free guesses (or of the draft
        # model where it is the only proposer), and of a draft model's (or head's) drafts beside free guesses, whose
        # rate says nothing of the copies an n-gram index finds
        self.deployment_rate = 0.6
        self.model_rate = 0.6
        self.plain_steps = 0  # consecutive steps without drafts, for probing
        self.probe_debt = 0.0  # seconds the last probes cost beyond a plain step, repaid by PROBE_BUDGET of each step
        self._probing = False  # the width just returned is a probe's
        # per kind of row (FREE, MODEL) and band of batch sizes, realised and predicted extra tokens of the steps that
        # drafted (decayed sums): acceptance rates estimated per row are optimistic when guesses come in bursts, and at
        # batch 8 an optimism of 1.5x turns a predicted gain into a measured loss; what the steps actually returned
        # corrects the prediction. Kept apart by kind because a head's guesses and an n-gram index's copies err apart,
        # and by band because a wide batch drafts only its likeliest rows, whose rates were read highest, while alone
        # a row drafts whatever its rate
        self._realism: dict[tuple[str, int], list[float]] = {}
        self._delivery: dict[tuple[str, int], list[float]] = {}  # (kind, band) -> [gained, expected], decayed
        self.expected_gain: float | None = None  # of the step just planned over a plain one (None: plain, a probe)
        self.confidence = DraftConfidence()

    # ---- per request ----
    def new_request(self, prior: float | None = None, model: bool = False) -> RequestAcceptance:
        """A request's acceptance estimate for its free guesses (or a lone draft model's drafts), or with ``model``
        for a draft model's beside free guesses."""
        rate = (self.model_rate if model else self.deployment_rate) if prior is None else prior
        return RequestAcceptance(rate, PRIOR_WEIGHT)

    def end_request(self, acc: RequestAcceptance, model: RequestAcceptance | None = None) -> None:
        if acc.trials > 2 * PRIOR_WEIGHT:
            self.deployment_rate = 0.7 * self.deployment_rate + 0.3 * acc.overall
        if model is not None and model.trials > 2 * PRIOR_WEIGHT:
            self.model_rate = 0.7 * self.model_rate + 0.3 * model.overall

    def new_draft_model(self, mean_accepted: float | None, k: int | None = None) -> None:
        """A new draft model (or head generation) drafts from now on: where its mean accepted length at ``k``
        (default ``max_k``) was measured (a head's held-out acceptance), the next requests start from the rate that
        gives it. What its predecessor's steps measured (the guard's verdicts, their realism) is forgotten: a better
        head held off by an old head's loss would wait for two of its rare probes in a row to gain."""
        k = k or self.max_k
        if mean_accepted is not None and k > 0:
            self.model_rate = rate_for_mean_accepted(mean_accepted, k)
        self.guard.forget(MODEL)
        for kept in (self._realism, self._delivery):
            for key in [k for k in kept if k[0] == MODEL]:
                del kept[key]
        self.confidence = DraftConfidence()

    def realism(self, kind: str = FREE, batch: int = 1) -> float:
        """How many of the extra tokens the acceptance estimates predicted this kind of row's drafts delivered, at
        this batch size's band."""
        realised, predicted = self._realism.get((kind, band(batch)), (0.0, 0.0))
        return min((realised + REALISM_PRIOR) / (predicted + REALISM_PRIOR), 1.0)  # it only tempers optimism

    def delivery(self, kind: str = FREE, batch: int = 1) -> float:
        """What this kind of drafting step gained over plain steps at this batch size's band, against the gain expected
        of it: in a batch, a chosen step's expected gain is read through it before it is held against the margin.
        Alone, read so, a head's steps that gained over plain ones stopped: there the guard alone judges."""
        gained, expected = self._delivery.get((kind, band(batch)), (0.0, 0.0))
        return min((gained + DELIVERY_PRIOR) / (expected + DELIVERY_PRIOR), 1.0)  # it only tempers optimism

    def _delivered(self, gain: float, margin: float, kind: str, batch: int) -> bool:
        """Whether ``gain`` over a plain step, as this kind's steps in this band delivered, still beats ``margin``."""
        return gain * self.delivery(kind, batch) >= margin

    def observe_step(self, predicted: dict[str, float], realised: dict[str, int], batch: int = 1) -> None:
        """A drafting step of ``batch`` rows: per kind of row, the extra tokens (beyond one per row) ``width``
        predicted, and what the step's rows emitted."""
        for kind, expected in predicted.items():
            kept = self._realism.setdefault((kind, band(batch)), [0.0, 0.0])
            kept[0] = REALISM_DECAY * kept[0] + realised.get(kind, 0)
            kept[1] = REALISM_DECAY * kept[1] + max(expected, 1e-6)

    def observe_first_choices(self, choices: list[int], target_first: int) -> None:
        """A step that drafted from a draft model: its first choices at the first position, best first, and the token
        the target put there."""
        if not choices or target_first == choices[0]:
            return  # the first choice was right: a tree's other branches would have added nothing
        self._choice_misses = CHOICE_DECAY * self._choice_misses + 1
        for rank in range(len(self._choice_hits)):
            self._choice_hits[rank] *= CHOICE_DECAY
        if target_first in choices[: len(self._choice_hits)]:
            self._choice_hits[choices.index(target_first)] += 1

    def caught_by(self, branches: int) -> float:
        """Of the first positions the draft's first choice missed, the share its next ``branches - 1`` would catch."""
        return min(sum(self._choice_hits[1:branches]) / self._choice_misses, 1.0)

    # ---- per step ----
    def width(self, rows: list[RowPlan], trees: bool = False) -> tuple[int, dict[str, float]]:
        """This step's draft width w for the batch (row i then verifies ``min(w, rows[i].available)`` drafts), and
        the extra tokens it is expected to bring beyond one per row, per kind of row (``FREE``, ``MODEL``; empty for
        a plain step). trees: every row drafts from a draft model that can draft a tree; ``branches`` then says
        whether this step's drafts are one (see ``_tree``), and ``model_drafts`` whether the draft model drafts for
        its rows (False: only the rows with free guesses draft, and the draft model does not run)."""
        self.branches, self.row_drafts, self.expected_gain = 1, None, None
        longest = max((r.available for r in rows), default=0)
        self.model_drafts = any(r.model and r.available for r in rows)
        if longest <= 0:
            return 0, {}
        if not self.adaptive:
            b = self.tree_branches
            if trees and b > 1 and 1 + b * longest <= MAX_TREE_TOKENS and all(r.available >= longest for r in rows):
                self.branches = b
            return longest, self.expected(rows, longest)
        batch = len(rows)
        uses_model = self.model_drafts
        per_row = batch > 1 and not uses_model
        if per_row:  # free guesses in a batch: each row verifies its own count of drafts
            best_w, rows, gain = self._row_drafts(rows)
        else:
            best_w, gain = self._best(rows, trees)
        # beside free guesses, the draft model's rows are drafted only where they add to the step: priced without
        # them too (no draft forward, none of their tokens in the pass), and left out where they measured a loss
        alone = None
        if uses_model and any(not r.model and r.available for r in rows):
            alone = [r if not r.model else RowPlan(r.acceptance, 0, True) for r in rows]
            alone_w, alone_gain = self._best(alone, False)
            if alone_w and alone_gain >= gain:
                rows, best_w, gain, self.model_drafts = alone, alone_w, alone_gain, False
        if best_w and not self.guard.allows(batch, MODEL if self.model_drafts else FREE):
            best_w, self.branches = 0, 1
            if self.model_drafts and alone is not None:
                rows, gain, self.model_drafts = alone, alone_gain, False
                best_w = alone_w if alone_w and self.guard.allows(batch, FREE) else 0
        if best_w:
            self.plain_steps, self.expected_gain = 0, gain
            if per_row:
                self.row_drafts = [r.available for r in rows]
            return best_w, self.expected(rows, best_w)
        self.plain_steps += 1
        # A probe keeps the estimates alive: a draft model's acceptance (it has no free guess to compare), and for
        # free guesses that keep hitting, the cost of a long verify, which may have been measured while the machine
        # was busy and would otherwise never be measured again. A probe costs the whole batch a wider pass, so in
        # a batch of B it comes B times less often, and free guesses probe only alone (in a batch, the rows that do
        # draft keep the costs measured).
        # What a probe cost beyond a plain step is repaid before the next one (``observe_step_time``).
        if self.plain_steps >= PROBE_EVERY * batch and self.probe_debt <= 0:
            self.plain_steps = 0
            if uses_model and self._perfect_drafts_pay(rows):
                self._probing = True
                return 1, self.expected(rows, 1)
            if not uses_model and batch == 1 and any(r.acceptance.rate >= 0.5 and r.available for r in rows):
                self._probing = True
                return longest, self.expected(rows, longest)
        return 0, {}

    def _best(self, rows: list[RowPlan], trees: bool) -> tuple[int, float]:
        """The width that maximises the batch's expected tokens a second, 0 where none beats a plain step by the
        margin asked (``branches`` set where a tree wins), and its tokens a second over a plain step's."""
        batch = len(rows)
        longest = max(r.available for r in rows)
        # extra[w]: the tokens beyond one the rows bring at width w, sum_i s_i (E_i(min(w, k_i)) - 1) with E(k) - 1 =
        # a + ... + a^k (a clamped to [0, 0.999]) and s_i the realism of the row's kind, and tokens[w]: the pass's
        # token count, both built up one width at a time (this runs every step)
        drafting = [(_clamped(r), r.available) for r in rows if r.available > 0]
        realism = {kind: self.realism(kind, batch) for kind in (FREE, MODEL)}  # this runs every step: once a kind
        scale = [realism[MODEL if r.model else FREE] for r in rows if r.available > 0]
        powers = [a * s for (a, _), s in zip(drafting, scale)]
        extra, tokens = [0.0] * (longest + 1), [batch] * (longest + 1)
        for w in range(1, longest + 1):
            more, n = extra[w - 1], tokens[w - 1]
            for i, (a, k) in enumerate(drafting):
                if k >= w:
                    more += powers[i]
                    powers[i] *= a
                    n += 1
            extra[w], tokens[w] = more, n
        drafts = any(r.model and r.available for r in rows)
        best_w, best_rate = 0, batch / self.verify_cost(batch)
        base_rate = best_rate
        for w in range(1, longest + 1):
            seconds = self.verify_cost(tokens[w]) + (self.drafting_seconds(batch, w) if drafts else 0.0)
            rate = (batch + extra[w]) / seconds
            if rate > best_rate:
                best_w, best_rate = w, rate
        if trees and self.tree_branches != 1 and self.tree_cost.samples and all(r.available >= 1 for r in rows):
            best_w, best_rate = self._tree(rows, self.drafting_seconds(batch, 1), best_w, best_rate)
        margin = MIN_GAIN if batch == 1 else MIN_GAIN_BATCH
        if best_w and not self._delivered(best_rate / base_rate, margin, MODEL if drafts else FREE, batch):
            best_w, self.branches = 0, 1
        if best_w and drafts and not self._catch_up_repaid(rows, base_rate, best_rate):
            best_w, self.branches = 0, 1
        return best_w, (best_rate / base_rate if best_w else 1.0)

    def _catch_up_repaid(self, rows: list[RowPlan], base_rate: float, best_rate: float) -> bool:
        """Whether drafting from here on, at ``best_rate`` tokens a second against ``base_rate`` plainly, saves more
        over the rows' remaining tokens than the draft's catch-up costs beyond a steady step's start (free where it
        was never measured: a head's catch-up is a few rows of one layer's products)."""
        fed = sum(r.behind for r in rows if r.model and r.available)
        if not self.catch_up_cost.samples or fed <= 2 * len(rows):
            return True
        start = self.draft_start_cost(len(rows)) if self.draft_start_cost.samples else 0.0
        extra = self.catch_up_cost(fed) - start
        remaining = sum(r.remaining for r in rows)
        return remaining * (1 / base_rate - 1 / best_rate) >= extra

    def _row_drafts(self, rows: list[RowPlan]) -> tuple[int, list[RowPlan], float]:
        """A batch of free guesses: each row verifies its own number of drafts, the batch's likeliest first (a row's
        j-th draft is accepted with a^j, times the realism of free guesses) for as long as they raise the step's
        expected tokens a second. A row's chances fall along its drafts, so the n likeliest drafts of the batch are
        always a prefix of each row's, and for every count of pass tokens this is the most tokens that count can
        bring: it beats any one width for all rows, which at 16 rows of 4-bit weights (a pass costing nearly in
        proportion to its tokens) made fifteen rows wait on drafts accepted half the time to let one row copy.
        Returns the widest row's drafts (0 where nothing beats a plain step by ``MIN_GAIN_BATCH``), the rows, each
        available as far as it drafts, and the expected gain over a plain step."""
        batch = len(rows)
        realism = self.realism(FREE, batch)
        chances: list[tuple[float, int]] = []  # (a draft's chance, its row), every row's drafts in order
        for i, r in enumerate(rows):
            a = _clamped(r)
            chance = a * realism
            for _ in range(r.available):
                chances.append((chance, i))
                chance *= a
        chances.sort(key=lambda c: -c[0])  # stable: a row's drafts stay in order where their chances tie
        base = best_rate = batch / self.verify_cost(batch)
        taken, extra = 0, 0.0
        for n, (chance, _) in enumerate(chances, 1):
            extra += chance
            rate = (batch + extra) / self.verify_cost(batch + n)
            if rate > best_rate:
                taken, best_rate = n, rate
        if not self._delivered(best_rate / base, MIN_GAIN_BATCH, FREE, batch):
            return 0, rows, 1.0
        drafts = [0] * batch
        for _, i in chances[:taken]:
            drafts[i] += 1
        return max(drafts), [RowPlan(r.acceptance, d, r.model) for r, d in zip(rows, drafts)], best_rate / base

    def drafting_seconds(self, batch: int, w: int) -> float:
        """What a draft model (or head) drafting ``w`` positions for ``batch`` rows costs: the first position's
        start (priced as a forward until measured), then a forward for each later one."""
        if w <= 0:
            return 0.0
        start = self.draft_start_cost(batch) if self.draft_start_cost.samples else self.draft_cost(batch)
        return start + (w - 1) * self.draft_cost(batch)

    def expected(self, rows: list[RowPlan], w: int) -> dict[str, float]:
        """The extra tokens width ``w`` is expected to bring, per kind of row, from the rows' rates alone (what
        ``realism`` compares with what the step delivers): a + ... + a^k a chain, (a + (1 - a) c) (1 + ... + a^(k-1))
        a tree."""
        caught = self.caught_by(self.branches) if self.branches > 1 else 0.0
        out: dict[str, float] = {}
        for r in rows:
            k = min(w, r.available)
            if k <= 0:
                continue
            a = _clamped(r)
            chain = (1 - a**k) / (1 - a)  # 1 + a + ... + a^(k-1)
            kind = MODEL if r.model else FREE
            out[kind] = out.get(kind, 0.0) + (a + (1 - a) * caught) * chain
        return out

    def _tree(self, rows: list[RowPlan], draft_seconds: float, best_w: int, best_rate: float) -> tuple[int, float]:
        """The best of the chain found and trees of 2..``MAX_BRANCHES`` branches (the draft's best tokens at the first
        position, a chain under each, ``w`` deep): (w, tokens a second), ``branches`` set to the winner. A row's
        first draft is then accepted with probability a + (1 - a) c (c: ``caught_by``), and each later one with a,
        as in a chain; the pass verifies ``1 + b w`` tokens a row, and the draft runs once over the rows and
        ``w - 1`` times over b tokens a row."""
        batch = len(rows)
        realism = self.realism(MODEL, batch)
        rates = [_clamped(r) for r in rows]
        shortest = min(r.available for r in rows)
        forced = self.tree_branches if self.tree_branches > 1 else 0
        if forced:  # a tree whenever drafting pays: the best width for one, whatever a chain would bring
            best_rate = 0.0
        for b in [forced] if forced else range(2, MAX_BRANCHES + 1):
            caught = self.caught_by(b)
            chain = [1.0] * batch  # per row 1 + a + ... + a^(w-1)
            power = [1.0] * batch
            for w in range(1, min(shortest, (MAX_TREE_TOKENS - 1) // b) + 1):
                extra = sum((a + (1 - a) * caught) * c for a, c in zip(rates, chain))
                seconds = self.tree_cost(batch * (1 + b * w)) + draft_seconds + (w - 1) * self.draft_cost(batch * b)
                rate = (batch + realism * extra) / seconds
                if rate > best_rate:
                    best_w, best_rate, self.branches = w, rate, b
                for i, a in enumerate(rates):
                    power[i] *= a
                    chain[i] += power[i]
        return best_w, best_rate

    def observe_step_time(
        self, seconds: float, batch: int, emitted: int | None = None, kind: str | None = None
    ) -> None:
        """A step's whole time: a probe's beyond a plain step's is owed, and every other step repays a share. With
        ``emitted`` (the tokens it produced), the guard compares this kind of step (None plain; ``MODEL`` where a
        draft model or head drafted a row) with plain steps at this batch size."""
        if emitted is not None and self.adaptive:
            self.guard.observe(batch, kind, emitted, seconds)
            plain = self.guard.rate(batch, None) if kind and batch > 1 and self.expected_gain else None
            if plain and seconds > 0:
                kept = self._delivery.setdefault((kind, band(batch)), [0.0, 0.0])
                kept[0] = DELIVERY_DECAY * kept[0] + emitted / seconds / plain
                kept[1] = DELIVERY_DECAY * kept[1] + self.expected_gain
            if kind is None:
                low = band(batch)
                for kept in (sums.get((k, low)) for sums in (self._realism, self._delivery) for k in (FREE, MODEL)):
                    if kept is not None:  # what was delivered drifts towards what was expected
                        kept[0] = kept[1] - (kept[1] - kept[0]) * REALISM_FORGET
        self.expected_gain = None
        if self._probing:
            self.probe_debt += max(seconds - self.verify_cost(batch), 0.0)
            self._probing = False
        else:
            self.probe_debt = max(self.probe_debt - PROBE_BUDGET * seconds, 0.0)

    def draft_threshold(self, batch: int) -> float:
        """The probability a draft model's draft must have (its chain's so far, as the draft sees it) to be worth
        verifying: the chance of acceptance that pays for what one more drafted position costs the batch (a draft
        forward, and a token more a row in the verify pass) over what a plain step costs it, since a draft accepted
        with probability p saves p of a plain step's token, read through how often drafts the draft was that sure of
        were accepted (``DraftConfidence``). A one-layer head's forward costs a few percent of a target pass, a draft
        model's up to a third or more: the cheaper the draft, the less sure it need be. 0 before the draft's cost is
        measured; 1.0 where no draft would pay."""
        if not self.draft_cost.samples or not self.verify_cost.samples:
            return 0.0
        plain = self.verify_cost(batch)
        extra = self.draft_cost(batch) + self.verify_cost(2 * batch) - plain
        return self.confidence.needed(min(max(extra / plain, 0.0), 1.0))

    def observe_confidence(self, chain: list[float], accepted: int) -> None:
        """A row's verified draft-model drafts: the draft's probability of its chain up to each, and how many the
        target accepted."""
        self.confidence.observe(chain, accepted)

    def _perfect_drafts_pay(self, rows: list[RowPlan]) -> bool:
        """Whether drafts that were all accepted would beat a plain step by the margin asked of any drafting. Where
        not even they would (4-bit products on a CPU are compute-bound: a pass costs in proportion to its tokens),
        probing a draft model's acceptance pays its forwards, and its catch-up on every token it missed, for
        nothing."""
        batch = len(rows)
        margin = (MIN_GAIN if batch == 1 else MIN_GAIN_BATCH) * batch / self.verify_cost(batch)
        for w in range(1, max(r.available for r in rows) + 1):
            tokens = batch + sum(min(w, r.available) for r in rows)
            if tokens / (self.verify_cost(tokens) + self.drafting_seconds(batch, w)) >= margin:
                return True
        return False

    def restore(self, kept: dict) -> None:
        """Start from pass costs a ``snapshot`` of an earlier load of the same deployment on this machine held (as
        calibration would, and refined by its serving since)."""
        kept_costs = (
            (self.verify_cost, "verify_ms"),
            (self.draft_cost, "draft_ms"),
            (self.draft_start_cost, "draft_start_ms"),
            (self.tree_cost, "tree_ms"),
            (self.catch_up_cost, "catch_up_ms"),
        )
        for cost, name in kept_costs:
            cost.samples.update({int(n): ms / 1000 for n, ms in kept.get(name, {}).items()})

    def snapshot(self) -> dict:
        return {
            "adaptive": self.adaptive,
            "max_draft_tokens": self.max_k,
            "verify_ms": self.verify_cost.snapshot(),  # token rows in the pass -> ms
            "draft_ms": self.draft_cost.snapshot(),  # rows in a draft forward -> ms
            "draft_start_ms": self.draft_start_cost.snapshot(),  # rows -> ms, a step's first drafted position
            "tree_ms": self.tree_cost.snapshot(),  # token rows in a pass over draft trees -> ms
            "catch_up_ms": self.catch_up_cost.snapshot(),  # tokens a draft reads before drafting -> its start, ms
            "expected_acceptance": round(self.deployment_rate, 3),
            "expected_model_acceptance": round(self.model_rate, 3),  # a draft model's or head's beside free guesses
            "realised_over_predicted": {
                kind: {low: round(self.realism(kind, low), 3) for k, low in sorted(list(self._realism)) if k == kind}
                for kind in (FREE, MODEL)
            },
            "gained_over_expected": {
                kind: {low: round(self.delivery(kind, low), 3) for k, low in sorted(list(self._delivery)) if k == kind}
                for kind in (FREE, MODEL)
            },
            "drafting_over_plain": self.guard.snapshot(),  # per batch size, whole steps' tokens a second
            # of the first positions a draft model's first choice missed, the share its 2nd, 2nd-3rd, 2nd-4th caught
            "first_choice_misses_caught": [round(self.caught_by(b), 3) for b in range(2, MAX_BRANCHES + 1)],
            # per tenth of a draft model's own probability of its chain, how often the target accepted such drafts
            "draft_confidence": self.confidence.snapshot(),
        }
