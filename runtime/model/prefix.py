"""PrefixStore: the keys and values of prompts already read, kept for later requests that start the same way.

A block is one prefill chunk of a row (its tokens at fixed positions ``i * block .. (i + 1) * block``), copied out of
the row's cache once the chunk's pass has written it; a tail is the part of a block a prompt (or an answer read
again while idle) ended in, fewer than ``block`` tokens. Each is kept under its parent, the block before it (or the
prefix's root, its tenant), with its tokens. A prompt's pass gives every position the same bits wherever the prompt
was cut (``model.attention``: prompt chunks; the products are row-invariant), so a request may start from a block's
or a tail's first n positions and still get the output of reading its whole prompt. Where a model's prompt passes
do not have that property (``ModelRunner.prompt_cuts_exact``), the engine uses whole blocks only.

Blocks are named by the caller (a digest of the tenant and every token up to the block's end, so a block is found
only after the same whole prefix) and evicted least recently used first within a byte budget. A block is useless
without its parent (a lookup stops at the first block it misses), so the parents of a block added or found are
touched after it: a block is never more recently used than its parent, and eviction takes the tails of prefixes
first. Rows hold copies, never references: nothing running pins a block, and eviction is always possible.

One engine thread uses it; ``stats`` may be read from any thread.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class Block:
    tensors: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys and values [kv_heads, tokens, head_dim]
    nbytes: int
    tokens: tuple[int, ...]
    parent: bytes


@dataclass
class Found:
    """What a lookup found: whole blocks from the prefix's start, then maybe the first ``n`` positions of one
    more block or tail."""

    blocks: list[Block]
    part: Block | None = None
    n: int = 0


class PrefixStore:
    def __init__(self, budget_bytes: int, block: int):
        self.budget_bytes = budget_bytes
        self.block = block  # tokens a block; equal to the prefill chunk, so that blocks are whole chunks
        self._blocks: OrderedDict[bytes, Block] = OrderedDict()
        self._children: dict[bytes, list[bytes]] = {}  # parent -> its blocks and tails, in the order added
        self.bytes = 0
        self.queries = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0  # of those, tokens found (prefix_cache_hits)
        self.evictions = 0
        self.from_answers = 0  # blocks and tails read from finished requests' answers while idle (``keep_answer``)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def lookup(self, keys: list[bytes], root: bytes, tokens: list[int] = (), limit: int = 0) -> Found:
        """The stored blocks of a prefix, from its first, as many as are stored without a gap; then, if ``limit``
        allows, the stored block or tail after them that shares the most leading tokens with ``tokens`` (the
        prompt), at most up to position ``limit``."""
        found = Found([])
        for key in keys:
            block = self._blocks.get(key)
            if block is None:
                break
            found.blocks.append(block)
        used = list(keys[: len(found.blocks)])
        start = len(found.blocks) * self.block
        if limit > start:
            want = tokens[start:limit]
            for key in self._children.get(used[-1] if used else root, ()):
                n = _common(self._blocks[key].tokens, want)
                if n > found.n:
                    found.part, found.n, best = self._blocks[key], n, key
            if found.part is not None:
                used.append(best)
        self._touch(used)
        return found

    def add(
        self,
        key: bytes,
        tensors: list[tuple[torch.Tensor, torch.Tensor]],
        tokens: tuple[int, ...],
        parents: list[bytes],
        root: bytes,
    ) -> bool:
        """Keep a block (``len(tokens) == block``) or a tail; parents: the keys of the whole blocks before it in its
        prefix, from the first (none: the prefix's root). A tail already covered by what its parent holds is not
        kept; tails that ``tokens`` cover go. Whether it was added."""
        parent = parents[-1] if parents else root
        if key in self._blocks:
            self._touch([*parents, key])
            return False
        for other in list(self._children.get(parent, ())):
            held = self._blocks[other].tokens
            if held[: len(tokens)] == tokens:  # what it would hold is held already
                self._touch([*parents, other])
                return False
            if len(held) < self.block and tokens[: len(held)] == held:
                self._drop(other)
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in tensors)
        if nbytes > self.budget_bytes:
            return False
        while self._blocks and self.bytes + nbytes > self.budget_bytes:
            self._drop(next(iter(self._blocks)))
            self.evictions += 1
        self._blocks[key] = Block(tensors, nbytes, tokens, parent)
        self._children.setdefault(parent, []).append(key)
        self.bytes += nbytes
        self._touch([*parents, key])
        return True

    def _drop(self, key: bytes) -> None:
        old = self._blocks.pop(key)
        self.bytes -= old.nbytes
        siblings = self._children.get(old.parent)
        if siblings is not None:
            siblings.remove(key)
            if not siblings:
                del self._children[old.parent]

    def _touch(self, keys: list[bytes]) -> None:
        """Make a prefix's blocks the most recently used, its first block most of all."""
        for key in reversed(keys):
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def clear(self) -> None:
        self._blocks.clear()
        self._children.clear()
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


def tail_key(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """A tail's name: its parent's and its tokens'."""
    digest = hashlib.sha256(parent)
    digest.update(b"tail")
    digest.update(repr(tokens).encode())
    return digest.digest()


def _common(a: tuple[int, ...], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
