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

import functools
from collections.abc import Callable
from dataclasses import dataclass

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


# ---- draft trees (SpecInfer, Miao et al. 2024; EAGLE-2, Li et al. 2024) ---------------------------------------------
# A tree offers several candidates at a position: the target verifies every node in one pass (a node sees the row's
# cache and its own ancestors) and the row keeps the longest path it agrees with. A node's candidates are distinct
# tokens the proposer chose deterministically (its top-k), so each is a one-hot draft: under sampling, candidate c
# is accepted with probability p(c) renormalised over the candidates not yet rejected, and after every candidate is
# rejected the token comes from p without them. That is sampling from p in steps, so the output is distributed as p
# (for two candidates: P(c1) = p(c1), P(c2) = (1 - p(c1)) p(c2) / (1 - p(c1)) = p(c2), and likewise for the rest).


@dataclass(frozen=True)
class DraftTree:
    """Draft tokens as a tree: node i holds ``tokens[i]`` and hangs under ``parents[i]`` (-1: the root, the row's
    last accepted token). A parent comes before its children, and a node's children are tried in their order. In a
    verify pass the row's stream is ``[root] + tokens``: node i sits at stream position i + 1, and the target's
    distribution at a node's position is its prediction for the token after that node."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self):
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.parents)} parents")
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"node {i}'s parent is {parent}: a parent must come before its child (or be -1)")

    @classmethod
    def chain(cls, tokens: list[int]) -> "DraftTree":
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    @staticmethod
    def grown_parents(branches: int, width: int) -> tuple[int, ...]:
        """The parents of a tree of ``branches`` candidates at the first position and a chain under each, ``width``
        deep, its tokens depth by depth (as a draft model grows it, a depth a pass)."""
        parents = [-1] * branches
        for depth in range(1, width):
            parents += range((depth - 1) * branches, depth * branches)
        return tuple(parents)

    @classmethod
    def grown(cls, branches: int, width: int, tokens: list[int] | None = None) -> "DraftTree":
        parents = cls.grown_parents(branches, width)
        return cls(tuple(tokens) if tokens is not None else (0,) * len(parents), parents)

    def __len__(self) -> int:
        return len(self.tokens)

    def __iter__(self):
        return iter(self.tokens)

    @functools.cached_property
    def depths(self) -> tuple[int, ...]:
        """Each node's depth, 1 for the root's children: the position past the row's length it stands for."""
        out: list[int] = []
        for parent in self.parents:
            out.append(1 if parent < 0 else out[parent] + 1)
        return tuple(out)

    @functools.cached_property
    def _children(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for i, parent in enumerate(self.parents):
            out.setdefault(parent, []).append(i)
        return out

    def children(self, node: int) -> list[int]:
        return self._children.get(node, [])

    def follow(self, tokens: list[int]) -> list[int]:
        """The nodes of the branch that spells ``tokens`` from the top, as far as the tree has it."""
        node, out = -1, []
        for token in tokens:
            node = next((c for c in self.children(node) if self.tokens[c] == token), None)
            if node is None:
                break
            out.append(node)
        return out

    def branch(self, path: list[int]) -> list[int]:
        """The chain a verified branch stands for: the tokens along ``path``, then the first candidates below it to
        the tree's depth (what a chain step would have drafted and seen rejected)."""
        tokens = [self.tokens[n] for n in path]
        node = path[-1] if path else -1
        while self.children(node):
            node = self.children(node)[0]
            tokens.append(self.tokens[node])
        return tokens

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to ``node``."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]


# pick(stream position, depth, candidate tokens) -> (the index of the accepted candidate, or None with the token
# the target emits there)
Pick = Callable[[int, int, list[int]], tuple[int | None, int]]


def _walk(tree: DraftTree, pick: Pick) -> tuple[list[int], int]:
    node, path = -1, []
    while True:
        kids = tree.children(node)
        chosen, token = pick(node + 1, len(path), [tree.tokens[c] for c in kids])
        if chosen is None:
            return path, token
        node = kids[chosen]
        path.append(node)


def verify_tree_greedy(tree: DraftTree, target_argmax: list[int]) -> tuple[list[int], int]:
    """Return (the accepted nodes, root's child first; the token the target adds after them).

    target_argmax: the target's greedy choice at each of the row's ``len(tree) + 1`` stream positions
    """

    def pick(at: int, depth: int, candidates: list[int]) -> tuple[int | None, int]:
        best = target_argmax[at]
        return (candidates.index(best), best) if best in candidates else (None, best)

    return _walk(tree, pick)


def verify_tree_seeded(tree: DraftTree, target_probs: torch.Tensor, seed: int, position: int) -> tuple[list[int], int]:
    """``verify_seeded`` over a tree: at each depth the target's token is the one the seed alone decides, and the
    walk follows the candidate equal to it. target_probs: [len(tree) + 1, vocab]"""

    def pick(at: int, depth: int, candidates: list[int]) -> tuple[int | None, int]:
        token = inverse_cdf(target_probs[at], position_uniform(seed, position + depth))
        return (candidates.index(token), token) if token in candidates else (None, token)

    return _walk(tree, pick)


def verify_tree_sampled(
    tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator | None
) -> tuple[list[int], int]:
    """Sampling over a tree of one-hot candidates (see above). target_probs: [len(tree) + 1, vocab]"""

    def pick(at: int, depth: int, candidates: list[int]) -> tuple[int | None, int]:
        p = target_probs[at].clone()
        for i, token in enumerate(candidates):
            left = float(p.sum())
            if left > 0 and float(torch.rand((), generator=generator)) * left < float(p[token]):
                return i, token
            p[token] = 0.0  # rejected: the rest of p, renormalised by the next draw's ``left``
        if float(p.sum()) <= 0:  # the candidates held all of p's mass (round-off): fall back to p
            p = target_probs[at]
        return None, int(torch.multinomial(p, 1, generator=generator))

    return _walk(tree, pick)
