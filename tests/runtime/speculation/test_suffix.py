"""Suffix speculation's index on literal token arrays: lookups, scores, draft lengths, eviction and the memory bound."""

from __future__ import annotations

import tracemalloc

from depctl_runtime.speculation.suffix import ALPHA, KEY_LENGTHS, MIN_PROB, SuffixIndex


def index_of(*requests, budget=10_000):
    index = SuffixIndex(budget)
    for rid, tokens in enumerate(requests):
        index.sync(rid, tokens)
        index.finish(rid)
    return index


def test_a_later_request_drafts_what_followed_in_an_earlier_one():
    index = index_of([50, 51, 52, 53, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    # the new request shares [51, 52, 53, 1, 2, 3] (6 tokens): up to 6 tokens follow, k caps them
    assert index.propose([99, 51, 52, 53, 1, 2, 3], k=4) == ([4, 5, 6, 7], 6)
    assert index.propose([99, 51, 52, 53, 1, 2, 3], k=16) == ([4, 5, 6, 7, 8, 9], 6)


def test_the_draft_length_follows_the_match_length():
    index = index_of(list(range(1, 41)))
    # a 3-token match drafts at most 9 tokens; an 8-token match up to 24 (ALPHA = 3 draft tokens a matched token)
    assert ALPHA == 3
    assert index.propose([70, 2, 3, 4], k=32) == (list(range(5, 14)), 3)
    assert index.propose(list(range(1, 9)), k=32) == (list(range(9, 33)), 8)


def test_a_match_shorter_than_the_shortest_key_drafts_nothing():
    index = index_of([1, 2, 3, 4, 5])
    assert index.propose([9, 2, 3], k=4) == ([], 0)
    assert index.propose([1, 2], k=4) == ([], 0)
    assert KEY_LENGTHS[0] == 3


def test_the_longest_match_wins_over_the_most_recent():
    # both end in [1, 2, 3]; the older one also agrees on the 8 before: it is the aligned one
    older = [40, 41, 42, 43, 44, 45, 46, 47, 1, 2, 3, 60, 61, 62]
    newer = [90, 91, 1, 2, 3, 70, 71, 72]
    index = index_of(older, newer)
    assert index.propose([44, 45, 46, 47, 1, 2, 3], k=3) == ([60, 61, 62], 7)
    assert index.propose([0, 1, 2, 3], k=3) == ([70, 71, 72], 3)  # equal matches: the majority of one, the newest


def test_continuations_are_scored_by_how_often_they_followed():
    # [5, 6, 7] was followed by [8, 9, 10] twice and by [20, 21, 22] once: the frequent one is drafted
    index = index_of([5, 6, 7, 8, 9, 10], [5, 6, 7, 20, 21, 22], [5, 6, 7, 8, 9, 10])
    assert index.propose([0, 5, 6, 7], k=3) == ([8, 9, 10], 3)


def test_drafting_stops_when_the_continuation_is_contested():
    # eleven requests continue [1, 2, 3] eleven ways: the best guess has probability 1/11 < MIN_PROB
    index = index_of(*[[1, 2, 3, 100 + i, 7, 7] for i in range(11)])
    assert 1 / 11 < MIN_PROB
    assert index.propose([0, 1, 2, 3], k=4) == ([], 3)
    # three ways, then agreement: the first token is a 1/3 guess, the walk follows its own branch
    index = index_of([1, 2, 3, 8, 30], [1, 2, 3, 9, 31], [1, 2, 3, 8, 30], [1, 2, 3, 8, 32], [1, 2, 3, 10, 33])
    drafts, _ = index.propose([0, 1, 2, 3], k=3)
    assert drafts == [8, 30]  # 8: 3/5; then 30: 2/3 of those (0.4 overall); then the answers end


def test_the_current_request_is_indexed_as_it_runs():
    index = SuffixIndex(1000)
    index.sync(7, [1, 2, 3, 4, 5, 1, 2, 3])  # its own earlier [1, 2, 3] is a match; its own end is not
    assert index.propose([1, 2, 3, 4, 5, 1, 2, 3], k=2) == ([4, 5], 3)
    index.sync(7, [1, 2, 3, 4, 5, 1, 2, 3, 9, 9, 9])  # only the new tail is indexed
    assert index.tokens == 11
    assert index.propose([0, 3, 9, 9], k=1) == ([9], 3)


def test_concurrent_requests_draft_from_each_other():
    index = SuffixIndex(1000)
    index.sync(1, [10, 11, 12, 13, 14, 15, 16])  # still running
    assert index.propose([99, 10, 11, 12], k=4) == ([13, 14, 15, 16], 3)


def test_least_recently_used_requests_are_evicted_past_the_budget():
    index = SuffixIndex(12)
    index.sync(0, [1, 2, 3, 4, 5])
    index.finish(0)
    index.sync(1, [6, 7, 8, 9, 10])
    index.finish(1)
    assert index.propose([0, 1, 2, 3], k=2) == ([4, 5], 3)  # drafting from request 0 makes it the most recent
    index.sync(2, [11, 12, 13, 14, 15])
    index.finish(2)  # 15 tokens > 12: the least recently used (request 1) goes
    assert index.tokens == 10 and index.requests == 2 and index.evicted == 1
    assert index.propose([0, 6, 7, 8], k=2) == ([], 0)
    assert index.propose([0, 1, 2, 3], k=2) == ([4, 5], 3)


def test_running_requests_are_never_evicted():
    index = SuffixIndex(4)
    index.sync(0, list(range(10)))  # over the budget on its own, but running
    index.sync(1, list(range(20, 30)))
    index.finish(1)  # the finished one goes; the running one stays
    assert index.requests == 1 and index.tokens == 10
    assert index.propose([50, 2, 3, 4], k=2) == ([5, 6], 3)
    index.finish(0)
    assert index.requests == 0 and index.tokens == 0


def test_evicted_entries_are_dropped_so_the_index_stays_bounded():
    index = SuffixIndex(200)
    for rid in range(200):  # 4000 tokens through a 200-token budget
        index.sync(rid, [rid * 1000 + i for i in range(20)])
        index.finish(rid)
    assert index.tokens <= 200
    live_entries = sum(index.tokens - index.requests * (n - 1) for n in KEY_LENGTHS)
    assert index.snapshot()["index_entries"] <= 2 * live_entries + 40
    assert index.propose([0, 199_005, 199_006, 199_007], k=2) == ([199_008, 199_009], 3)
    assert index.propose([0, 5, 6, 7], k=2) == ([], 0)  # request 0 is long gone


def test_memory_per_held_token_is_bounded():
    # the spec's default budget is sized from this: 262144 tokens at under 300 bytes each is under 80 MB
    tracemalloc.start()
    index = SuffixIndex(1 << 20)
    before = tracemalloc.get_traced_memory()[0]
    for rid in range(50):
        index.sync(rid, [(rid * 7919 + i * 104729) % 49152 for i in range(400)])  # 20k tokens, few repeats
        index.finish(rid)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert index.tokens == 20_000
    assert used / index.tokens < 300, used / index.tokens


def test_a_salted_request_drafts_only_from_requests_of_its_salt():
    index = SuffixIndex(10_000)
    secret = [50, 51, 52, 53, 1, 2, 3, 4, 5, 6]
    index.sync(0, secret, salt=7)
    index.finish(0)
    assert index.propose([99, 51, 52, 53], k=4, salt=7) == ([1, 2, 3, 4], 3)  # the same tenant
    assert index.propose([99, 51, 52, 53], k=4, salt=8) == ([], 0)  # another tenant
    assert index.propose([99, 51, 52, 53], k=4) == ([], 0)  # the shared index (salt 0)
    index.sync(1, secret)  # the same text, unsalted: the shared index has it now, and tenant 8 still does not
    index.finish(1)
    assert index.propose([99, 51, 52, 53], k=4) == ([1, 2, 3, 4], 3)
    assert index.propose([99, 51, 52, 53], k=4, salt=8) == ([], 0)


def test_salts_survive_a_rebuild_and_leave_with_their_request():
    index = SuffixIndex(40)
    index.sync(0, [50, 51, 52, 53, 1, 2, 3, 4], salt=7)
    index.finish(0)
    for rid in range(1, 6):  # evicting the old ones rebuilds the index
        index.sync(rid, [rid * 100 + i for i in range(10)], salt=7 if rid == 5 else 0)
        index.finish(rid)
    assert index.requests < 6
    assert index.propose([0, 501, 502, 503], k=2, salt=7) == ([504, 505], 3)
    assert index.propose([0, 501, 502, 503], k=2) == ([], 0)
    assert index.propose([0, 401, 402, 403], k=2) == ([404, 405], 3)
    assert set(index._salts) <= set(index._seqs)  # an evicted request's salt goes with it
