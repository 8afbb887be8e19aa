"""PrefixStore: the keys and values of prompt blocks already read, kept for later requests that start the same way.

A block is one prefill chunk of a row (its tokens at fixed positions ``i * block .. (i + 1) * block``), copied out of
the row's cache once the chunk's pass has written it. A prompt is cut into chunks at the same positions whatever the
load (``speculation.scheduler``), so a block read from the store holds the very bits the chunk's pass would compute
again: a request that starts from stored blocks gets the same output as one that reads its whole prompt.

Blocks are named by the caller (a digest of the tenant and every token up to the block's end, so a block is found
only after the same whole prefix) and evicted least recently used first within a byte budget. A block is useless
without its parent (a lookup stops at the first block it misses), so the parents of a block added or found are
touched after it: a block is never more recently used than its parent, and eviction takes the tails of prefixes
first. Rows hold copies, never references: nothing running pins a block, and eviction is always possible.

One engine thread uses it; ``stats`` may be read from any thread.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class Block:
    tensors: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys and values [kv_heads, block, head_dim]
    nbytes: int


class PrefixStore:
    def __init__(self, budget_bytes: int, block: int):
        self.budget_bytes = budget_bytes
        self.block = block  # tokens a block; equal to the prefill chunk, so that blocks are whole chunks
        self._blocks: OrderedDict[bytes, Block] = OrderedDict()
        self.bytes = 0
        self.queries = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0  # of those, tokens found (prefix_cache_hits)
        self.evictions = 0
        self.from_answers = 0  # blocks read from finished requests' answers while idle (``engine.keep_answer``)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def lookup(self, keys: list[bytes]) -> list[Block]:
        """The stored blocks of a prefix, from its first: as many as are stored without a gap."""
        found = []
        for key in keys:
            block = self._blocks.get(key)
            if block is None:
                break
            found.append(block)
        self._touch(keys[: len(found)])
        return found

    def add(self, key: bytes, tensors: list[tuple[torch.Tensor, torch.Tensor]], parents: list[bytes] = ()) -> None:
        """Keep a block; parents: the keys of the blocks before it in its prefix, from the first."""
        if key not in self._blocks:
            nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in tensors)
            if nbytes > self.budget_bytes:
                return
            while self._blocks and self.bytes + nbytes > self.budget_bytes:
                _, old = self._blocks.popitem(last=False)
                self.bytes -= old.nbytes
                self.evictions += 1
            self._blocks[key] = Block(tensors, nbytes)
            self.bytes += nbytes
        self._touch([*parents, key])

    def _touch(self, keys: list[bytes]) -> None:
        """Make a prefix's blocks the most recently used, its first block most of all."""
        for key in reversed(keys):
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def clear(self) -> None:
        self._blocks.clear()
        self.bytes = 0

    def stats(self) -> dict:
        return {
            "blocks": len(self._blocks),
            "bytes": self.bytes,
            "budget_bytes": self.budget_bytes,
            "block_tokens": self.block,
            "queries": self.queries,
            "hits": self.hits,
            "evictions": self.evictions,
            "from_answers": self.from_answers,
        }
