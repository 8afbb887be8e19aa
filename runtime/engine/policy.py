"""How many tokens to draft each step, so that speculation does not lose to plain decoding.

A step that drafts ``k`` tokens costs ``verify(k)`` (one target forward over ``k + 1`` tokens) plus ``k`` draft
forwards for a draft model (an n-gram lookup is free), and emits on average

    E(k) = 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)

tokens when each draft token is accepted with probability ``a`` (Leviathan et al. 2023, eq. 1). The policy picks
the ``k`` in ``0..K`` that maximises ``E(k) / cost(k)``; ``k = 0`` is a plain decode step. So it stops drafting
while drafts do not pay, and drafts less where verifying many tokens is dear (on a CPU, verifying 4 tokens costs
about twice a single step; on a GPU about the same as one).

- ``verify(k)`` and the per-token draft cost are measured when the deployment loads (``calibrate``) and then
  follow every step (an EMA; a measurement under half the estimate replaces it at once, so a calibration taken on
  a busy machine recovers); lengths never measured are interpolated.
- ``a`` is estimated per request from its own steps (n accepted of n + 1 tries after a rejection, n of n after a
  full accept), starting from the deployment's running average, and separately for the two states a request can
  be in: right after a fully accepted step, and right after a rejection (``RequestAcceptance``). While it is
  not drafting, an n-gram proposal is still computed (free) and compared with the token the target produced, so
  the estimate keeps moving;
  a draft model is probed with one token every ``PROBE_EVERY`` plain steps, and a free proposer whose guesses
  keep hitting drafts K on those steps, re-measuring a verify cost that may have been taken on a busy machine.
"""

from __future__ import annotations


EMA = 0.2  # weight of a new cost measurement
REQUEST_DECAY = 0.85  # per-step decay of a request's acceptance counts: recent steps matter most
PRIOR_WEIGHT = 3.0  # how many pseudo-trials the deployment's average is worth at a request's start
PROBE_EVERY = 8
MIN_GAIN = 1.03  # speculate only when it is expected to beat plain decoding by at least 3%


def _track(old: float | None, sample: float) -> float:
    """Follow a cost with an EMA, except that a sample under half the estimate replaces it at once: a calibration
    taken on a busy machine (contention can make a pass 10x slower) must not switch speculation off for good.
    Small drops are averaged, not taken: a running minimum would favour whichever length is measured most often
    (its luckiest sample) over lengths measured rarely."""
    if old is None or sample < 0.5 * old:
        return sample
    return (1 - EMA) * old + EMA * sample


class RequestAcceptance:
    """A request's acceptance rate, kept in two states: after a step whose drafts were all accepted (the output is
    copying something: an n-gram match or a draft model that agrees, and the next draft is likely to pass too) and
    after a step with a rejection. Copying comes in runs, so one averaged rate drafts too short inside a run and too
    long outside it; the rate of the state the request is in now decides the next draft length."""

    def __init__(self, rate: float, weight: float):
        # [accepted, trials] after a full accept, and after a rejection (or at the start)
        self._counts = [[rate * weight, weight], [rate * weight, weight]]
        self._state = 1
        self.plain_steps = 0

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


class DraftLengthPolicy:
    def __init__(self, max_k: int, draft_costs_per_token: bool, adaptive: bool = True):
        self.max_k = max_k
        self.adaptive = adaptive
        self.draft_costs_per_token = draft_costs_per_token
        self.verify_cost: dict[int, float] = {}  # k -> seconds for a target forward over k + 1 tokens
        self.draft_cost: float | None = None  # seconds per drafted token (draft model only)
        self.deployment_rate = 0.6  # running average of requests' acceptance, the prior for the next one

    # ---- per request ----
    def new_request(self, prior: float | None = None) -> RequestAcceptance:
        rate = self.deployment_rate if prior is None else prior
        return RequestAcceptance(rate, PRIOR_WEIGHT)

    def end_request(self, acc: RequestAcceptance) -> None:
        if acc.trials > 2 * PRIOR_WEIGHT:
            self.deployment_rate = 0.7 * self.deployment_rate + 0.3 * acc.overall

    def choose(self, acc: RequestAcceptance, limit: int, max_k: int | None = None, free: bool = False) -> int:
        """Draft length for the next step; ``limit`` caps it (tokens left before max_tokens / the context).

        ``max_k`` and ``free`` override the deployment's K and draft cost (a request's predicted output drafts
        without a draft model)."""
        max_k = min(self.max_k if max_k is None else max_k, limit)
        per_token = 0.0 if free or not self.draft_costs_per_token else (self.draft_cost or 0.0)
        if max_k <= 0:
            return 0
        if not self.adaptive or not self.verify_cost:
            return max_k
        base = self.cost(0)
        best_k, best_rate = 0, 1.0 / base
        a = min(acc.rate, 0.999)
        expected, power = 1.0, 1.0
        for k in range(1, max_k + 1):
            power *= a
            expected += power
            rate = expected / (self.cost(k) + k * per_token)
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_k and best_rate < MIN_GAIN / base:
            best_k = 0
        if best_k == 0:
            acc.plain_steps += 1
            if acc.plain_steps % PROBE_EVERY == 0:
                # A probe keeps the estimates alive: a draft model's acceptance (it has no free shadow guess), and
                # for a free proposer whose guesses keep hitting, the cost of a long verify, which may have been
                # measured while the machine was busy and would otherwise never be measured again.
                if per_token:
                    return 1
                if a >= 0.5:
                    return max_k
        return best_k

    # ---- costs ----
    def observe_verify(self, k: int, seconds: float) -> None:
        self.verify_cost[k] = _track(self.verify_cost.get(k), seconds)

    def observe_draft(self, tokens: int, seconds: float) -> None:
        if tokens <= 0:
            return
        self.draft_cost = _track(self.draft_cost, seconds / tokens)

    def cost(self, k: int) -> float:
        """verify(k), interpolated linearly between measured lengths (and flat past the longest measured)."""
        known = self.verify_cost
        if k in known:
            return known[k]
        lower = max((j for j in known if j < k), default=None)
        upper = min((j for j in known if j > k), default=None)
        if lower is None:
            return known[upper]
        if upper is None:
            return known[lower]
        w = (k - lower) / (upper - lower)
        return (1 - w) * known[lower] + w * known[upper]

    def snapshot(self) -> dict:
        return {
            "adaptive": self.adaptive,
            "max_draft_tokens": self.max_k,
            "verify_ms": {k: round(v * 1000, 2) for k, v in sorted(self.verify_cost.items())},
            "draft_ms_per_token": None if self.draft_cost is None else round(self.draft_cost * 1000, 2),
            "expected_acceptance": round(self.deployment_rate, 3),
        }
