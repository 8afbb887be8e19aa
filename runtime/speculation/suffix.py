"""Suffix speculation: draft from what followed the same text in this deployment's recent traffic.

Prompt lookup (``ngram_propose``) finds a continuation only inside the current request. Traffic repeats across
requests: agents re-send tool schemas and files, users re-ask with small edits, the same greedy prompt gets the
same answer. SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975) indexes past prompts and outputs too, scores each
candidate continuation by how often it followed the match, and drafts far when the match is long and the
continuation frequent, not at all when it is short or contested.

``SuffixIndex`` holds the tokens of recent requests (prompt and output, the running ones included, so concurrent
requests learn from each other) and a hash index from every ``n``-token window (n in ``KEY_LENGTHS``) to where it
ended. A lookup takes the longest key that has occurrences, measures each occurrence's real match length against
the context (up to ``MAX_MATCH`` tokens back, by binary search over slices), keeps the longest-matching ones and
walks forward through their continuations by majority vote: the draft token at each position is the one most of
the remaining occurrences continue with, and its estimated probability is the product of those vote shares (the
subtree counts of a suffix tree, read off occurrence lists). The walk stops at ``min(k, ALPHA x match length)``
tokens or when the probability drops under ``MIN_PROB``.

Why occurrence lists and not a suffix tree: a Python suffix tree of depth d costs d node visits per indexed token
and an object per node (hundreds of bytes each); the lists cost two entries per token, and a lookup reads at most
``MAX_CANDIDATES`` occurrences.

A request may carry a salt (its tenant's): its windows are filed under ``hash(window) ^ salt`` and a lookup reads
only the keys of its own salt, so requests of one tenant never draft from another's, and a lookup costs the same
whatever other tenants sent (vLLM salts its prefix cache per tenant for the same reason). Salt 0 is a shared index.

Memory is bounded by a token budget: finished requests are evicted least recently used first (used: indexed, or
drafted from) once the held tokens exceed it; running requests are never evicted. Evicted requests' index entries
are dropped lazily and the index is rebuilt once they outnumber the live ones, so it stays within twice the
live size.
"""

from __future__ import annotations

from array import array
from collections import Counter, OrderedDict
from typing import Sequence

KEY_LENGTHS = (
    3,
    8,
)  # a match must cover at least 3 tokens (as n-gram lookup's measured best n); 8 finds long ones fast
MAX_MATCH = 32  # how far back a match is measured
MAX_CANDIDATES = 32  # most recent live occurrences read per lookup
# draft at most ALPHA x match length tokens (SuffixDecoding's max_spec_factor). Its default is 1 with tree drafts;
# our drafts are one path, judged by the draft-length policy, and copying from a 3-token match with K=8 was
# accepted 86% of the time on the edit loop (n-gram lookup), so a short match may draft 3 tokens a token of match
ALPHA = 3.0
MIN_PROB = 0.1  # stop drafting when the continuation's estimated probability falls below this (its min_token_prob)
_SHIFT = 32
_MASK = (1 << _SHIFT) - 1


def _match_length(seq: array, end: int, tail: array, at_least: int) -> int:
    """How many tokens before ``seq[end]`` equal the end of ``tail`` (the context's last ``MAX_MATCH`` tokens; 0
    when not even ``at_least`` do). Agreement is monotone in the length, so a binary search over slice comparisons
    (C speed) finds it."""
    limit = min(end, len(tail))
    n = len(tail)
    if limit < at_least or seq[end - at_least : end] != tail[n - at_least :]:
        return 0
    lo, hi = at_least, limit  # lo agrees; find the largest agreeing length in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if seq[end - mid : end] == tail[n - mid :]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class SuffixIndex:
    def __init__(self, budget_tokens: int):
        self.budget = budget_tokens
        # request id -> its tokens (int32: 4 bytes a token); least recently used first
        self._seqs: OrderedDict[int, array] = OrderedDict()
        self._running: set[int] = set()
        self._salts: dict[int, int] = {}  # request id -> its tenant's salt, where it is not 0
        # hash of a key window -> (request id << 32 | end) of its occurrences, oldest first: an int while there is one
        # (most windows of real text occur once, and a list per window would double the index's memory), then a list
        self._index: dict[int, int | list[int]] = {}
        self.tokens = 0  # tokens held (live)
        self._entries = 0  # index entries, live and dead
        self._dead = 0  # entries that point at evicted requests
        self.lookups = 0
        self.hits = 0  # lookups that returned a draft
        self.evicted = 0  # requests evicted so far

    @property
    def requests(self) -> int:
        return len(self._seqs)

    def snapshot(self) -> dict:
        return {
            "requests": self.requests,
            "tokens": self.tokens,
            "budget_tokens": self.budget,
            "index_entries": self._entries,
            "evicted_requests": self.evicted,
            "lookups": self.lookups,
            "hits": self.hits,
        }

    # ---- updates ----
    def sync(self, rid: int, tokens: Sequence[int], salt: int = 0) -> None:
        """Make the index hold ``tokens`` for request ``rid`` (new or growing): only the new tail is indexed. A
        request keeps the ``salt`` it was first synced with."""
        held = self._seqs.get(rid)
        if held is None:
            held = self._seqs[rid] = array("i")
            self._running.add(rid)
            if salt:
                self._salts[rid] = salt
        else:
            self._seqs.move_to_end(rid)
        start = len(held)
        if len(tokens) <= start:
            return
        held.extend(tokens[start:])
        self.tokens += len(held) - start
        self._add_entries(rid, held, start)

    def _add_entries(self, rid: int, held: array, start: int) -> None:
        index, base, salt = self._index, rid << _SHIFT, self._salts.get(rid, 0)
        for n in KEY_LENGTHS:
            for end in range(max(start + 1, n), len(held) + 1):  # windows that end at a new token
                key = hash(tuple(held[end - n : end])) ^ salt
                entries = index.get(key)
                if entries is None:
                    index[key] = base | end
                elif type(entries) is int:
                    index[key] = [entries, base | end]
                else:
                    entries.append(base | end)
                self._entries += 1

    def finish(self, rid: int) -> None:
        """The request is over: its tokens stay as context for later requests, and may now be evicted."""
        self._running.discard(rid)
        self._evict()

    def _evict(self) -> None:
        while self.tokens > self.budget:
            victim = next((r for r in self._seqs if r not in self._running), None)
            if victim is None:
                return  # only running requests left: they are never evicted
            seq = self._seqs.pop(victim)
            self._salts.pop(victim, None)
            self.tokens -= len(seq)
            self._dead += sum(max(0, len(seq) - n + 1) for n in KEY_LENGTHS)
            self.evicted += 1
        if self._dead > self._entries - self._dead:
            self._rebuild()

    def _rebuild(self) -> None:
        self._index, self._entries, self._dead = {}, 0, 0
        for rid, seq in self._seqs.items():
            self._add_entries(rid, seq, 0)

    # ---- lookup ----
    def propose(self, context: Sequence[int], k: int, salt: int = 0) -> tuple[list[int], int]:
        """Up to ``k`` draft tokens to follow ``context`` from the requests of ``salt``, and the match length they
        come from (0: none)."""
        if k <= 0:
            return [], 0
        self.lookups += 1
        seqs, salts = self._seqs, self._salts
        tail = array("i", context[-MAX_MATCH:])
        found: list[tuple[int, array, int, int]] = []  # (match length, tokens, end, request id)
        for n in reversed(KEY_LENGTHS):  # the longest key first: its occurrences are the likeliest long matches
            if len(context) < n:
                continue
            entries = self._index.get(hash(tuple(tail[len(tail) - n :])) ^ salt)
            if entries is None:
                continue
            if type(entries) is int:
                entries = (entries,)
            for code in reversed(entries):  # the most recent first
                rid, end = code >> _SHIFT, code & _MASK
                seq = seqs.get(rid)
                # evicted, the context's own end (nothing follows yet), or another tenant's window whose key collided
                if seq is None or end >= len(seq) or salts.get(rid, 0) != salt:
                    continue
                m = _match_length(seq, end, tail, n)
                if m:
                    found.append((m, seq, end, rid))
                    if len(found) >= MAX_CANDIDATES:
                        break
            if found:
                break
        if not found:
            return [], 0
        match = max(f[0] for f in found)
        cands = [(seq, end, rid) for m, seq, end, rid in found if m == match]
        limit = min(k, max(1, int(ALPHA * match)))
        drafts, prob = [], 1.0
        for j in range(limit):
            votes = Counter(seq[end + j] for seq, end, _ in cands if end + j < len(seq))
            if not votes:
                break
            token, count = votes.most_common(1)[0]
            prob *= count / len(cands)
            if prob < MIN_PROB:
                break
            drafts.append(token)
            cands = [c for c in cands if c[1] + j < len(c[0]) and c[0][c[1] + j] == token]
        if drafts:
            self.hits += 1
            for _, _, rid in cands:  # the requests drafted from are used: keep them longest
                if rid in seqs:
                    seqs.move_to_end(rid)
        return drafts, match
