"""SlotCache: one preallocated KV cache for a batch of sequences, indexed by position, a length per row.

Every sequence in the running batch owns one *row*. A row's ``length`` is how many positions of it hold valid
keys and values; a forward writes a row's new tokens at ``length, length + 1, ...`` and the attention lets the token at
position ``p`` see positions ``<= p`` of its own row only. Rolling back after a rejection is therefore pure
bookkeeping (``length`` moves back to the accepted length) and the rejected positions are overwritten by the next
forward, as in gpt-fast's ``input_pos`` cache and vLLM's ``num_computed_tokens``. Nothing is ever cropped, so a
sliding-window layer (Gemma 3, Qwen2 with ``use_sliding_window``) keeps full rows and only its mask changes.

It plugs into transformers through public interfaces only: a ``Cache`` subclass whose layers' ``update`` scatter
the step's flat token stream into the rows, explicit ``position_ids``, and an attention function registered with
``AttentionInterface`` that reads each row's keys (``depctl_runtime.model.attention``).
"""

from __future__ import annotations

import functools

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from depctl_runtime.model.attention import PROMPT_KEYS, RowLayout


class SlotLayer(CacheLayerMixin):
    """One decoder layer's keys and values: ``[rows, kv_heads, capacity, head_dim]`` each."""

    supports_early_init = False

    def __init__(self, cache: "SlotCache"):
        super().__init__()
        self._cache = cache

    def lazy_initialization(self, key_states, value_states) -> None:
        c = self._cache
        shape = (c.allocated_rows, key_states.shape[1], c.capacity, key_states.shape[-1])
        self.keys = key_states.new_zeros(shape)
        self.values = value_states.new_zeros((*shape[:3], value_states.shape[-1]))
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        # key_states: [1, kv_heads, T, head_dim], the step's flat token stream; token t goes to its row and position
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        step = self._cache.step
        lay = step.layout
        if len(lay.widths) == 1:  # one row (a prefill chunk, a single request): a plain slice
            span = slice(lay.starts[0], lay.starts[0] + lay.widths[0])
            self.keys[lay.first, :, span] = key_states[0]
            self.values[lay.first, :, span] = value_states[0]
        else:  # advanced indices around a slice put the [T] dimension first: [T, kv_heads, head_dim]
            self.keys[step.rows, :, step.slots] = key_states[0].transpose(0, 1)
            self.values[step.rows, :, step.slots] = value_states[0].transpose(0, 1)
        if lay.has_trees:  # attended position by position, a tree's tokens take turns in slots: kept here
            lay.fresh = (key_states, value_states)
        return self.keys, self.values  # all rows: the attention (depctl_runtime.model.attention) reads each its own

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.get_seq_length(), 0

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length()

    def get_max_length(self) -> int:
        return self._cache.capacity


class _Step:
    """The forward in progress: its layout, and the cache row and position of every token of the flat stream (made
    on first use: a CUDA graph's pass, ``depctl_runtime.model.graphs``, lays out its own and skips these copies)."""

    def __init__(self, layout: RowLayout):
        self.layout = layout

    @functools.cached_property
    def rows(self) -> torch.Tensor:  # [T]
        lay = self.layout
        return torch.tensor([lay.first + b for b, w in enumerate(lay.widths) for _ in range(w)], device=lay.device)

    @functools.cached_property
    def slots(self) -> torch.Tensor:  # [T]: where each token's keys and values go in its row
        lay = self.layout
        return torch.tensor([s + j for s, w in zip(lay.starts, lay.widths) for j in range(w)], device=lay.device)

    @functools.cached_property
    def positions(self) -> torch.Tensor:  # [T]: each token's position (a tree's token: its depth past the start)
        lay = self.layout
        if not lay.has_trees:
            return self.slots
        return torch.tensor(
            [lay.tree_from(b) + d for b in range(len(lay.widths)) for d in lay.depths(b)],
            device=lay.device,
            dtype=torch.long,
        )


class SlotCache(Cache):
    """The KV cache of one model for up to ``max_rows`` sequences of up to ``capacity`` positions each."""

    def __init__(self, config, max_rows: int, max_capacity: int, capacity: int = 256):
        text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        self.num_layers = text_config.num_hidden_layers
        super().__init__(layers=[SlotLayer(self) for _ in range(self.num_layers)])
        self.max_rows = max_rows
        # the most positions a row may ever need (context + draft slack), up to the keys a prompt chunk attends
        self.max_capacity = -(-max_capacity // PROMPT_KEYS) * PROMPT_KEYS
        self.capacity = min(capacity, max_capacity)  # allocated positions per row; doubles on demand
        self.lengths = [0] * max_rows  # valid positions per row
        self.scratch: int | None = None  # a row past the last, where a fixed-shape pass's padding writes
        self.step: _Step | None = None

    @property
    def allocated_rows(self) -> int:
        return self.max_rows + (self.scratch is not None)

    @torch.inference_mode()
    def reserve_scratch(self) -> int:
        """Add one row past ``max_rows`` for padding to write into (``model.graphs``): no sequence owns it
        and no token reads it. Returns its index."""
        if self.scratch is None:
            self.scratch = self.max_rows
            for layer in self.layers:
                if layer.is_initialized:
                    for name in ("keys", "values"):
                        old = getattr(layer, name)
                        setattr(layer, name, torch.cat([old, old.new_zeros((1, *old.shape[1:]))]))
        return self.scratch

    def begin(
        self,
        first: int,
        widths: list[int],
        device: torch.device,
        per_position: bool = False,
        prompt: bool = False,
        ancestry: list[tuple[int, ...] | None] | None = None,
    ) -> RowLayout:
        """Prepare a forward of ``len(widths)`` rows from ``first``, row b adding ``widths[b]`` tokens to the flat
        stream; prompt: a prompt chunk of one row (``RowLayout.prompt``); ancestry: draft trees (``RowLayout``).
        Returns the layout the attention needs (``depctl_runtime.model.attention``)."""
        starts = [self.lengths[first + b] for b in range(len(widths))]
        offsets = [0]
        for w in widths:
            offsets.append(offsets[-1] + w)
        if ancestry is not None and any(
            a is not None and (len(a) < w or len(a) - w > starts[b]) for b, (a, w) in enumerate(zip(ancestry, widths))
        ):
            raise ValueError("a row's tree must give a parent for each of its tokens, the earlier ones in the cache")
        layout = RowLayout(
            first, starts, list(widths), offsets, device, per_position=per_position, prompt=prompt, ancestry=ancestry
        )
        if layout.kv_len > self.capacity:
            self._grow(layout.kv_len)
        self.step = _Step(layout)
        return layout

    def _grow(self, needed: int) -> None:
        """Rows are allocated for the longest sequence seen so far, doubling up to ``max_capacity``: a deployment
        whose model advertises 32k positions does not reserve 32k x rows before anyone asks for them."""
        if needed > self.max_capacity:
            raise ValueError(f"a row would grow to {needed} positions; the cache holds at most {self.max_capacity}")
        capacity = self.capacity
        while capacity < needed:
            capacity *= 2
        self.capacity = min(capacity, self.max_capacity)
        for layer in self.layers:
            if layer.is_initialized:
                for name in ("keys", "values"):
                    old = getattr(layer, name)
                    new = old.new_zeros((*old.shape[:2], self.capacity, old.shape[-1]))
                    new[:, :, : old.shape[2]] = old
                    setattr(layer, name, new)

    @property
    def allocated(self) -> bool:
        """Whether every layer's tensors exist (they are made by the first forward, at its keys' shape)."""
        return all(layer.is_initialized for layer in self.layers)

    def advance(self, first: int, widths: list[int]) -> None:
        """After the forward: each row's length grows by its real (unpadded) tokens."""
        for b, w in enumerate(widths):
            self.lengths[first + b] += w
        self.step = None

    def set_length(self, row: int, length: int) -> None:
        """Roll a row back (or forget it with 0): positions past ``length`` are overwritten later, never read."""
        if length > self.lengths[row]:
            raise ValueError(f"row {row} holds {self.lengths[row]} positions; cannot extend it to {length}")
        self.lengths[row] = length

    @torch.inference_mode()
    def keep_path(self, row: int, first: int, path: list[int]) -> None:
        """After passes over a draft tree whose tokens sit in ``row`` from slot ``first``: its tokens ``path``
        (indices among them, a branch from the top) to slots ``first, first + 1, ...``, where a chain over them would
        have left them. The caller then sets the row's length."""
        if not self.allocated or not path:
            return
        picked = torch.tensor([first + j for j in path], device=self.layers[0].keys.device)
        span = slice(first, first + len(path))
        for layer in self.layers:
            layer.keys[row, :, span] = layer.keys[row, :, picked]  # (advanced indexing reads a copy first)
            layer.values[row, :, span] = layer.values[row, :, picked]

    @torch.inference_mode()
    def read_block(self, row: int, start: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of positions ``start .. start + n`` of ``row``, every layer's keys and values (``model.prefix``)."""
        if start + n > self.lengths[row]:
            raise ValueError(f"row {row} holds {self.lengths[row]} positions; cannot read up to {start + n}")
        return [
            (layer.keys[row, :, start : start + n].clone(), layer.values[row, :, start : start + n].clone())
            for layer in self.layers
        ]

    @torch.inference_mode()
    def write_block(self, row: int, start: int, block: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put a block read by ``read_block`` at ``start`` of ``row``, which holds exactly ``start`` positions, and
        extend the row over it."""
        if start != self.lengths[row]:
            raise ValueError(f"row {row} holds {self.lengths[row]} positions; a block goes at its end, not {start}")
        n = block[0][0].shape[1]
        if not self.allocated:
            raise ValueError("the cache's tensors do not exist yet (a first forward makes them)")
        if start + n > self.capacity:
            self._grow(start + n)
        for layer, (keys, values) in zip(self.layers, block):
            layer.keys[row, :, start : start + n] = keys
            layer.values[row, :, start : start + n] = values
        self.lengths[row] = start + n

    @torch.inference_mode()
    def move_row(self, src: int, dst: int, pending: int = 0) -> None:
        """Copy row ``src`` into row ``dst`` (a finished sequence's row is refilled so the batch stays rows 0..B-1),
        with ``pending`` positions past its length that a prompt pass in progress has written."""
        n = self.lengths[src] + pending
        if src != dst:
            for layer in self.layers:
                if layer.is_initialized:
                    layer.keys[dst, :, :n] = layer.keys[src, :, :n]
                    layer.values[dst, :, :n] = layer.values[src, :, :n]
        self.lengths[dst] = self.lengths[src]
        if src != dst:
            self.lengths[src] = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.step.layout.kv_len if self.step else max(self.lengths)
