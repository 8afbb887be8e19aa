"""Speculation counters, named after vLLM's ``spec_decode_*`` metrics.

- ``num_drafts``: rows x steps that verified at least one draft token
- ``num_draft_tokens``: draft tokens verified
- ``num_accepted_tokens``: draft tokens accepted
- ``accepted_per_position[i]``: drafts whose token at position i (0-based) was accepted
- ``drafted_per_position[i]``: drafts that had a token at position i; their ratio is the acceptance at position i
  (the first i + 1 tokens accepted), which for a draft head is what its training reports as held-out acceptance
- ``num_grammar_draft_tokens`` / ``num_grammar_accepted_tokens``: of those, tokens a grammar forced (counted apart
  from the proposer's); ``grammar_seconds``: time in grammar matchers (masks, checks, advancing)
- ``num_model_drafts`` / ``num_model_draft_tokens`` / ``num_model_accepted_tokens``: of those, drafts from a draft
  model or head (beside an n-gram or suffix index, a learning head's own, apart from the index's copies)
- ``num_row_faults``: requests ended alone by a fault in their own grammar, guess or sampling
- acceptance rate = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts (the 1 is the
  recovered-or-bonus token every verified step adds)
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_steps: int = 0  # target forward passes after prefill, drafted or not
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_generated_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    prefill_seconds: float = 0.0
    num_requests: int = 0
    num_grammar_draft_tokens: int = 0
    num_grammar_accepted_tokens: int = 0
    grammar_seconds: float = 0.0
    num_model_drafts: int = 0
    num_model_draft_tokens: int = 0
    num_model_accepted_tokens: int = 0
    num_row_faults: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record_row(self, drafted: int, accepted: int, emitted: int) -> None:
        """One sequence's part of a step (or its first token, from the prefill)."""
        with self._lock:
            self.num_generated_tokens += emitted
            if drafted:
                self.num_drafts += 1
                self.num_draft_tokens += drafted
                self.num_accepted_tokens += accepted
                for counts in (self.accepted_per_position, self.drafted_per_position):
                    if len(counts) < drafted:
                        counts.extend([0] * (drafted - len(counts)))
                for i in range(drafted):
                    self.drafted_per_position[i] += 1
                for i in range(accepted):
                    self.accepted_per_position[i] += 1

    def record_model(self, drafted: int, accepted: int) -> None:
        """A row's drafts this step came from the draft model or head (counted in ``record_row`` too)."""
        with self._lock:
            self.num_model_drafts += 1
            self.num_model_draft_tokens += drafted
            self.num_model_accepted_tokens += accepted

    def record_grammar(self, drafted: int, accepted: int, seconds: float) -> None:
        with self._lock:
            self.num_grammar_draft_tokens += drafted
            self.num_grammar_accepted_tokens += accepted
            self.grammar_seconds += seconds

    def record_step(self, draft_s: float, verify_s: float) -> None:
        """One batch step's time (a target pass, and the draft model's forwards)."""
        with self._lock:
            self.num_steps += 1
            self.draft_seconds += draft_s
            self.verify_seconds += verify_s

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def decode_seconds(self) -> float:
        return self.draft_seconds + self.verify_seconds

    @property
    def tokens_per_second(self) -> float | None:
        return self.num_generated_tokens / self.decode_seconds if self.decode_seconds > 0 else None

    def to_dict(self) -> dict:
        return {
            "requests": self.num_requests,
            "steps": self.num_steps,
            "generated_tokens": self.num_generated_tokens,
            "drafts": self.num_drafts,
            "draft_tokens": self.num_draft_tokens,
            "accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "drafted_per_position": list(self.drafted_per_position),
            "acceptance_per_position": [
                round(a / d, 4) if d else None for a, d in zip(self.accepted_per_position, self.drafted_per_position)
            ],
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_seconds": round(self.draft_seconds, 4),
            "verify_seconds": round(self.verify_seconds, 4),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "grammar_draft_tokens": self.num_grammar_draft_tokens,
            "grammar_accepted_tokens": self.num_grammar_accepted_tokens,
            "grammar_seconds": round(self.grammar_seconds, 4),
            "model_drafts": self.num_model_drafts,
            "model_draft_tokens": self.num_model_draft_tokens,
            "model_accepted_tokens": self.num_model_accepted_tokens,
            "row_faults": self.num_row_faults,
            "decode_tokens_per_second": self.tokens_per_second,
        }
