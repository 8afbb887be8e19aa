"""Continuous batching over one engine: which sequences run this step, and when prompts are prefilled.

- Requests wait in arrival order (FIFO) until a row is free (at most ``max_batch_size`` run at once).
- The head of the queue is prefilled into the next free row in chunks of ``prefill_chunk`` tokens, before the
  running batch's step. A prompt is cut in the same places whatever the load: the cache a chunk leaves depends on
  where it was cut (the chunks' products round differently), so a request's output cannot depend on when it arrived.
  With nothing running, every chunk is read in the same iteration. While streams run, an iteration gives prompts
  about ``prefill_share`` times the batch step's own time: a chunk's pass runs a few parts of layers (an attention,
  an MLP), stops between two, and goes on in the next iteration (``engine.prefill`` with ``more``), so a running
  stream's gap between tokens grows by that share, not by a whole chunk (a 128-token chunk of a long prompt is tens
  of decode steps' time on a CPU); what one prompt leaves of the share goes to the next waiting one. While more
  requests wait than run (a burst at an idle deployment), the share is at least ``prefill_floor`` seconds. Stopping
  between parts changes no bits; cutting the chunk smaller would. A separate pass rather than the chunk mixed into the
  batch's stream: a batch whose rows are equally wide (every plain step) runs attention as one batched call, a ragged
  one as a call per row (``model.attention``), and a chunk would make every step ragged. The last chunk's logits give
  the request its first token, and the request joins the batch in the same iteration's step.
- With the prefix cache on, idle time reads the last few finished requests' answers into it (``idle``), as a later
  prompt's chunks would read them: a conversation's next turn then reads only what follows the answer. A request that
  arrives takes the row back at once.
- A finished or cancelled request leaves at once; the last running row moves into its place, so the batch is
  always rows 0..B-1 of every cache and a pass never touches an idle row.

The scheduler is not thread-safe: one thread owns it and its engine (see ``depctl_runtime.backends.worker``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Iterator, Protocol
from typing import Sequence as Seq

from depctl_runtime.speculation.faults import RowFault
from depctl_runtime.speculation.params import GenerationParams
from depctl_runtime.speculation.sequence import Sequence, StepOutput

PREFILL_CHUNK = 128  # tokens per prefill pass: where prompts are cut, and the prefix cache's block
ANSWERS_KEPT = 8  # finished requests whose answers idle time reads into the prefix cache, the latest first
IDLE_SLICE = 0.05  # seconds of idle work between looks at the inbox: what a new request may wait for it
PREFILL_SHARE = 1.0  # prompt work per iteration while streams run, in batch steps' time: their token gaps at most ~2x
# prompt work per iteration, in seconds, while more requests wait than run: a burst at an idle deployment otherwise
# reads its prompts beside a batch of a row or two, whose steps' share is a few milliseconds, and most of the burst
# waits for its first token while the rest of the time goes to those few rows' steps
PREFILL_FLOOR = 0.05
NARROWEST_CHUNK = 16  # a prompt read beside streams narrows its chunks down to this while one part outlasts a step


class Background(Protocol):
    """Work for a deployment's idle time, done in slices short enough that a request arriving waits for one at
    most (``online.HeadLearner``)."""

    def has_work(self) -> bool: ...

    def work(self) -> None: ...


class Scheduler:
    def __init__(
        self,
        engine,
        max_batch_size: int,
        prefill_chunk: int = PREFILL_CHUNK,
        prefill_share: float = PREFILL_SHARE,
        prefill_floor: float = PREFILL_FLOOR,
        narrowest_chunk: int = NARROWEST_CHUNK,
        background: Background | None = None,
    ):
        if not 1 <= max_batch_size <= engine.max_rows:
            raise ValueError(f"max_batch_size must be in 1..{engine.max_rows} (the engine's cache rows)")
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.prefill_chunk = prefill_chunk
        self.prefill_share = prefill_share
        self.prefill_floor = prefill_floor
        # the chunk a prompt read beside running streams is cut into: narrower while a part of a layer (at a long
        # context, one layer's attention) takes longer than the iteration's share, where the engine's cuts are exact
        self.width, self.narrowest_chunk = prefill_chunk, narrowest_chunk
        self.step_seconds = 0.0  # the running batch's last step, the measure of an iteration's prompt work
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # running[b].row == b
        self.prefilling: Sequence | None = None  # row len(running) while its prompt is read
        self._cancelled: set[int] = set()
        self.answers: deque[Sequence] = deque(maxlen=ANSWERS_KEPT)  # for ``idle``, the latest first
        self.background = background  # idle work after the answers (a learning head's training)

    @property
    def num_running(self) -> int:
        return len(self.running) + (self.prefilling is not None)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.prefilling)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def cancel(self, seq: Sequence) -> None:
        """The client went away: the sequence leaves at the start of the next iteration."""
        self._cancelled.add(seq.id)

    def step(self) -> list[tuple[Sequence, StepOutput]]:
        """One iteration: drop cancelled requests, admit the head of the queue and read its prompt (every chunk when
        nothing else runs, else for the iteration's share, prompt after prompt; a prompt read to its end joins the
        batch), then step the running batch.
        Returns each sequence's new output (a sequence whose output carries a finish_reason has left)."""
        out: list[tuple[Sequence, StepOutput]] = []
        if self._cancelled:
            self._drop_cancelled(out)
        # before the step, so a short prompt's first token does not wait a step
        if self.running:  # a share of a step's time, stopping between parts of layers
            more = _Share(self._prompt_seconds())
            # the share is the iteration's: a prompt read before it is spent (a short one, or one whose blocks came
            # from the prefix cache) leaves the rest to its next chunk or the next prompt. One prompt an iteration
            # capped admissions below the rate at which short answers left a busy batch: at 32 clients its rows sat
            # at 16-31, the other clients waiting in the queue
            while self._admit() and more.fits():
                self._joined(self.engine.prefill(self.prefilling, self.width, more=more), out)
            self._narrow(more)
        elif self._admit():  # idle: every chunk now, cut where a busy deployment cuts
            o = None
            while o is None:
                o = self.engine.prefill(self.prefilling, self.prefill_chunk)
            self._joined(o, out)
        if self.running:
            t0 = time.perf_counter()
            outputs = self.engine.step(self.running)
            self.step_seconds = time.perf_counter() - t0
            for seq, o in zip(list(self.running), outputs):
                out.append((seq, o))
                if o.finish_reason:
                    self._leave(seq)
        return out

    def _prompt_seconds(self) -> float:
        """The iteration's time for prompts beside running streams: a share of the batch's step, and at least
        ``prefill_floor`` while more requests wait than run (the streams' gaps then grow by that much at most)."""
        share = self.prefill_share * self.step_seconds
        if len(self.waiting) + (self.prefilling is not None) > len(self.running):
            share = max(share, self.prefill_floor)
        return share

    def _admit(self) -> bool:
        """Whether a prompt is being read: the one half read, else the head of the queue, given the next row."""
        if self.prefilling is None and self.waiting and len(self.running) < self.max_batch_size:
            self.prefilling = self.waiting.popleft()
            self.prefilling.row = len(self.running)
        return self.prefilling is not None

    def _joined(self, o: StepOutput | None, out: list) -> None:
        """A prefill call's outcome: once the prompt is read (``o``, its first token), the sequence joins the batch,
        or leaves at once where that token ended it."""
        if o is None:
            return
        seq, self.prefilling = self.prefilling, None
        out.append((seq, o))
        if o.finish_reason:
            self._release(seq)
        else:
            self.running.append(seq)

    def has_idle_work(self) -> bool:
        return bool(self.answers) or (self.background is not None and self.background.has_work())

    def idle(self, seconds: float = IDLE_SLICE) -> None:
        """With no request to serve: about ``seconds`` of reading the latest finished answer into the prefix cache
        (``engine.keep_answer``), stopping between parts of layers; the next request takes row 0 back. Then the
        background's own slice."""
        if self.has_work():
            return
        if self.answers:
            if self.engine.keep_answer(self.answers[0], more=_Share(seconds)):
                self.answers.popleft()
        elif self.background is not None:
            self.background.work()

    def _narrow(self, share: "_Share") -> None:
        """The next chunk's width beside running streams: half while a part outlasted the share, double (up to a
        whole chunk) while parts take under a quarter of it. Only where any cut gives the same bits."""
        if not self.engine.cuts_exact or share.parts == 0:
            return
        if share.longest > share.seconds and self.width > self.narrowest_chunk:
            self.width //= 2
        elif share.longest < share.seconds / 4 and self.width < self.prefill_chunk:
            self.width *= 2

    def abandon(self) -> list[Sequence]:
        """After a step whose shared work failed (the target's pass, a draft model's forward: not one row's part):
        the sequences it ran end with an engine fault and every row is freed; the waiting ones stay queued."""
        ended = self.running + ([self.prefilling] if self.prefilling is not None else [])
        self.running, self.prefilling = [], None
        for row in range(self.engine.max_rows):
            self.engine.release_row(row)
        for seq in ended:
            seq.row, seq.fault, seq.finish_reason = -1, RowFault.engine(), "error"
            self.engine.finish(seq)  # the proposer, the policy and the observer let go of it
        return ended

    def _drop_cancelled(self, out) -> None:
        for seq in [s for s in self.running if s.id in self._cancelled]:
            self._leave(seq)
            out.append((seq, StepOutput([], "cancelled")))
        if self.prefilling is not None and self.prefilling.id in self._cancelled:
            seq, self.prefilling = self.prefilling, None
            self._release(seq)
            out.append((seq, StepOutput([], "cancelled")))
        for seq in [s for s in self.waiting if s.id in self._cancelled]:
            self.waiting.remove(seq)
            out.append((seq, StepOutput([], "cancelled")))
        self._cancelled.clear()

    def _leave(self, seq: Sequence) -> None:
        """Take a running sequence out, keeping the batch in rows 0..B-1 (and a prefilling one right after)."""
        i, last = self.running.index(seq), len(self.running) - 1
        if i != last:
            moved = self.running[last]
            self.engine.move_row(last, i)
            moved.row, self.running[i] = i, moved
        self.running.pop()
        self._release(seq, row=last)
        if self.prefilling is not None:
            self.engine.move_row(self.prefilling.row, last)
            self.prefilling.row = last

    def _release(self, seq: Sequence, row: int | None = None) -> None:
        self.engine.release_row(seq.row if row is None else row)
        seq.row = -1
        if seq.finish_reason is None:
            seq.finish_reason = "cancelled"
        self.engine.finish(seq)
        if self.engine.prefix is not None and seq.finish_reason in ("stop", "length") and seq.produced:
            self.answers.appendleft(seq)

    # ---- run to the end in the calling thread (tests, benchmarks) ----
    def run_all(self, prompts: list[Seq[int]], params: GenerationParams) -> list[list[int]]:
        """Submit every prompt at once and step until all finish; each prompt's output tokens, in order."""
        seqs = [self.engine.new_sequence(p, params) for p in prompts]
        got: dict[int, list[int]] = {s.id: [] for s in seqs}
        for s in seqs:
            self.add(s)
        while self.has_work():
            for s, o in self.step():
                got[s.id] += o.token_ids
        return [got[s.id] for s in seqs]

    def generate(
        self, prompt_ids: Seq[int], params: GenerationParams, cancel: threading.Event | None = None
    ) -> Iterator[StepOutput]:
        seq = self.engine.new_sequence(prompt_ids, params)
        self.add(seq)
        try:
            while self.has_work():
                if cancel is not None and cancel.is_set():
                    self.cancel(seq)
                for s, o in self.step():
                    if s is seq:
                        yield o
                        if o.finish_reason:
                            return
        finally:
            if seq.finish_reason is None:  # the caller stopped early: free the row
                self.cancel(seq)
                self._drop_cancelled([])


def generate(
    engine, prompt_ids: Seq[int], params: GenerationParams, cancel: threading.Event | None = None
) -> Iterator[StepOutput]:
    """One request on its own, stepped in the calling thread (tests, benchmarks)."""
    yield from Scheduler(engine, max_batch_size=1).generate(prompt_ids, params, cancel)


class _Share:
    """``more`` for a prompt pass: another part of a layer only if one more of the parts' mean time still fits in
    ``seconds``; it keeps the longest part seen."""

    def __init__(self, seconds: float):
        self.seconds, self.parts, self.longest = seconds, 0, 0.0
        self._start = self._last = time.perf_counter()

    def __call__(self) -> bool:
        now = time.perf_counter()
        self.parts += 1
        self.longest = max(self.longest, now - self._last)
        self._last = now
        return self.fits()

    def fits(self) -> bool:
        """Whether one more part still fits, at the mean time of the parts run so far (the first always does)."""
        spent = time.perf_counter() - self._start
        return self.parts == 0 or spent + spent / self.parts <= self.seconds
