"""Proposers on literal token lists."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

from depctl_runtime.speculation import proposers
from depctl_runtime.speculation.params import GenerationParams, SamplingParams, Tenant
from depctl_runtime.speculation.proposers import (
    CONTEXT_LOOKBACK,
    DraftVocabulary,
    NgramIndex,
    NgramProposer,
    PredictionTracker,
    SuffixProposer,
    draft_loop,
    ngram_propose,
    rejoin,
)


def test_ngram_most_recent_match():
    # the suffix [1, 2] occurs at 0 and 4; the most recent (4) is followed by [9, 9]
    assert ngram_propose([1, 2, 3, 4, 1, 2, 9, 9, 1, 2], n=2, k=2) == [9, 9]


def test_ngram_stops_at_the_end_of_the_sequence():
    # the only match is followed by just 2 tokens before the current suffix
    assert ngram_propose([5, 6, 7, 8, 5, 6], n=2, k=5) == [7, 8, 5, 6]


def test_ngram_needs_a_match_of_n_tokens():
    # [1, 4, 5] never occurred before, [4, 5] neither; [5] did, followed by [6, 7]: enough for n=1 only
    assert ngram_propose([5, 6, 7, 1, 4, 5], n=3, k=2) == []
    assert ngram_propose([5, 6, 7, 1, 4, 5], n=2, k=2) == []
    assert ngram_propose([5, 6, 7, 1, 4, 5], n=1, k=2) == [6, 7]


def test_ngram_prefers_the_match_with_the_longest_context():
    # a block is being copied: [10, 11, 1, 2] ... the output so far is [10, 11, 1, 2] again. The suffix [1, 2]
    # also occurs later (followed by 8), but the occurrence preceded by [10, 11] is the aligned one
    block = [10, 11, 1, 2, 3, 4]
    tokens = block + [7, 1, 2, 8] + [10, 11, 1, 2]
    assert ngram_propose(tokens, n=2, k=2) == [3, 4]
    # with equal context the most recent wins
    assert ngram_propose([5, 1, 2, 3, 6, 1, 2, 4, 7, 1, 2], n=2, k=1) == [4]


def test_ngram_no_match_is_empty():
    # no earlier occurrence of the last token: the engine runs a plain decode step
    assert ngram_propose([1, 2, 3, 4], n=3, k=4) == []
    assert ngram_propose([1], n=3, k=4) == []
    assert ngram_propose([1, 2, 1], n=3, k=0) == []


def test_ngram_repeating_pattern_proposes_itself():
    # the most recent match of [7, 7] ends one position back, so only one token follows it; in a longer
    # cycle the match's continuation runs into the suffix itself
    assert ngram_propose([7, 7, 7, 7], n=2, k=3) == [7]
    assert ngram_propose([1, 2, 3, 1, 2, 3, 1], n=1, k=4) == [2, 3, 1]


def scan_propose(tokens, n: int, k: int) -> list[int]:
    """The rule by brute force: every earlier occurrence of the last token, scored by agreement looking back."""
    length = len(tokens)
    if k <= 0 or length < 2:
        return []
    best, best_agree = None, -1
    for end in range(length - 1):
        agree = 0
        while (
            agree < min(CONTEXT_LOOKBACK, length - 1)
            and end - agree >= 0
            and tokens[end - agree] == tokens[length - 1 - agree]
        ):
            agree += 1
        if agree >= best_agree and agree > 0:
            best, best_agree = end, agree
    if best is None or best_agree < n:
        return []
    return list(tokens[best + 1 : best + 1 + k])


@pytest.mark.parametrize("sliced", [0, 1_000_000], ids=["array pass", "slices"])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_ngram_index_proposes_what_a_scan_proposes(n, sliced, monkeypatch):
    """The engine's per-request index, kept up to date step after step, guesses exactly what a brute-force scan of the
    tokens finds, as they grow by a step's worth at a time (few distinct tokens: many candidates, ties, long
    agreements), whichever way it scores its candidates."""
    monkeypatch.setattr(proposers, "SLICED_CANDIDATES", sliced)
    rng = random.Random(n)
    for trial in range(20):
        vocab = rng.choice([3, 5, 12])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
        index = NgramIndex(n)
        for _ in range(60):
            k = rng.randrange(0, 9)
            assert index.propose(tokens, k) == scan_propose(tokens, n, k), (trial, tokens, k)
            if rng.random() < 0.3:  # copy a stretch of what came before, as accepted drafts would
                start = rng.randrange(len(tokens))
                tokens += tokens[start : start + rng.randrange(1, 10)]
            else:
                tokens += [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))]


def test_ngram_index_is_per_request_and_dropped_when_it_finishes():
    class Seq:
        def __init__(self, id, tokens):
            self.id, self.tokens = id, tokens

    proposer = NgramProposer(2)
    a, b = Seq(1, [1, 2, 3, 1, 2]), Seq(2, [4, 5, 6, 4, 5])
    assert proposer.propose(a, 2) == [3, 1] and proposer.propose(b, 2) == [6, 4]
    a.tokens += [7, 1, 2]
    assert proposer.propose(a, 1) == [7]
    proposer.finish(a)
    proposer.finish(b)
    assert not proposer._indexes
    # a token list shorter than the one indexed is another one: the index starts again
    index = NgramIndex(2)
    assert index.propose([1, 2, 3, 1, 2], 1) == [3] and index.propose([1, 2, 3, 1], 1) == []


def follow(prediction, output, k=4):
    """Drive a tracker over ``output`` as the engine would with one draft step per token (nothing accepted beyond
    the first check): returns, per output position, what the tracker proposed before the token was known."""
    tracker = PredictionTracker(prediction)
    proposals = []
    for i, token in enumerate(output):
        start, tokens = tracker.propose(output[:i], k)
        proposals.append(tokens)
        tracker.observe(start, 0, token)
    return tracker, proposals


def test_prediction_rejoins_after_a_replaced_token():
    prediction = [10, 11, 12, 13, 14, 15, 16, 17, 18]
    output = [10, 11, 12, 99, 14, 15, 16, 17, 18]  # 13 became 99
    tracker, proposals = follow(prediction, output)
    assert proposals[3] == [13, 14, 15, 16]  # the guess that failed
    assert proposals[4] == []  # 99 is not in the prediction: the deployment's proposer drafts this step
    assert proposals[5] == [15, 16, 17, 18]  # after 14, one token past the divergence: back on the prediction
    assert tracker.matched == 7  # all but 99 and 14 (produced while the tracker was looking for the rejoin)


def test_prediction_rejoins_after_inserted_tokens():
    prediction = [10, 11, 12, 13, 14, 15, 16, 17]
    output = [10, 11, 12, 90, 91, 92, 13, 14, 15, 16, 17]  # three tokens inserted before 13
    _, proposals = follow(prediction, output)
    assert proposals[4] == [] and proposals[5] == []
    assert proposals[7] == [14, 15, 16, 17]  # 13 came back right where the output left: rejoined at once


def test_prediction_rejoins_after_deleted_tokens():
    prediction = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    output = [10, 11, 12, 16, 17, 18, 19]  # 13-15 deleted
    _, proposals = follow(prediction, output)
    assert proposals[4] == [17, 18, 19]  # 16, four tokens on from the divergence: one agreeing token is enough there
    assert proposals[5] == [18, 19]  # and the output follows it again


def test_prediction_needs_a_longer_match_far_from_the_divergence():
    prediction = [10, 11, 12, 13] + [50 + i for i in range(30)] + [7, 8, 9, 1, 2]
    # the output leaves at 11 and later writes 7, 8: a two-token match 30 tokens away is not trusted
    assert rejoin([10, 99, 98, 7, 8], prediction, last=1) == -1
    # three agreeing tokens are, anywhere (an edit that dropped a whole block)
    assert rejoin([10, 99, 98, 8, 9, 1], prediction, last=1) == len(prediction) - 1


def test_prediction_prefers_the_nearest_rejoin():
    # [5, 6] occurs twice after the divergence: the nearer one wins, and forward before backward
    prediction = [5, 6, 1, 2, 3, 5, 6, 4, 4]
    assert rejoin([9, 5, 6], prediction, last=3) == 7
    assert rejoin([9, 5, 6], prediction, last=1) == 2


def test_prediction_tracker_follows_diverges_and_resyncs():
    tracker = PredictionTracker([10, 11, 12, 13, 14, 15, 16])
    assert tracker.propose([], 3) == (0, [10, 11, 12])
    assert tracker.observe(0, 3, 13) == 4  # all accepted, and the bonus 13 follows the prediction
    assert tracker.propose([10, 11, 12, 13], 2) == (4, [14, 15])
    assert tracker.observe(4, 0, 99) == 0  # the target wrote 99 instead of 14: lost
    assert tracker.expected == -1
    # the output rejoins the prediction at 15: found by looking up the last generated tokens
    assert tracker.propose([10, 11, 12, 13, 99, 15], 2) == (6, [16])


class _Row:
    _ids = iter(range(1000))

    def __init__(self, tokens, tenant):
        self.id, self.tokens, self.params = next(self._ids), tokens, GenerationParams(tenant=tenant)


@pytest.mark.parametrize("scope", ["user", "deployment"])
def test_suffix_drafts_cross_users_only_where_the_deployment_shares_its_index(scope):
    proposer = SuffixProposer(4096, scope)
    alice, bob = Tenant("key1", "alice"), Tenant("key1", "bob")
    other_key = Tenant("key2", "alice")
    text = [50, 51, 52, 53, 1, 2, 3, 4, 5, 6]
    proposer.finish(_Row(text, alice))
    asked = [99, 51, 52, 53]
    assert proposer.propose(_Row(asked, alice), 4) == [1, 2, 3, 4]  # a user's own traffic, in every scope
    shared = [1, 2, 3, 4] if scope == "deployment" else []
    assert proposer.propose(_Row(asked, bob), 4) == shared
    assert proposer.propose(_Row(asked, other_key), 4) == shared  # the same user field under another key
    assert proposer.snapshot()["scope"] == scope


def _confident_logits(top: list[float], vocab: int = 8) -> torch.Tensor:
    """[B, vocab] logits whose softmax puts ``top[b]`` on token b + 1 and spreads the rest evenly."""
    rows = []
    for b, p in enumerate(top):
        probs = torch.full((vocab,), (1 - p) / (vocab - 1))
        probs[b + 1] = p
        rows.append(probs.log())
    return torch.stack(rows)


def _drafting_rows(n: int, sampling: SamplingParams = SamplingParams()):
    return [
        SimpleNamespace(grammar=None, sampling=sampling, fault=None, stop_ids=(), generator=torch.Generator())
        for _ in range(n)
    ]


def test_drafts_are_kept_while_the_drafts_own_chain_probability_stays_over_the_confidence_asked():
    # row 0 is sure at every position; row 1 is sure of its first draft only (0.9 x 0.3 < 0.5)
    tops = iter([[0.9, 0.9], [0.9, 0.3], [0.9, 0.9], [0.9, 0.9]])
    steps = []

    def step(token):
        steps.append(token.tolist())
        return _confident_logits(next(tops))

    drafted = draft_loop(_drafting_rows(2), 4, _confident_logits(next(tops)), step, 0.5)
    tokens, probs, confident, chains = drafted.tokens, drafted.probs, drafted.confident, drafted.chains
    assert tokens == [[1, 1, 1, 1], [2, 2, 2, 2]]  # every row is drafted while any is worth drafting
    assert confident == [4, 1]  # 0.9^4 = 0.66 for row 0
    assert len(steps) == 3 and probs == [None, None]
    # each row's chain probability up to each draft: what the policy checks against what the target accepted
    assert chains[0] == pytest.approx([0.9, 0.81, 0.729, 0.6561], abs=1e-3)
    assert chains[1] == pytest.approx([0.9, 0.27, 0.243, 0.2187], abs=1e-3)
    # without a confidence asked, every row has the width, as before
    tops = iter([[0.9, 0.9], [0.9, 0.3], [0.9, 0.9], [0.9, 0.9]])
    assert draft_loop(_drafting_rows(2), 4, _confident_logits(next(tops)), step, 0.0).confident is None


def test_drafting_stops_once_no_row_keeps_a_draft():
    tops = iter([[0.9, 0.3], [0.4, 0.9], [0.9, 0.9]])
    steps = []

    def step(token):
        steps.append(token.tolist())
        return _confident_logits(next(tops))

    drafted = draft_loop(_drafting_rows(2), 4, _confident_logits(next(tops)), step, 0.5)
    assert drafted.confident == [1, 0]  # row 0: 0.9, then 0.36; row 1 is unsure of its first draft
    assert len(steps) == 1 and len(drafted.tokens[0]) == 2  # the proposer ran twice, not four times
    assert drafted.forwards == 1 and drafted.forward_seconds > 0  # what the policy prices a later position at


def test_a_sampled_rows_confidence_is_its_drafts_probability_under_its_own_distribution():
    # at temperature 3 the 0.9 of the first draft flattens to about 0.36: under 0.5, where greedy keeps it
    rows = _drafting_rows(1, SamplingParams(temperature=3.0, seed=1))
    logits = _confident_logits([0.9])
    drafted = draft_loop(rows, 1, logits, lambda token: None, 0.5)
    tokens, probs = drafted.tokens, drafted.probs
    q = torch.softmax(logits[0] / 3.0, -1)
    assert math.isclose(float(probs[0][0][tokens[0][0]]), float(q[tokens[0][0]]), rel_tol=1e-5)
    assert drafted.confident == [0]
    assert draft_loop(_drafting_rows(1), 1, logits, lambda token: None, 0.5).confident == [1]
    assert drafted.forwards == 0 and drafted.forward_seconds == 0.0  # one position: the start alone


def test_greedy_rows_draft_within_a_proposers_own_vocabulary_what_they_drafted_over_the_targets():
    # a head's logits cover 5 of the target's 12 tokens: greedy rows take the argmax and its probability over those
    # columns (the rest are -inf over the target's vocabulary: the same softmax); a sampled row reads them spread
    vocabulary = DraftVocabulary(torch.tensor([0, 3, 4, 7, 11]), 12)
    torch.manual_seed(4)
    logits = [torch.randn(2, 5) for _ in range(3)]
    fed = {"own": [], "spread": []}

    def stepper(kind, spread):
        rest = iter(logits[1:])

        def step(token):
            fed[kind].append(token.tolist())
            nxt = next(rest)
            return vocabulary.spread(nxt) if spread else nxt

        return step

    own = draft_loop(_drafting_rows(2), 3, logits[0], stepper("own", False), 0.01, vocabulary)
    wide = draft_loop(_drafting_rows(2), 3, vocabulary.spread(logits[0]), stepper("spread", True), 0.01)
    assert own.tokens == wide.tokens and fed["own"] == fed["spread"]  # the target's tokens, fed back as such
    assert set(t for row in own.tokens for t in row) <= {0, 3, 4, 7, 11}
    for mine, theirs in zip(own.chains, wide.chains):
        assert mine == pytest.approx(theirs)
    assert own.confident == wide.confident
    rows = _drafting_rows(1) + _drafting_rows(1, SamplingParams(temperature=1.0, seed=2))
    sampled = draft_loop(rows, 1, logits[0], lambda token: None, 0.0, vocabulary)
    assert sampled.probs[1].shape == (1, 12)  # over the target's vocabulary, as rejection sampling reads it
    assert sampled.probs[1][0, [1, 2, 5, 6, 8, 9, 10]].sum() == 0
