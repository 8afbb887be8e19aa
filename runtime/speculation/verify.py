"""Verification: which drafted tokens the target accepts, and the one token the target adds.

Terms, used the same way everywhere in the engine (after vLLM's rejection sampler):

- **draft tokens** ``d_1..d_k``: what the proposer guessed after the last accepted token.
- **target_probs** ``p_i``: the target's distribution for position ``i`` given everything before it, from ONE
  forward pass over ``[last, d_1..d_k]``; there are ``k + 1`` of them.
- **draft_probs** ``q_i``: the proposer's distribution ``d_i`` was sampled from (one-hot for an n-gram draft).
- **accepted**: the longest prefix ``d_1..d_n`` that passes the test below.
- **recovered** token: after the first rejection at position ``n + 1`` (n < k), a token sampled from the residual
  ``norm(max(0, p_{n+1} - q_{n+1}))``; with greedy decoding, the target's argmax at that position.
- **bonus** token: after a full accept (n = k), a token sampled from ``p_{k+1}`` at no extra cost.

Every step therefore emits ``n + 1`` tokens (accepted + recovered-or-bonus), at least one.

Sampling test (Leviathan et al. 2023, arXiv 2211.17192, Alg. 1; Chen et al. 2023, arXiv 2302.01318): accept
``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))``. Accepted tokens and the recovered token together are
distributed exactly as samples from ``p``. Greedy: accept while ``d_i == argmax p_i``, which reproduces the
target's greedy output token for token.
"""

from __future__ import annotations

import torch


def verify_greedy(draft_tokens: list[int], target_argmax: list[int]) -> tuple[int, int]:
    """Return (number accepted, recovered-or-bonus token).

    draft_tokens: k ints; target_argmax: the target's k + 1 (or more, padding) greedy choices for this row
    """
    n = 0
    for draft, best in zip(draft_tokens, target_argmax):
        if draft != best:
            break
        n += 1
    return n, target_argmax[n]


def verify_sampled(
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Rejection sampling. Return (number accepted, recovered-or-bonus token).

    draft_tokens: k ints
    draft_probs: [k, vocab], or None for a deterministic (one-hot) draft such as an n-gram lookup
    target_probs: [k + 1, vocab]
    """
    k = len(draft_tokens)
    device = target_probs.device
    n = k
    if k:
        drafts = torch.tensor(draft_tokens, device=device)  # [k]
        p = target_probs[:k].gather(1, drafts[:, None]).squeeze(1)  # [k]
        q = draft_probs[:k].gather(1, drafts[:, None]).squeeze(1) if draft_probs is not None else torch.ones_like(p)
        u = torch.rand(k, device=device, generator=generator)  # [k]
        # u < p / q, written without the division (q > 0: d_i was sampled from q)
        rejected = (u * q >= p).tolist()
        n = rejected.index(True) if True in rejected else k
    if n == k:
        bonus = torch.multinomial(target_probs[k], 1, generator=generator)
        return k, int(bonus)
    if draft_probs is not None:
        residual = (target_probs[n] - draft_probs[n]).clamp_min(0.0)  # [vocab]
    else:
        residual = target_probs[n].clone()
        residual[draft_tokens[n]] = 0.0
    total = residual.sum()
    # Residual mass is zero only when p == q at this position, where rejection has probability zero; guard
    # against the float round-off case anyway by falling back to p.
    dist = residual / total if float(total) > 0 else target_probs[n]
    recovered = torch.multinomial(dist, 1, generator=generator)
    return n, int(recovered)


# ---- seeded sampling: the seed alone decides the output -------------------------------------------------------
# Rejection sampling is exact in distribution, but which token comes out depends on where drafts were verified and
# on the random draws each verify consumed, so a seeded request would change with its draft lengths, which depend on
# the batch and on measured costs. For a seeded request, the target's token at output position ``i`` is instead the
# inverse-CDF sample of ``p_i`` at a uniform ``u_i`` that is a function of (seed, i) alone; a draft token is accepted
# when it equals that sample. Every emitted token is then exactly what plain sampling with the same ``u_i`` emits,
# whatever was drafted (acceptance is sum_x p(x) q(x) instead of rejection sampling's sum_x min(p(x), q(x)): the
# price of reproducibility, paid only by seeded requests).

_MASK64 = (1 << 64) - 1


def position_uniform(seed: int, position: int) -> float:
    """A uniform in [0, 1) from (seed, position): splitmix64 of the pair, deterministic across runs and machines."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """The token whose CDF interval holds ``u``. probs: [vocab]"""
    cdf = probs.double().cumsum(0)  # [vocab]
    x = torch.tensor([u * float(cdf[-1])], dtype=torch.float64, device=probs.device)
    return min(int(torch.searchsorted(cdf, x, right=True)), probs.shape[0] - 1)


def verify_seeded(draft_tokens: list[int], target_probs: torch.Tensor, seed: int, position: int) -> tuple[int, int]:
    """Sample-and-compare for seeded requests. Return (number accepted, the target's token after them).

    target_probs: [k + 1, vocab]; ``position``: the output index of the first verified position
    """
    n = 0
    for i in range(len(draft_tokens) + 1):
        token = inverse_cdf(target_probs[i], position_uniform(seed, position + i))
        if i == len(draft_tokens) or token != draft_tokens[i]:
            return n, token
        n += 1
    raise AssertionError("unreachable")
