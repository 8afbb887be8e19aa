"""SlotCache: one preallocated KV cache for a batch of sequences, indexed by position, a length per row.

Every sequence in the running batch owns one *row*. A row's ``length`` is how many positions of it hold valid
keys and values; a forward writes a row's new tokens at ``length, length + 1, ...`` and the attention mask lets the
token at position ``p`` see positions ``<= p`` of its own row only. Rolling back after a rejection is therefore pure
bookkeeping (``length`` moves back to the accepted length) and the rejected positions are overwritten by the next
forward, as in gpt-fast's ``input_pos`` cache and vLLM's ``num_computed_tokens``. Nothing is ever cropped, so a
sliding-window layer (Gemma 3, Qwen2 with ``use_sliding_window``) keeps full rows and only its mask changes.

It plugs into transformers through public interfaces only: a ``Cache`` subclass whose layers' ``update`` scatter
into the rows, explicit ``position_ids``, and a ready 4D mask (a dict per layer type for models with sliding
layers), which transformers passes to the attention as is.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class SlotLayer(CacheLayerMixin):
    """One decoder layer's keys and values: ``[rows, kv_heads, capacity, head_dim]`` each."""

    supports_early_init = False

    def __init__(self, cache: "SlotCache"):
        super().__init__()
        self._cache = cache

    def lazy_initialization(self, key_states, value_states) -> None:
        c = self._cache
        shape = (c.max_rows, key_states.shape[1], c.capacity, key_states.shape[-1])
        self.keys = key_states.new_zeros(shape)
        self.values = value_states.new_zeros((*shape[:3], value_states.shape[-1]))
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        # key_states: [B, kv_heads, S, head_dim] for rows first..first + B - 1 of this forward
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        step = self._cache.step
        rows = slice(step.first, step.first + key_states.shape[0])
        keys, values = self.keys[rows], self.values[rows]  # views into the preallocated rows
        if step.uniform_start is not None:  # every row writes at the same positions (one row, or a fresh batch)
            span = slice(step.uniform_start, step.uniform_start + key_states.shape[2])
            keys[:, :, span] = key_states
            values[:, :, span] = value_states
        else:
            # [B, S] row and position of every new token; advanced indices around a slice put [B, S] first
            keys[step.row_index, :, step.positions] = key_states.transpose(1, 2)
            values[step.row_index, :, step.positions] = value_states.transpose(1, 2)
        return keys[:, :, : step.kv_len], values[:, :, : step.kv_len]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.step.kv_len, 0

    def get_seq_length(self) -> int:
        return self._cache.step.kv_len if self._cache.step else 0

    def get_max_length(self) -> int:
        return self._cache.capacity


class _Step:
    """Where this forward writes: rows ``first..first + B - 1``, token j of row b at ``positions[b, j]``."""

    def __init__(self, first: int, starts: list[int], width: int, device: torch.device):
        self.first = first
        self.kv_len = max(starts) + width  # keys each query may need to see: up to its row's last new position
        self.uniform_start = starts[0] if len(set(starts)) == 1 else None
        start = torch.tensor(starts, device=device)
        self.positions = start[:, None] + torch.arange(width, device=device)  # [B, S]
        self.row_index = torch.arange(len(starts), device=device)[:, None].expand(-1, width)  # [B, S]


class SlotCache(Cache):
    """The KV cache of one model for up to ``max_rows`` sequences of up to ``capacity`` positions each."""

    def __init__(self, config, max_rows: int, max_capacity: int, capacity: int = 256):
        text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        self.num_layers = text_config.num_hidden_layers
        super().__init__(layers=[SlotLayer(self) for _ in range(self.num_layers)])
        self.max_rows = max_rows
        self.max_capacity = max_capacity  # the most positions a row may ever need (context + draft slack)
        self.capacity = min(capacity, max_capacity)  # allocated positions per row; doubles on demand
        self.lengths = [0] * max_rows  # valid positions per row
        self.step: _Step | None = None
        layer_types = getattr(text_config, "layer_types", None) or []
        self.sliding_window = getattr(text_config, "sliding_window", None) if "sliding_attention" in layer_types else None

    def begin(self, first: int, widths: list[int], device: torch.device) -> tuple[torch.Tensor, object]:
        """Prepare a forward of ``len(widths)`` rows from ``first``, row b adding ``widths[b]`` tokens (padded to
        the widest). Returns ``position_ids [B, S]`` and the attention mask (a dict per layer type when the model
        has sliding layers)."""
        starts = [self.lengths[first + b] for b in range(len(widths))]
        width = max(widths)
        if max(starts) + width > self.capacity:
            self._grow(max(starts) + width)
        self.step = step = _Step(first, starts, width, device)
        kv_pos = torch.arange(step.kv_len, device=device)  # [L]
        q_pos = step.positions[:, None, :, None]  # [B, 1, S, 1]
        mask = kv_pos <= q_pos  # [B, 1, S, L]: causal within the row; padded queries see a valid prefix too
        if self.sliding_window is None:
            return step.positions, mask
        sliding = mask & (kv_pos > q_pos - self.sliding_window)
        return step.positions, {"full_attention": mask, "sliding_attention": sliding}

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
    def move_row(self, src: int, dst: int) -> None:
        """Copy row ``src`` into row ``dst`` (a finished sequence's row is refilled so the batch stays rows 0..B-1)."""
        n = self.lengths[src]
        if src != dst:
            for layer in self.layers:
                if layer.is_initialized:
                    layer.keys[dst, :, :n] = layer.keys[src, :, :n]
                    layer.values[dst, :, :n] = layer.values[src, :, :n]
        self.lengths[dst] = n
        self.lengths[src] = 0 if src != dst else n

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.step.kv_len if self.step else max(self.lengths)

    def nbytes(self) -> int:
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers if layer.is_initialized)
