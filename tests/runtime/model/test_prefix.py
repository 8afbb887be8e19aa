"""PrefixStore on its own: least recently used blocks go first, and a prefix loses its tail before its head."""

from __future__ import annotations

import torch

from depctl_runtime.model.prefix import PrefixStore


def _block() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.zeros(1, 4, 2), torch.zeros(1, 4, 2))]  # 64 bytes


def test_a_prefix_loses_its_tail_first_so_what_is_left_is_still_found():
    store = PrefixStore(budget_bytes=3 * 64, block=4)
    chain = [b"a0", b"a1", b"a2"]
    for i, key in enumerate(chain):  # a prompt's blocks, kept in order as its chunks are read
        store.add(key, _block(), parents=chain[:i])
    store.add(b"b0", _block())  # another prompt's first block: one of the chain's must go
    assert len(store.lookup(chain)) == 2, "the tail a2 went, not the head a0 that every later block needs"
    store.lookup(chain)  # a lookup leaves the head the most recent too
    store.add(b"c0", _block())
    assert b"b0" not in store and len(store.lookup(chain)) == 2
