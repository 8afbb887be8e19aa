"""A learning head's data while traffic is short: the target's own answers, generated in idle time a pass at a time,
first to the prompts depctl ships (``depctl draft train``'s set), then to requests the target writes itself.

A deployment that learns from its traffic has nothing to learn from until it has served, and a head trained on a few
hundred answers learns those answers: on prompts it never saw, it drafts little better than at the start. Idle time
therefore answers prompts of its own: greedily, through a runner of its own over the target's weights, ``ROWS``
answers side by side (its own small KV cache, and its own instance of the deployment's compiled library where it has
one; the engine's rows, cache and passes are never touched, so a request arriving mid-answer is served exactly as it
would have been, and the answers go on in the next idle slice). A pass reads a chunk of each prompt being read and a
token of each answer; the chunk follows the time of the passes, so that one stays within a slice of idle time.

Once the shipped prompts are answered, the target writes the requests (as Magpie does, Xu et al. 2024): given its chat
template's opening of a user turn and nothing else, an instruct model continues with a user's request as it learned
them, sampled, so each differs; the turn it writes is closed by the template and answered greedily, as the deployment
answers. No text comes from outside the deployment, and the head learns the target's answers to requests of every
kind it was tuned on, not only the ones depctl ships. Each answer is recorded as a served one is: tokens, the target's
layer features at every position (the written request's too), one prompt in eight held out; on disk, the newest of them
replace the oldest beyond their share of the budget (``traffic.IDLE_SHARE``), and writing stops after ``MAX_REQUESTS``
requests, so that an idle deployment stops using its CPU once training has caught up.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from depctl_runtime.model.runner import ModelRunner
from depctl_runtime.training.capture import Recorded, keep_top
from depctl_runtime.training.traffic import MIN_ANSWER, Answer, Top

# answers side by side: a pass over 16 costs little more than over 8 (BENCHMARKS.md, "An hour with idle answers")
ROWS = 16
MAX_TOKENS = 192  # tokens an answer may run to, as ``depctl draft train`` generates them
MIN_CHUNK, MAX_CHUNK = 4, 64  # prompt tokens a row reads in one pass: halved or doubled as the passes run long or short
SLICE = 0.25  # seconds a pass should take at most (the learner passes its own slice)
MAX_REQUESTS = 4096  # requests the target writes in all; then idle time is training's alone
WRITE_TEMPERATURE = 1.0  # a written request is sampled from the target's own distribution, unsharpened
MAX_WRITTEN = 128  # tokens a written request may run to; one that runs on is closed there


@dataclass
class _Row:
    """One answer under way: every token decided (the prompt so far, then the answer), and what the runner read."""

    tokens: list[int]
    prompt_len: int | None  # None while the target writes the request
    shipped: int | None = None  # the shipped prompt's index; None for a written request
    read: int = 0  # tokens the runner holds
    features: list[torch.Tensor] = field(default_factory=list)
    rng: torch.Generator | None = None  # a written request's sampling
    top: Recorded = field(default_factory=Recorded)  # the target's distribution at each answer position, where kept


class IdleAnswers:
    """The target's greedy answers to ``prompts`` (token ids, chat template applied, answered in a fixed shuffled
    order), then, where ``user_turn`` gives the template's opening and closing of a user turn, to requests it writes.

    ``piece`` runs one pass over the answers under way: a chunk of each prompt being read, one token of the others; it
    returns the answers that ended."""

    def __init__(
        self,
        make_runner: Callable[[int, int], ModelRunner],
        prompts: list[list[int]],
        stop_ids: set[int],
        user_turn: tuple[list[int], list[int]] | None = None,
        dtype: torch.dtype = torch.bfloat16,
        max_tokens: int = MAX_TOKENS,
        rows: int = ROWS,
        done: int = 0,
        written: int = 0,
        seed: int = 0,
        slice_seconds: float = SLICE,
        max_requests: int = MAX_REQUESTS,
        top: bool = False,
    ):
        self.prompts = list(prompts)
        random.Random(seed).shuffle(self.prompts)  # a mix of kinds early on, the same order after a restart
        self.stop_ids, self.user_turn, self.dtype, self.max_tokens = stop_ids, user_turn, dtype, max_tokens
        self.max_rows, self.slice_seconds, self.max_requests = rows, slice_seconds, max_requests
        self.seed = seed
        self.top = top  # keep the target's distribution at each answer position (``traffic.Top``)
        self.chunk = 2 * MIN_CHUNK  # prompt tokens a row reads in a pass: small at first (the first pass is eager)
        self.started = done  # shipped prompts started: the next is ``prompts[started]``
        self.written = written  # requests the target began to write (each seeds its own sampling)
        self.answered_written = 0  # ... of them answered since this object was made
        self.positions_read = 0  # tokens the runner has read, every row's, since this object was made
        self.runner: ModelRunner | None = None  # made at the first piece: its cache costs memory
        self.rows: list[_Row] = []  # runner row i holds rows[i]
        self._make_runner = make_runner

    @property
    def done(self) -> int:
        """Shipped prompts answered (or skipped) in order: a restart starts again from ``prompts[done]``."""
        running = [r.shipped for r in self.rows if r.shipped is not None]
        return min(running) if running else self.started

    @done.setter
    def done(self, value: int) -> None:
        if self.rows:
            raise ValueError("answers are under way: where they start from is set before the first piece")
        self.started = value

    @property
    def remaining(self) -> int:
        """Shipped prompts not answered yet."""
        return len(self.prompts) - self.done

    def has_work(self) -> bool:
        """Whether a piece would run: answers under way, shipped prompts left, or requests to write."""
        return bool(self.rows) or self.started < len(self.prompts) or self._may_write()

    def _may_write(self) -> bool:
        return self.user_turn is not None and self.written < self.max_requests

    @torch.inference_mode()
    def piece(self) -> list[Answer]:
        """One pass over the answers under way, new ones started in free rows first; the answers it ended, too-short
        ones left out."""
        if self.runner is None:
            longest = max(map(len, self.prompts), default=0)
            if self.user_turn is not None:
                longest = max(longest, sum(map(len, self.user_turn)) + MAX_WRITTEN)
            self.runner = self._make_runner(self.max_rows, longest + self.max_tokens)
        while len(self.rows) < self.max_rows and (row := self._start()) is not None:
            self.runner.set_length(len(self.rows), 0)
            self.rows.append(row)
        if not self.rows:
            return []
        t0 = time.perf_counter()
        inputs = [row.tokens[row.read : row.read + self.chunk] for row in self.rows]
        scores = self.runner.score(0, inputs, last_only=True)
        self.positions_read += sum(map(len, inputs))
        features = scores.features.to(device="cpu", dtype=self.dtype).split([len(x) for x in inputs])
        choices = scores.argmax()  # a greedy token per row: one host sync for the pass
        writing = any(row.prompt_len is None for row in self.rows)
        # every row's in one product, where any row samples or answers keep the target's distribution
        logits = scores.logits() if writing or self.top else None
        ended: list[int] = []
        answering: list[int] = []  # rows whose next answer token this pass chose
        for i, row in enumerate(self.rows):
            row.features.append(features[i])
            row.read += len(inputs[i])
            if row.read < len(row.tokens):
                continue  # the prompt goes on in the next pass
            if row.prompt_len is None:
                self._write(row, logits[i])
                continue
            if self.top:
                answering.append(i)
            if self._answer(row, choices[i]):
                ended.append(i)
        if answering:  # every answering row's distribution in one top-k
            kept = Recorded()
            keep_top(kept, logits[answering])
            for j, i in enumerate(answering):
                self.rows[i].top.top_ids.append(kept.top_ids[0][j : j + 1])
                self.rows[i].top.top_logp.append(kept.top_logp[0][j : j + 1])
        if any(len(x) > 1 for x in inputs):  # only a pass that read prompts says what a chunk costs
            took = time.perf_counter() - t0
            if took > self.slice_seconds:
                self.chunk = max(MIN_CHUNK, self.chunk // 2)
            elif took < self.slice_seconds / 2:
                self.chunk = min(MAX_CHUNK, self.chunk * 2)
        return self._end(ended)

    def release(self) -> None:
        """Nothing answers here again: the runner's compiled pass goes back for a later load (its weights are the
        target's, which its own runner releases)."""
        if self.runner is not None and self.runner.fast_pass is not None:
            self.runner.fast_pass.release()
        self.runner = None  # (the rows stay: ``done`` still counts the prompts they were answering as not done)

    def _start(self) -> _Row | None:
        if self.started < len(self.prompts):
            prompt = self.prompts[self.started]
            self.started += 1
            return _Row(list(prompt), len(prompt), shipped=self.started - 1)
        if not self._may_write():
            return None
        self.written += 1
        rng = torch.Generator().manual_seed(self.seed * 1_000_003 + self.written)
        return _Row(list(self.user_turn[0]), None, rng=rng)

    def _write(self, row: _Row, logits: torch.Tensor) -> None:
        """The request's next token, sampled; at a stop token (or ``MAX_WRITTEN``) the template closes the turn and
        the answer begins."""
        probs = torch.softmax(logits.float().cpu() / WRITE_TEMPERATURE, dim=-1)  # the row's generator is a CPU one
        token = int(torch.multinomial(probs, 1, generator=row.rng))
        written = len(row.tokens) - len(self.user_turn[0])
        if token in self.stop_ids or written + 1 >= MAX_WRITTEN:
            row.tokens += self.user_turn[1]
            row.prompt_len = len(row.tokens)
        else:
            row.tokens.append(token)

    def _answer(self, row: _Row, token: int) -> bool:
        """The answer's next token, greedy; whether the answer ended."""
        row.tokens.append(token)
        return token in self.stop_ids or len(row.tokens) - row.prompt_len >= self.max_tokens

    def _end(self, ended: list[int]) -> list[Answer]:
        """The ended rows' answers; the rows after them move up so that the rows under way stay 0..n-1."""
        out = []
        for i in ended:
            row = self.rows[i]
            if row.shipped is None:
                self.answered_written += 1
            if len(row.tokens) - row.prompt_len >= MIN_ANSWER and (row.shipped is not None or self._written_ok(row)):
                features = torch.cat(row.features)[: len(row.tokens) - 1]
                top = _top(row)
                tokens = torch.tensor(row.tokens, dtype=torch.int32)
                out.append(Answer(tokens, features, row.prompt_len, idle=True, top=top))
        kept = [(i, row) for i, row in enumerate(self.rows) if i not in ended]
        for dst, (src, _) in enumerate(kept):  # src >= dst, and every later src > dst: nothing is overwritten unread
            if src != dst:
                self.runner.move_row(src, dst)
        self.rows = [row for _, row in kept]
        return out

    def _written_ok(self, row: _Row) -> bool:
        """A written request with some text in it (a turn closed at once teaches only the template)."""
        return row.prompt_len - sum(map(len, self.user_turn)) >= MIN_ANSWER


def _top(row: _Row) -> Top | None:
    """The target's distribution at each of the row's answer positions (from the prompt's last), where kept."""
    if not row.top.top_ids:
        return None
    return Top(torch.cat(row.top.top_ids), torch.cat(row.top.top_logp), row.prompt_len - 1)


def user_turn(tokenizer, tokens: Callable[[str], list[int]]) -> tuple[list[int], list[int]] | None:
    """The chat template's text before a user's request and after it (to the assistant's answer), as tokens; None
    where the template does not put the request's text in as given."""
    mark = "\u2063depctl-request\u2063"  # invisible separators: no template rewrites them
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": mark}], add_generation_prompt=True, tokenize=False
    )
    if text.count(mark) != 1:
        return None
    opening, closing = text.split(mark)
    return tokens(opening), tokens(closing)
