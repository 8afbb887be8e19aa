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

The head predicts over its reduced vocabulary; its logits are spread over the target's vocabulary (-inf elsewhere) so
that greedy choice, sampling with the row's own settings (the draft probabilities rejection sampling needs) and
grammars work exactly as for a draft model (``proposers.draft_loop``). Drafts only propose: the output is the target's.
"""

from __future__ import annotations

import time

import torch
from torch.nn import functional as F

from depctl_runtime.model.eagle import EagleHead
from depctl_runtime.speculation.proposers import ModelDrafts, draft_loop


class EagleProposer:
    name = "eagle"

    # a catch-up on up to K + 1 positions is a few more rows of the q/k/v products: a drafting step's cost, whatever K
    # (only a prompt's, hundreds of positions, says nothing of what drafting costs)
    steady_catch_up = 17
    needs_prompt_features = True  # it reads every prompt position's layer features: no prompt from the prefix cache

    def __init__(self, head: EagleHead, max_rows: int, vocab_size: int):
        self.head = head
        self.dtype = head.norm.weight.dtype  # (its linears may be packed: the norms never are)
        self.device = head.norm.weight.device
        self.vocab_size = vocab_size  # the target's logits' width
        c = head.config
        self.kv_heads, self.dim = c.num_key_value_heads, c.head_dim
        self.groups = c.num_attention_heads // c.num_key_value_heads
        self.keys = torch.zeros(max_rows, self.kv_heads, 0, self.dim, dtype=self.dtype, device=self.device)
        self.values = torch.zeros_like(self.keys)
        self.lengths = [0] * max_rows  # entries per row: indices 0..length-1
        self.waiting: list[_Held | None] = [None] * max_rows
        ids = head.target_ids
        self._columns = ids[ids < vocab_size]  # draft ids past the target's real vocabulary never draft
        self._draft_cols = torch.nonzero(ids < vocab_size).flatten()

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
        positions = torch.cat([torch.arange(s, s + t.shape[0], device=self.device) for s, t, _ in pending])
        q, k, v, residual = head._qkv(tokens, fused, positions)  # q [heads, M, dim], k and v [kv_heads, M, dim]
        at, last = 0, []
        for b, (start, t, _) in enumerate(pending):
            m = t.shape[0]
            self.keys[b, :, start : start + m] = k[:, at : at + m]
            self.values[b, :, start : start + m] = v[:, at : at + m]
            self.lengths[b] = start + m - 1  # the last index is caught up again next time (below)
            at += m
            last.append(at - 1)
        # d_1: the last index of each row attends over its row (itself included)
        out = self._attend_finish(q[:, last], residual[last], ends)  # [B, hidden]
        state = {"out": out, "lengths": list(ends)}

        def step(token: torch.Tensor) -> torch.Tensor:  # token [B] -> the next draft's logits [B, vocab]
            # step j's entry goes at index and position n - 2 + j: right after the row's entries and chain so far
            at = torch.tensor(state["lengths"], device=self.device)
            q, k, v, residual = head._qkv(token, state["out"], at)
            rows = torch.arange(len(batch), device=self.device)
            self.keys[rows, :, at] = k.transpose(0, 1)  # [B, kv_heads, dim], each row at its own index
            self.values[rows, :, at] = v.transpose(0, 1)
            state["lengths"] = [n + 1 for n in state["lengths"]]
            state["out"] = self._attend_finish(q, residual, state["lengths"])
            return self._spread(head.logits(state["out"]))

        drafted = draft_loop(batch, width, self._spread(head.logits(out)), step, min_confidence)
        return ModelDrafts(drafted.tokens, drafted.probs, caught_up, confident=drafted.confident, chains=drafted.chains)

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

    def _spread(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, draft_vocab] -> [B, vocab]: each draft id's logit at its target id, -inf at the rest."""
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        full[:, self._columns] = logits[:, self._draft_cols]
        return full

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
    def calibrate(self, cost, rows: int, prompt: list[int], repeats: int = 2) -> None:
        """A draft step's cost over 1 and ``rows`` rows into ``cost`` (a ``policy.CostModel``), over ``len(prompt)``
        entries a row; leaves every row empty."""
        head, n = self.head, len(prompt)
        self._reserve(n + 1)
        for b in sorted({1, rows}):
            best = float("inf")
            token = torch.tensor(prompt[:1] * b, device=self.device)
            hidden = torch.zeros(b, head.config.hidden_size, dtype=self.dtype, device=self.device)
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                q, k, v, residual = head._qkv(token, hidden, torch.full((b,), n, device=self.device))
                self.keys[:b, :, n] = k.transpose(0, 1)
                out = self._attend_finish(q, residual, [n + 1] * b)
                greedy_tokens = self._spread(head.logits(out)).max(-1).indices
                greedy_tokens.tolist()
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
