"""EagleProposer: drafts from the target's own layer outputs through an EAGLE-3 head (``depctl_runtime.model.eagle``).

The target's passes return the outputs of the head's three layers for every token they read (``Scores.features``);
the engine hands a row's to ``prefilled`` and ``accepted``, and they wait here until the row next drafts. The head keeps
one entry per index i of a row, made from the target's features at position i and the token at i + 1 (so an entry
exists for every accepted token but the last). Drafting from a row of n tokens:

1. **catch up**: the entries for indices ``length .. n - 2`` from the waiting features. A one-layer head's keys and
   values depend only on its inputs, so catch-up is the q/k/v products of every waiting index of every row at once,
   and attention and the MLP only at each row's last index, whose output drafts ``d_1``.
2. **draft**: step j feeds ``d_j`` with the head's own output of step j - 1 where the target's features were, at
   position ``n - 2 + j``, attending to the row's entries and its chain so far: what ``EagleHead.ttt_logits`` trains.
3. **roll back**: the chain's entries came from the head's own states, never the target's, so the row keeps only its
   caught-up entries; the next step's features replace the rest.

The head predicts over its reduced vocabulary: greedy rows draft within it, and for rows that sample or follow a
grammar its logits are spread over the target's vocabulary (-inf elsewhere), so that sampling with the row's own
settings (the draft probabilities rejection sampling needs) and grammars work exactly as for a draft model
(``proposers.draft_loop``). Drafts only propose: the output is the target's.
"""

from __future__ import annotations

import itertools
import time

import torch
from torch.nn import functional as F

from depctl_runtime.model.compiled_head import CompiledHead
from depctl_runtime.model.eagle import EagleHead
from depctl_runtime.speculation.proposers import DraftVocabulary, ModelDrafts, draft_loop


class EagleProposer:
    name = "eagle"

    # a catch-up on up to K + 1 positions is a few more rows of the q/k/v products: a drafting step's cost, whatever K
    # (only a prompt's, hundreds of positions, says nothing of what drafting costs)
    steady_catch_up = 17
    needs_prompt_features = True  # it reads every prompt position's layer features: no prompt from the prefix cache

    def __init__(self, head: EagleHead, max_rows: int, vocab_size: int, compiled: CompiledHead | None = None):
        self.head = head
        self.compiled = compiled  # the head's step as compiled libraries (``model.compiled_head``); None: eagerly
        self.dtype = head.norm.weight.dtype  # (its linears may be packed: the norms never are)
        self.device = head.norm.weight.device
        c = head.config
        self.kv_heads, self.dim = c.num_key_value_heads, c.head_dim
        self.groups = c.num_attention_heads // c.num_key_value_heads
        self.keys = torch.zeros(max_rows, self.kv_heads, 0, self.dim, dtype=self.dtype, device=self.device)
        self.values = torch.zeros_like(self.keys)
        self.lengths = [0] * max_rows  # entries per row: indices 0..length-1
        self.waiting: list[_Held | None] = [None] * max_rows
        ids = head.target_ids
        real = ids < vocab_size  # draft ids past the target's real vocabulary never draft
        self._draft_cols = None if bool(real.all()) else torch.nonzero(real).flatten()
        self.vocabulary = DraftVocabulary(ids[real], vocab_size)

    # ---- the rows, in step with the target's ----
    def prefilled(self, seq, start: int, features: torch.Tensor | None, logits=None) -> None:
        self._wait(seq.row, start, features)

    def accepted(self, seq, before: int, emitted, drafted, features: torch.Tensor | None, logits=None) -> None:
        """The verify pass read positions ``before - 1 ..``; ``features`` holds those of the accepted tokens."""
        self._wait(seq.row, before - 1, features)

    def _wait(self, row: int, start: int, features: torch.Tensor | None) -> None:
        if features is None:
            raise ValueError("an EAGLE head needs the target's layer features: the target runner must take them")
        held = self.waiting[row]
        if held is None:
            held = self.waiting[row] = _Held(start, features.new_empty(max(64, features.shape[0]), features.shape[1]))
        held.put(start - held.first, features)  # a position read again replaces what was held for it

    def behind(self, seq) -> int:
        """The entries its next draft makes before drafting: one per index it has features for and not yet read."""
        return max(len(seq.tokens) - 1 - self.lengths[seq.row], 0)

    def set_length(self, row: int, length: int) -> None:
        """The row's tokens were cut to ``length``: its entries past index length - 2 and features past position
        length - 1 no longer hold."""
        self.lengths[row] = min(self.lengths[row], max(length - 1, 0))
        held = self.waiting[row]
        if length == 0 or held is None or length <= held.first:
            self.waiting[row] = None
            return
        held.count = min(held.count, length - held.first)

    @torch.inference_mode()
    def move_row(self, src: int, dst: int) -> None:
        self.keys[dst], self.values[dst] = self.keys[src], self.values[src]
        self.lengths[dst], self.waiting[dst] = self.lengths[src], self.waiting[src]
        self.lengths[src], self.waiting[src] = 0, None

    def release(self) -> None:
        self.keys = self.values = None
        if self.compiled is not None:
            self.compiled.release()

    # ---- drafting ----
    @torch.inference_mode()
    def propose(self, batch, width: int, min_confidence: float = 0.0) -> ModelDrafts:
        """``width`` drafts for each of rows 0..B-1 (``batch[b]`` has ``tokens``, ``sampling``, ``generator``), as
        far as ``min_confidence`` finds them worth verifying (``proposers.draft_loop``)."""
        head = self.head
        ends = [len(seq.tokens) - 1 for seq in batch]  # a row's last index with a next token: ends[b] - 1
        self._reserve(max(ends) + width)
        pending = []  # per row: (first index, tokens [m], features [m, F])
        for b, seq in enumerate(batch):
            start, held = self.lengths[b], self.waiting[b]
            first, count = (held.first, held.count) if held is not None else (start, 0)
            if first > start or first + count < ends[b] or start >= ends[b]:
                raise RuntimeError(
                    f"row {b}: entries 0..{start - 1} and features {first}..{first + count - 1} cannot draft "
                    f"after {ends[b] + 1} tokens: the engine skipped a prefilled() or accepted() call"
                )
            tokens = torch.tensor(seq.tokens[start + 1 : ends[b] + 1], device=self.device)
            pending.append((start, tokens, held.buf[start - first : ends[b] - first]))
        caught_up = max(t.shape[0] for _, t, _ in pending)
        # catch up: keys and values for every waiting index of every row in one set of products
        tokens = torch.cat([t for _, t, _ in pending])
        fused = head.fuse(torch.cat([f for _, _, f in pending]).to(self.dtype))  # [M, hidden]
        for b in range(len(batch)):  # the last index is caught up again next time: its query drafts d_1
            self.waiting[b].keep_from(ends[b] - 1)
            self.lengths[b] = ends[b] - 1
        indices = [(b, i) for b, (start, _, _) in enumerate(pending) for i in range(start, ends[b])]
        rows, positions = torch.tensor(indices, device=self.device).T.contiguous()  # [M] each
        q, residual = self._keys(tokens, fused, positions, rows)  # q [heads, M, dim]
        last = list(itertools.accumulate(end - start for end, (start, _, _) in zip(ends, pending)))
        last = [n - 1 for n in last]
        # d_1: the last index of each row attends over its row (itself included)
        batch_rows = torch.arange(len(batch), device=self.device)
        out, logits = self._attend(q[:, last], residual[last], positions[last], batch_rows, ends)  # [B, hidden]
        state = {"out": out, "lengths": list(ends)}

        def step(token: torch.Tensor) -> torch.Tensor:  # token [B] -> the next draft's logits over ``vocabulary``
            # step j's entry goes at index and position n - 2 + j: right after the row's entries and chain so far
            at = torch.tensor(state["lengths"], device=self.device)
            q, residual = self._keys(token, state["out"], at, batch_rows)
            state["lengths"] = [n + 1 for n in state["lengths"]]
            state["out"], logits = self._attend(q, residual, at, batch_rows, state["lengths"])
            return logits

        drafted = draft_loop(batch, width, logits, step, min_confidence, self.vocabulary)
        return ModelDrafts(
            drafted.tokens,
            drafted.probs,
            caught_up,
            confident=drafted.confident,
            chains=drafted.chains,
            forwards=drafted.forwards,
            forward_seconds=drafted.forward_seconds,
        )

    def _keys(self, tokens, hidden, positions, rows) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's entries for T (row, position) pairs written into its cache; their queries [heads, T, dim] and
        residual [T, hidden]."""
        if self.compiled is not None:
            return self.compiled.keys(tokens, hidden, positions, rows, self.keys, self.values)
        q, k, v, residual = self.head._qkv(tokens, hidden, positions)  # k and v [kv_heads, T, dim]
        self.keys[rows, :, positions] = k.transpose(0, 1)
        self.values[rows, :, positions] = v.transpose(0, 1)
        return q, residual

    def _attend(self, q, residual, positions, rows, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One query per row 0..B-1, each over its row's entries up to ``positions[b]`` (``lengths[b]`` of them) ->
        the layer's output [B, hidden] and the logits over ``vocabulary``."""
        if self.compiled is not None:
            out, logits = self.compiled.attend(q, residual, positions, rows, self.keys, self.values)
        else:
            out = self._attend_finish(q, residual, lengths)
            logits = self.head.logits(out)
        return out, logits if self._draft_cols is None else logits[:, self._draft_cols]

    def _attend_finish(self, q: torch.Tensor, residual: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """One query per row (q [heads, B, dim]) over its row's first ``lengths[b]`` entries -> the layer's output
        [B, hidden]."""
        rows, span = q.shape[1], max(lengths)
        # the query heads that share a key head attend as that head's queries: the cache is read in place, where
        # repeating it per query head copied every row's whole context each draft step
        queries = q.transpose(0, 1).reshape(rows, self.kv_heads, self.groups, self.dim)
        sees = torch.arange(span, device=self.device)[None] < torch.tensor(lengths, device=self.device)[:, None]
        attended = F.scaled_dot_product_attention(
            queries,
            self.keys[:rows, :, :span],
            self.values[:rows, :, :span],
            attn_mask=sees[:, None, None],
            scale=self.dim**-0.5,
        )  # [B, kv_heads, groups, dim]
        return self.head._finish(attended.reshape(rows, -1, self.dim).transpose(0, 1), residual)

    def _reserve(self, positions: int) -> None:
        """Room for ``positions`` entries a row (doubling, so a growing context copies rarely)."""
        capacity = self.keys.shape[2]
        if positions <= capacity:
            return
        grown = max(positions, 2 * capacity, 64)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[0], old.shape[1], grown, old.shape[3])
            new[:, :, :capacity] = old
            setattr(self, name, new)

    # ---- load time ----
    @torch.inference_mode()
    def calibrate(self, cost, rows: int, prompt: list[int], repeats: int = 2, catch_up=None) -> None:
        """A draft step's cost over 1 and ``rows`` rows into ``cost`` (a ``policy.CostModel``), over ``len(prompt)``
        entries a row; leaves every row empty. (A catch-up is one layer's products over a few rows of entries: priced
        from serving's steps alone, ``catch_up`` is left as it is.)"""
        head, n = self.head, len(prompt)
        self._reserve(n + 1)
        for b in sorted({1, rows}):
            best = float("inf")
            token = torch.tensor(prompt[:1] * b, device=self.device)
            hidden = torch.zeros(b, head.config.hidden_size, dtype=self.dtype, device=self.device)
            rows_b = torch.arange(b, device=self.device)
            at = torch.full((b,), n, device=self.device)
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                q, residual = self._keys(token, hidden, at, rows_b)
                _, logits = self._attend(q, residual, at, rows_b, [n + 1] * b)
                logits.max(-1).indices.tolist()
                best = min(best, time.perf_counter() - t0)
            cost.samples[b] = best
        self.lengths = [0] * len(self.lengths)
        self.waiting = [None] * len(self.waiting)


class _Held:
    """A row's target features from position ``first`` on, waiting for its next draft: a buffer that grows by
    doubling, so a row that decodes plainly for a long while appends each step's features instead of copying all."""

    def __init__(self, first: int, buf: torch.Tensor):
        self.first, self.buf, self.count = first, buf, 0

    def put(self, at: int, features: torch.Tensor) -> None:
        """``features`` for positions ``first + at ..``; whatever was held from there on is dropped."""
        end = at + features.shape[0]
        if end > self.buf.shape[0]:
            grown = self.buf.new_empty(max(end, 2 * self.buf.shape[0]), self.buf.shape[1])
            grown[:at] = self.buf[:at]
            self.buf = grown
        self.buf[at:end] = features
        self.count = end

    def keep_from(self, position: int) -> None:
        """Drop the features before ``position`` (their entries are in the head's cache now)."""
        drop = position - self.first
        self.buf[: self.count - drop] = self.buf[drop : self.count].clone()
        self.first, self.count = position, self.count - drop
