"""PrefixStore on its own: least recently used blocks go first, a prefix loses its tail before its head, and a
prompt finds the block or tail that shares the most of its next tokens."""

from __future__ import annotations

import torch

from depctl_runtime.model.prefix import PrefixStore, tail_key

ROOT = b"tenant"


def _kv(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.arange(n, dtype=torch.float32)[None, :, None].repeat(1, 1, 2), torch.zeros(1, n, 2))]  # 16n bytes


def test_a_prefix_loses_its_tail_first_so_what_is_left_is_still_found():
    store = PrefixStore(budget_bytes=3 * 64, block=4)
    chain = [b"a0", b"a1", b"a2"]
    for i, key in enumerate(chain):  # a prompt's blocks, kept in order as its chunks are read
        store.add(key, _kv(), (i, i, i, i), chain[:i], ROOT)
    store.add(b"b0", _kv(), (9, 9, 9, 9), [], ROOT)  # another prompt's first block: one of the chain's must go
    assert len(store.lookup(chain, ROOT).blocks) == 2, "the tail a2 went, not the head a0 that every later block needs"
    store.lookup(chain, ROOT)  # a lookup leaves the head the most recent too
    store.add(b"c0", _kv(), (8, 8, 8, 8), [], ROOT)
    assert b"b0" not in store and len(store.lookup(chain, ROOT).blocks) == 2


def test_a_prompt_finds_the_tail_or_block_sharing_most_of_its_next_tokens():
    store = PrefixStore(budget_bytes=1 << 20, block=4)
    store.add(b"a0", _kv(), (1, 2, 3, 4), [], ROOT)
    store.add(tail_key(b"a0", (5, 6)), _kv(2), (5, 6), [b"a0"], ROOT)
    store.add(tail_key(b"a0", (5, 7, 8)), _kv(3), (5, 7, 8), [b"a0"], ROOT)
    prompt = [1, 2, 3, 4, 5, 7, 8, 9, 10]
    found = store.lookup([b"a0", b"a1"], ROOT, prompt, limit=len(prompt) - 1)
    assert len(found.blocks) == 1 and found.part.tokens == (5, 7, 8) and found.n == 3
    found = store.lookup([b"a0"], ROOT, prompt, limit=6)  # no further than the limit
    assert found.part.tokens == (5, 7, 8) and found.n == 2
    found = store.lookup([b"a0"], ROOT, [1, 2, 3, 4, 6], limit=4)
    assert found.part is None and found.n == 0
    # the first block itself, where a prompt leaves it mid-way: its first positions are a prefix's too
    found = store.lookup([b"x0"], ROOT, [1, 2, 9], limit=2)
    assert found.blocks == [] and found.part.tokens == (1, 2, 3, 4) and found.n == 2
    assert store.lookup([b"x0"], b"another tenant", [1, 2, 9], limit=2).part is None


def test_a_block_replaces_the_tails_it_covers_and_a_covered_tail_is_not_kept():
    store = PrefixStore(budget_bytes=1 << 20, block=4)
    assert store.add(tail_key(ROOT, (1, 2)), _kv(2), (1, 2), [], ROOT)
    assert store.add(tail_key(ROOT, (1, 2, 3)), _kv(3), (1, 2, 3), [], ROOT)
    assert store.stats()["blocks"] == 1, "the longer tail covers the shorter"
    assert store.add(b"a0", _kv(), (1, 2, 3, 4), [], ROOT)
    assert store.stats()["blocks"] == 1 and store.bytes == 64, "the block covers the tail"
    assert not store.add(tail_key(ROOT, (1, 2)), _kv(2), (1, 2), [], ROOT)
    assert store.add(tail_key(ROOT, (1, 5)), _kv(2), (1, 5), [], ROOT)  # another way on from the same parent
    assert store.stats()["blocks"] == 2


def test_a_tail_goes_before_the_block_it_goes_on_from():
    store = PrefixStore(budget_bytes=3 * 64, block=4)
    store.add(b"a0", _kv(), (1, 2, 3, 4), [], ROOT)
    store.add(tail_key(b"a0", (5,)), _kv(1), (5,), [b"a0"], ROOT)
    store.add(b"b0", _kv(), (7, 7, 7, 7), [], ROOT)
    store.lookup([b"b0"], ROOT)
    store.add(b"c0", _kv(), (8, 8, 8, 8), [], ROOT)  # the tail (least recent) goes first, then a0
    assert store.lookup([b"a0"], ROOT, [1, 2, 3, 4, 5, 6], limit=5).part is None
    assert store.bytes <= store.budget_bytes and b"b0" in store and b"c0" in store
