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


def verify_greedy(draft_tokens: list[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """Return (number accepted, recovered-or-bonus token).

    draft_tokens: k ints; target_logits: [k + 1, vocab]
    """
    target_argmax = target_logits.argmax(dim=-1).tolist()  # k + 1 ints; the step's only host sync
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
