"""Proposers on literal token lists."""

from __future__ import annotations

from runtime.engine.proposers import PredictionTracker, lookup_in_reference, ngram_propose


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


def test_lookup_prefers_first_match_after_position():
    ref = [1, 2, 3, 1, 2, 4]
    assert lookup_in_reference([9, 1, 2], ref, n=2, after=0) == 2
    assert lookup_in_reference([9, 1, 2], ref, n=2, after=3) == 5
    assert lookup_in_reference([8], ref, n=2, after=0) == -1


def test_prediction_tracker_follows_diverges_and_resyncs():
    tracker = PredictionTracker([10, 11, 12, 13, 14, 15, 16])
    assert tracker.propose([], 3) == [10, 11, 12]
    assert tracker.observe(3, 13) == 4  # all accepted, and the bonus 13 follows the prediction
    assert tracker.propose([10, 11, 12, 13], 2) == [14, 15]
    assert tracker.observe(0, 99) == 0  # the target wrote 99 instead of 14: lost
    assert tracker.expected == -1
    # the output rejoins the prediction at 15: found by looking up the last generated tokens
    assert tracker.propose([10, 11, 12, 13, 99, 15], 2) == [16]
