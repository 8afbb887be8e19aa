"""Attention over the ``SlotCache`` rows for a ragged, unpadded token stream, registered with transformers.

A step's tokens go through the model as ONE flat sequence (batch dimension 1): row b contributes ``n_b`` tokens
(its last token and its k_b drafts; one token on a plain step; a prompt chunk on a prefill), so the linear
layers, which are most of the cost, see exactly ``sum(n_b)`` rows and no padding (vLLM v1 batches the same way).
Only attention needs to know where each row's tokens start and which cache row they read; the runner passes that
``RowLayout`` as a keyword argument of the model's forward, which transformers hands down to the attention
function unchanged (as it does ``cu_seq_lens`` for flash-attention's varlen kernels).

- every row equally wide (a plain decode step, a fully drafted batch, a prefill): one batched SDPA call, the
  batch's rows reshaped back into a batch dimension, with a mask over each row's length;
- ragged: one SDPA call per row, over that row's keys only;
- ``per_position`` (any dtype on a CPU, set by the runner): every row is attended as if it were alone in the batch,
  and a row's tokens in a verify pass one position at a time, each call shaped exactly like the one-token step at
  that position. The CPU's SDPA kernels round a query differently when more query rows share the call (in bf16 and
  float32 alike), so a row batched with others would come out differently from the same row alone; this way neither
  a verify pass nor a batch can change a row's bits.
- ``prompt`` (a prompt chunk, one row): one SDPA call whose keys run to the end of the ``PROMPT_KEYS``-token block
  the chunk ends in, and whose folded query rows are padded to a multiple of ``PROMPT_QUERIES``. The CPU's flash
  kernel cuts the keys into blocks of min(512, their number) and takes another path for a last block of fewer than
  4 query rows; with both padded, and chunks that never cross a multiple of ``PROMPT_KEYS`` (the scheduler's
  chunks do not), a position's keys and values come out the same whatever chunk it was read in: a prompt may be
  cut anywhere (a prefix cache resuming mid-block) and still give the bits of reading it in whole chunks.

Called without a layout (``model.generate`` on the same model object), it is transformers' own SDPA attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "depctl_rows"
PER_POSITION_MAX_WIDTH = 33  # the widest verify pass: 1 + the largest --draft-token-count
PROMPT_KEYS = 128  # a prompt chunk attends keys up to a multiple of this: the scheduler's prefill chunk
PROMPT_QUERIES = 32  # and its folded query rows are padded to a multiple of this


@dataclass
class RowLayout:
    """Where a forward's flat token stream sits in the cache: rows ``first..first + B - 1``."""

    first: int
    starts: list[int]  # [B] each row's cache length before this forward (its first new token's position)
    widths: list[int]  # [B] tokens each row adds
    offsets: list[int]  # [B + 1] where each row's tokens start in the flat stream
    device: torch.device
    per_position: bool = False  # attend a verify pass position by position (see the module docstring)
    prompt: bool = False  # a prompt chunk of one row, attended the same wherever the prompt was cut
    # per row, None for a chain, or a draft tree: each of its tokens' parent among them (-1: it sees the cache before
    # the tree only, as a tree's root does). The pass adds the last ``widths[b]`` of them; a draft model's tree grows
    # over several passes, a depth at a time (attended by mask: position by position, a tree is read in one pass)
    ancestry: list[tuple[int, ...] | None] | None = None
    # the keys and values the current layer's cache update just wrote, [1, kv_heads, T, dim] each: a tree's tokens
    # are read from here (their cache slots are shared by the tree's branches)
    fresh: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    _masks: dict = field(default_factory=dict, repr=False)  # per forward: masks by window, per-row layouts

    @property
    def uniform(self) -> bool:
        return len(set(self.widths)) == 1 and not self.has_trees

    @property
    def has_trees(self) -> bool:
        return self.ancestry is not None and any(a is not None for a in self.ancestry)

    def tree(self, b: int) -> tuple[int, ...] | None:
        return None if self.ancestry is None else self.ancestry[b]

    def tree_from(self, b: int) -> int:
        """The cache slot of row b's tree's first token (its tokens sit in slots in their order)."""
        tree = self.tree(b)
        return self.starts[b] - (0 if tree is None else len(tree) - self.widths[b])

    def depths(self, b: int) -> list[int]:
        """Row b's new tokens' positions past ``tree_from(b)``: a tree's token's depth (its root's is 0)."""
        tree = self.tree(b)
        if tree is None:
            return list(range(self.widths[b]))
        out: list[int] = []
        for parent in tree:
            out.append(0 if parent < 0 else out[parent] + 1)
        return out[len(tree) - self.widths[b] :]

    @property
    def kv_len(self) -> int:
        """Keys the attention reads: each row's up to its last new token; a prompt chunk's up to the next multiple
        of ``PROMPT_KEYS`` (masked past its last token)."""
        end = max(s + w for s, w in zip(self.starts, self.widths))
        return -(-end // PROMPT_KEYS) * PROMPT_KEYS if self.prompt else end

    def alone(self, b: int) -> "RowLayout":
        """Row b's layout as if it were the only row: for ``per_position`` attention, built once per forward."""
        key = ("alone", b)
        if key not in self._masks:
            width = self.widths[b]
            self._masks[key] = RowLayout(
                self.first + b,
                [self.starts[b]],
                [width],
                [0, width],
                self.device,
                per_position=True,
                ancestry=None if self.tree(b) is None else [self.tree(b)],
            )
        alone = self._masks[key]
        if self.fresh is not None:  # this layer's, so set on every call
            lo, hi = self.offsets[b], self.offsets[b + 1]
            alone.fresh = (self.fresh[0][:, :, lo:hi], self.fresh[1][:, :, lo:hi])
        return alone

    def batched_mask(self, window: int | None, groups: int, dtype: torch.dtype) -> torch.Tensor:
        """The uniform case's mask, token j of row b (position starts[b] + j) seeing its row up to itself, folded for
        ``_attend`` ([B, 1, groups * S, L]) and additive (0 or -inf in ``dtype``, what SDPA would turn a bool mask
        into on every call). Built once per forward, not once per layer."""
        key = ("batched", window, groups, dtype)
        if key not in self._masks:
            width = self.widths[0]
            q_pos = torch.tensor(self.starts, device=self.device)[:, None] + torch.arange(width, device=self.device)
            self._masks[key] = _additive(q_pos[:, None, :, None], 0, self.kv_len, window, groups, dtype)
        return self._masks[key]

    def prompt_mask(self, window: int | None, groups: int, dtype: torch.dtype) -> torch.Tensor:
        """A prompt chunk's mask: ``batched_mask`` with rows added up to a multiple of ``PROMPT_QUERIES``, each
        seeing every key (the zero queries ``_attend`` pads with)."""
        key = ("prompt", window, groups, dtype)
        if key not in self._masks:
            mask = self.batched_mask(window, groups, dtype)
            extra = -mask.shape[2] % PROMPT_QUERIES
            self._masks[key] = torch.cat([mask, mask.new_zeros(1, 1, extra, mask.shape[3])], 2)
        return self._masks[key]

    def row_mask(self, b: int, first_key: int, window: int | None, groups: int, dtype: torch.dtype) -> torch.Tensor:
        """Row b's mask in the ragged case: [1, 1, groups * n, keys], as ``batched_mask``. A tree's token sees the
        row's cache before the tree and, among the tree's own slots, its ancestors and itself."""
        key = ("row", b, window, groups, dtype)
        if key not in self._masks:
            start, end = self.starts[b], self.starts[b] + self.widths[b]
            if self.tree(b) is None:
                q_pos = torch.arange(start, end, device=self.device)[None, None, :, None]  # [1, 1, n, 1]
                self._masks[key] = _additive(q_pos, first_key, end, window, groups, dtype)
            else:
                self._masks[key] = self._tree_mask(b, first_key, window, groups, dtype)
        return self._masks[key]

    def _tree_mask(self, b: int, first_key: int, window: int | None, groups: int, dtype: torch.dtype) -> torch.Tensor:
        """Keys ``first_key`` up to the tree's last slot; the new tokens' rows."""
        tree, root = self.tree(b), self.tree_from(b)
        n, new = len(tree), self.widths[b]
        lineage = torch.eye(n, dtype=torch.bool, device=self.device)  # [n, n]: slot a is token j's ancestor or j
        depth = [0] * n
        for j, parent in enumerate(tree):
            if parent >= 0:
                lineage[j] |= lineage[parent]
                depth[j] = depth[parent] + 1
        pos = root + torch.tensor(depth, device=self.device)  # [n]: each tree token's position
        key_pos = torch.cat([torch.arange(first_key, root, device=self.device), pos])  # a slot's position
        sees = torch.cat([torch.ones(n, root - first_key, dtype=torch.bool, device=self.device), lineage], 1)
        if window is not None:
            sees = sees & (key_pos[None, :] > pos[:, None] - window)
        sees = sees[n - new :]
        mask = torch.zeros(sees.shape, dtype=dtype, device=self.device).masked_fill_(~sees, float("-inf"))
        return mask[None, None].repeat(1, 1, groups, 1)


def _additive(
    q_pos: torch.Tensor, first_key: int, end: int, window: int | None, groups: int, dtype: torch.dtype
) -> torch.Tensor:
    """q_pos [B, 1, S, 1] -> [B, 1, groups * S, end - first_key]: 0 where a query sees a key, -inf elsewhere."""
    kv_pos = torch.arange(first_key, end, device=q_pos.device)
    sees = kv_pos <= q_pos
    if window is not None:
        sees = sees & (kv_pos > q_pos - window)
    mask = torch.zeros(sees.shape, dtype=dtype, device=q_pos.device).masked_fill_(~sees, float("-inf"))
    return mask.repeat(1, 1, groups, 1)  # the query's rows are (group, position) after folding: see _attend


def rows_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling=None,
    dropout=0.0,
    sliding_window=None,
    depctl_rows: RowLayout | None = None,
    **kwargs,
):
    """query: [1, heads, T, dim]; key, value: the cache's rows [rows, kv_heads, capacity, dim] (or, without a
    layout, ordinary [B, kv_heads, L, dim] tensors). Returns [1, T, heads, dim] and no weights."""
    if depctl_rows is None:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            scaling=scaling,
            dropout=dropout,
            sliding_window=sliding_window,
            **kwargs,
        )
    lay = depctl_rows
    window = sliding_window or None
    heads, dim = query.shape[1], query.shape[3]
    groups = heads // key.shape[1]
    if lay.per_position and len(lay.widths) > 1:  # each row exactly as in a batch of one
        out = query.new_empty(1, query.shape[2], heads, dim)
        for b in range(len(lay.widths)):
            lo, hi = lay.offsets[b], lay.offsets[b + 1]
            out[:, lo:hi] = rows_attention(
                module,
                query[:, :, lo:hi],
                key,
                value,
                None,
                scaling=scaling,
                sliding_window=sliding_window,
                depctl_rows=lay.alone(b),
            )[0]
        return out, None
    if lay.per_position and lay.tree(0) is not None:  # (one row here: ``alone`` above)
        return _tree_per_position(query, key, value, lay, window, scaling), None
    if lay.prompt:
        k, v = key[lay.first : lay.first + 1, :, : lay.kv_len], value[lay.first : lay.first + 1, :, : lay.kv_len]
        q = query.reshape(1, heads, lay.widths[0], dim)
        out = _attend(q, k, v, lay.prompt_mask(window, groups, query.dtype), scaling)
        return out.transpose(1, 2).reshape(1, lay.widths[0], heads, dim), None
    per_position = lay.per_position and max(lay.widths) <= PER_POSITION_MAX_WIDTH
    if lay.uniform:
        rows, width = len(lay.widths), lay.widths[0]
        q = query[0].reshape(heads, rows, width, dim).transpose(0, 1)  # [B, heads, S, dim]
        if rows == 1 and (width == 1 or per_position):  # one query at a time: exactly a one-token step's call
            out = torch.cat(
                [
                    _one_query(q[:, :, j : j + 1], key[lay.first], value[lay.first], lay.starts[0] + j, window, scaling)
                    for j in range(width)
                ],
                2,
            )
        else:
            k = key[lay.first : lay.first + rows, :, : lay.kv_len]  # [B, kv_heads, L, dim]
            v = value[lay.first : lay.first + rows, :, : lay.kv_len]
            out = _attend(q, k, v, lay.batched_mask(window, groups, query.dtype), scaling)  # [B, heads, S, dim]
        return out.transpose(1, 2).reshape(1, rows * width, heads, dim), None
    out = query.new_empty(1, query.shape[2], heads, dim)
    for b, (start, width) in enumerate(zip(lay.starts, lay.widths)):
        lo = lay.offsets[b]
        end = start + width  # keys this row's last token sees
        first_key = 0 if window is None else max(0, start - window + 1)
        q = query[:, :, lo : lo + width]  # [1, heads, n, dim]
        k = key[lay.first + b : lay.first + b + 1, :, first_key:end]  # [1, kv_heads, keys, dim]
        v = value[lay.first + b : lay.first + b + 1, :, first_key:end]
        mask = lay.row_mask(b, first_key, window, groups, query.dtype) if width > 1 or window is not None else None
        out[0, lo : lo + width] = _attend(q, k, v, mask, scaling)[0].transpose(0, 1)
    return out, None


def _tree_per_position(query, key, value, lay: RowLayout, window, scale) -> torch.Tensor:
    """A draft tree of one row, read in one pass, each token attended exactly as the one-token step at its position
    would be: the tokens are visited depth first, and each is first written into the slot of its position, so that
    the slots up to it hold its own path (a token's keys and values come from ``lay.fresh``). Then the slots hold
    the tree in its order again. query: [1, heads, n, dim] -> [1, n, heads, dim]."""
    tree, start, row = lay.tree(0), lay.starts[0], lay.first
    if len(tree) != lay.widths[0]:
        raise ValueError("position by position, a tree is read in one pass (a tree grown over passes: by mask)")
    depths = lay.depths(0)
    fresh_k, fresh_v = lay.fresh[0][0], lay.fresh[1][0]  # [kv_heads, n, dim]
    children: dict[int, list[int]] = {}
    for j, parent in enumerate(tree):
        children.setdefault(parent, []).append(j)
    out = query.new_empty(1, len(tree), query.shape[1], query.shape[3])
    todo = list(reversed(children.get(-1, [])))
    while todo:  # depth first, children in their order
        j = todo.pop()
        slot = start + depths[j]
        key[row, :, slot] = fresh_k[:, j]
        value[row, :, slot] = fresh_v[:, j]
        out[0, j] = _one_query(query[:, :, j : j + 1], key[row], value[row], slot, window, scale)[0, :, 0]
        todo.extend(reversed(children.get(j, [])))
    key[row, :, start : start + len(tree)] = fresh_k
    value[row, :, start : start + len(tree)] = fresh_v
    return out


def _one_query(q, key, value, position, window, scale):
    """One query at ``position`` of one cache row: q [1, heads, 1, dim], key/value [kv_heads, capacity, dim]. The keys
    it
    sees are a contiguous range (a sliding window only moves its start), so there is no mask: SDPA keeps its fast path,
    and a verify pass's position-by-position calls are shaped exactly like the one-token steps they must equal."""
    lo = 0 if window is None else max(0, position - window + 1)
    return _attend(q, key[None, :, lo : position + 1], value[None, :, lo : position + 1], None, scale)


def _attend(q, k, v, mask, scale):
    """SDPA with grouped-query heads folded into the query length: q [B, heads, S, dim], k and v
    [B, kv_heads, L, dim], mask [B, 1, groups * S (or more: ``RowLayout.prompt_mask``), L] (already folded:
    ``RowLayout.batched_mask``) or None. Folding keeps SDPA on its fused CPU kernel; ``enable_gqa`` with a mask took
    the math path (2x the attention time, and copies of every key)."""
    batch, heads, width, dim = q.shape
    kv_heads = k.shape[1]
    rows = heads // kv_heads * width
    q = q.reshape(batch, kv_heads, rows, dim)  # head h = kv_head * groups + g; row g * S + s
    if mask is not None and mask.shape[2] > rows:  # a prompt chunk's padding rows: zeros, sliced off
        q = torch.cat([q, q.new_zeros(batch, kv_heads, mask.shape[2] - rows, dim)], 2)
    out = sdpa(q, k, v, attn_mask=mask, scale=scale)
    return out[:, :, :rows].reshape(batch, heads, width, dim)


AttentionInterface.register(NAME, rows_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)  # model.generate on the same model builds SDPA masks
