"""The rejection sampler reproduces the target distribution (Leviathan et al. 2023, Theorem 1)."""

from __future__ import annotations

import torch

from depctl_runtime.speculation.verify import (
    inverse_cdf,
    position_uniform,
    verify_greedy,
    verify_sampled,
    verify_seeded,
)

VOCAB = 6
TRIALS = 40_000


def _first_token_distribution(draft_probs: torch.Tensor | None, target_probs: torch.Tensor, draft_dist: torch.Tensor):
    """Sample a one-token draft from ``draft_dist``, verify it, histogram the first emitted token."""
    gen = torch.Generator().manual_seed(1234)
    counts = torch.zeros(VOCAB)
    for _ in range(TRIALS):
        d = int(torch.multinomial(draft_dist, 1, generator=gen))
        n, next_token = verify_sampled([d], draft_probs, target_probs, gen)
        counts[d if n == 1 else next_token] += 1
    return counts / TRIALS


def _tv(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p - q).abs().sum())


def test_rejection_sampling_matches_the_target_not_the_draft():
    target = torch.tensor([0.05, 0.40, 0.05, 0.30, 0.10, 0.10])
    draft = torch.tensor([0.40, 0.05, 0.30, 0.05, 0.10, 0.10])
    assert _tv(target, draft) > 0.5  # the two are far apart, so the test can tell them apart
    # target_probs rows: position 0 scores the draft token, position 1 the bonus
    empirical = _first_token_distribution(draft[None, :], torch.stack([target, target]), draft)
    # 40k samples over 6 outcomes: sampling noise in TV is ~0.005; a wrong residual shows up as >0.1
    assert _tv(empirical, target) < 0.015
    assert _tv(empirical, draft) > 0.45


def test_one_hot_draft_ngram_also_matches_the_target():
    # an n-gram draft is deterministic: a one-hot draft distribution (draft_probs=None)
    target = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.15, 0.1])
    fixed = torch.zeros(VOCAB)
    fixed[2] = 1.0
    empirical = _first_token_distribution(None, torch.stack([target, target]), fixed)
    assert _tv(empirical, target) < 0.015


def test_greedy_accepts_the_matching_prefix():
    argmax = [3, 5, 1, 7]  # the target's choice at each verified position
    assert verify_greedy([3, 5, 2], argmax) == (2, 1)  # d0, d1 accepted; 2 rejected, target says 1 (recovered)
    assert verify_greedy([3, 5, 1], argmax) == (3, 7)  # all accepted; 7 is the bonus token
    assert verify_greedy([], argmax) == (0, 3)  # no draft: a plain decode step (later entries: padding)


def test_seeded_verification_emits_what_plain_sampling_emits():
    # sample-and-compare: whatever was drafted, position i's token is the inverse-CDF draw at u(seed, i)
    gen = torch.Generator().manual_seed(0)
    target = torch.rand(5, VOCAB, generator=gen).softmax(-1)  # [k + 1, vocab]
    plain = [inverse_cdf(target[i], position_uniform(42, 10 + i)) for i in range(5)]
    for drafts in ([], plain[:4], plain[:2] + [(plain[2] + 1) % VOCAB, plain[3]], [(plain[0] + 1) % VOCAB]):
        n, token = verify_seeded(drafts, target[: len(drafts) + 1], seed=42, position=10)
        assert drafts[:n] + [token] == plain[: n + 1]


def test_seeded_draws_follow_the_distribution():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.15, 0.1])
    counts = torch.zeros(VOCAB)
    for i in range(TRIALS):
        counts[inverse_cdf(probs, position_uniform(7, i))] += 1
    assert _tv(counts / TRIALS, probs) < 0.015
