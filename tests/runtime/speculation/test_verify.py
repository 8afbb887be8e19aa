"""The rejection sampler reproduces the target distribution (Leviathan et al. 2023, Theorem 1)."""

from __future__ import annotations

import pytest
import torch

from depctl_runtime.speculation.verify import (
    DraftTree,
    inverse_cdf,
    position_uniform,
    verify_greedy,
    verify_sampled,
    verify_seeded,
    verify_tree_greedy,
    verify_tree_sampled,
    verify_tree_seeded,
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


# ---- draft trees ----
#   root -> 3 -> 5 -> 1
#        -> 4 -> 6
#             -> 5
TREE = DraftTree(tokens=(3, 5, 1, 4, 6, 5), parents=(-1, 0, 1, -1, 3, 3))


def test_a_tree_knows_its_shape_and_refuses_a_child_before_its_parent():
    assert TREE.depths == (1, 2, 3, 1, 2, 2)
    assert TREE.children(-1) == [0, 3] and TREE.children(3) == [4, 5] and TREE.children(2) == []
    assert TREE.path(5) == [3, 5]
    assert DraftTree.chain([7, 8, 9]) == DraftTree((7, 8, 9), (-1, 0, 1))
    with pytest.raises(ValueError, match="parent must come before"):
        DraftTree((1, 2), (1, -1))
    with pytest.raises(ValueError, match="2 tokens but 1 parents"):
        DraftTree((1, 2), (-1,))


def test_greedy_follows_the_branch_the_target_chooses():
    # stream positions: 0 root, then node i at i + 1; the argmax at a node's position is what follows that node
    argmax = [4, 9, 9, 9, 5, 9, 2]  # root -> 4 (node 3) -> 5 (node 5) -> 2: no child of node 5, so 2 is the bonus
    assert verify_tree_greedy(TREE, argmax) == ([3, 5], 2)
    argmax = [3, 5, 8, 9, 9, 9, 9]  # root -> 3 -> 5 -> 8, where node 1's only child drafted 1: recovered 8
    assert verify_tree_greedy(TREE, argmax) == ([0, 1], 8)
    assert verify_tree_greedy(TREE, [7] * 7) == ([], 7)  # no candidate at the root


def test_a_chain_tree_verifies_as_a_chain():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        k = int(torch.randint(0, 6, (), generator=gen))
        drafts = torch.randint(0, 4, (k,), generator=gen).tolist()
        argmax = torch.randint(0, 4, (k + 1,), generator=gen).tolist()
        path, token = verify_tree_greedy(DraftTree.chain(drafts), argmax)
        assert (len(path), token) == verify_greedy(drafts, argmax) and path == list(range(len(path)))


def test_seeded_tree_verification_emits_what_plain_sampling_emits():
    gen = torch.Generator().manual_seed(5)
    probs = torch.softmax(torch.randn(len(TREE) + 1, VOCAB, generator=gen), -1)
    for seed in range(50):
        path, token = verify_tree_seeded(TREE, probs, seed, position=10)
        # plain sampling at output positions 10, 11, ... with the seed's uniforms, reading the positions of the path
        at = [0] + [n + 1 for n in path]
        plain = [inverse_cdf(probs[a], position_uniform(seed, 10 + i)) for i, a in enumerate(at)]
        assert [TREE.tokens[n] for n in path] + [token] == plain


def test_sampling_over_a_tree_emits_the_target_distribution():
    # several candidates at the root (3 and 4, tried in that order) and one under 4: the first token is distributed
    # as p at the root, and the token after a 4 as p at node 3's position, whatever the candidates
    gen = torch.Generator().manual_seed(99)
    probs = torch.tensor(
        [
            [0.05, 0.10, 0.05, 0.30, 0.40, 0.10],  # root: candidates 3 and 4 hold most of the mass
            [1 / 6] * 6,  # node 0 (token 3)
            [1 / 6] * 6,  # node 1
            [1 / 6] * 6,  # node 2
            [0.10, 0.05, 0.05, 0.10, 0.10, 0.60],  # node 3 (token 4): candidates 6 (not in the vocab here) and 5
            [1 / 6] * 6,
            [1 / 6] * 6,
        ]
    )
    tree = DraftTree(tokens=(3, 5, 1, 4, 0, 5), parents=(-1, 0, 1, -1, 3, 3))
    first, after_4 = torch.zeros(VOCAB), torch.zeros(VOCAB)
    for _ in range(TRIALS):
        path, token = verify_tree_sampled(tree, probs, gen)
        emitted = [tree.tokens[n] for n in path] + [token]
        first[emitted[0]] += 1
        if emitted[0] == 4:
            after_4[emitted[1]] += 1
    assert _tv(first / TRIALS, probs[0]) < 0.015
    assert _tv(after_4 / after_4.sum(), probs[4]) < 0.02  # ~16k samples
    # drafting the candidates did help: most steps accept one
    assert float(first[3] + first[4]) / TRIALS > 0.65
