"""What a deployment is doing now: throughput and acceptance over the last seconds, from its backend's counters.

The manager samples every deployment's ``Counters`` once a second (``SAMPLE_SECONDS``); rates are differences
between samples, so they describe the recent past (``depctl ps``, ``depctl top``, the periodic log line), never a
lifetime average that a quiet hour drags down.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from depctl_runtime.backends.base import Counters

SAMPLE_SECONDS = 1.0
HORIZON = 120  # samples kept: two minutes of history for sparklines
RATE_WINDOW = 10.0  # tok/s over the last 10 s, as vLLM and llama.cpp log it
ACCEPTANCE_WINDOW = 60.0  # acceptance needs more drafts than 10 s may hold to mean anything


@dataclass(frozen=True)
class Sample:
    at: float  # time.monotonic()
    generated: int
    draft_tokens: int
    accepted: int
    running: int
    waiting: int


class Meter:
    def __init__(self) -> None:
        self._samples: deque[Sample] = deque(maxlen=HORIZON + 1)
        self._lock = threading.Lock()  # the sampling thread writes, status readers read

    def sample(self, counters: Counters, at: float) -> None:
        s = Sample(
            at,
            counters.generated_tokens,
            counters.draft_tokens,
            counters.accepted_tokens,
            counters.running or 0,
            counters.waiting or 0,
        )
        with self._lock:
            if self._samples and s.generated < self._samples[-1].generated:  # a new engine (a reload): start over
                self._samples.clear()
            self._samples.append(s)

    def _span(self, window: float) -> tuple[Sample, Sample] | None:
        """The oldest sample within ``window`` seconds of the newest, and the newest."""
        with self._lock:
            if len(self._samples) < 2:
                return None
            last = self._samples[-1]
            first = next(s for s in self._samples if last.at - s.at <= window + SAMPLE_SECONDS / 2)
        return (first, last) if last.at > first.at else None

    def tokens_per_second(self, window: float = RATE_WINDOW) -> float | None:
        span = self._span(window)
        return None if span is None else (span[1].generated - span[0].generated) / (span[1].at - span[0].at)

    def acceptance_rate(self, window: float = ACCEPTANCE_WINDOW) -> float | None:
        span = self._span(window)
        drafted = span and span[1].draft_tokens - span[0].draft_tokens
        return None if not drafted else (span[1].accepted - span[0].accepted) / drafted

    def series(self, seconds: int = 60) -> dict:
        """Per-second tok/s and acceptance (None where nothing was drafted) for the last ``seconds`` seconds."""
        with self._lock:
            samples = list(self._samples)[-(seconds + 1) :]
        pairs = list(zip(samples, samples[1:]))
        rates = [round((b.generated - a.generated) / (b.at - a.at), 2) for a, b in pairs]
        acceptance = [
            round((b.accepted - a.accepted) / (b.draft_tokens - a.draft_tokens), 3)
            if b.draft_tokens > a.draft_tokens
            else None
            for a, b in pairs
        ]
        return {"tokens_per_second": rates, "acceptance_rate": acceptance}

    def snapshot(self) -> dict:
        rate, acceptance = self.tokens_per_second(), self.acceptance_rate()
        return {
            "tokens_per_second": None if rate is None else round(rate, 2),
            "acceptance_rate": None if acceptance is None else round(acceptance, 4),
            "window_seconds": RATE_WINDOW,
            "acceptance_window_seconds": ACCEPTANCE_WINDOW,
            "series": self.series(),
        }

    def queue(self) -> tuple[int, int]:
        """Requests running and waiting at the last sample."""
        with self._lock:
            last = self._samples[-1] if self._samples else None
        return (last.running, last.waiting) if last else (0, 0)

    def active(self, window: float = RATE_WINDOW) -> bool:
        """Anything generated, running or waiting in the window: worth a log line."""
        span = self._span(window)
        return span is not None and (
            span[1].generated > span[0].generated or span[1].running > 0 or span[1].waiting > 0
        )
