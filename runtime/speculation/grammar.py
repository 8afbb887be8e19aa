"""Structured output: a request's grammar, compiled once, and each running row's place in it (llguidance).

- ``GrammarCompiler``: built once per deployment from its tokenizer (llguidance's table of every token's bytes);
  ``compile`` turns a grammar (from a JSON schema, a regex or Lark) into a ``Grammar``, or raises ``GrammarError``
  naming what is wrong. Compiling takes milliseconds, so it runs where requests are built, never on the engine thread.
- ``Grammar``: compiled and never advanced; each request that uses it starts its own ``RowGrammar`` from a copy.
- ``RowGrammar``: one row's matcher state, owned by its ``Sequence`` and touched only on the engine thread. The engine
  cuts drafts at the first token it forbids, drafts the tokens it forces, and asks for the allowed set at each
  verified position (advancing through the drafts and rolling back to the accepted length).

Once the grammar is complete the matcher allows only end-of-sequence tokens, so a row's mask is never empty.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np
import torch

from depctl_runtime.speculation.json_schema import ANY_OBJECT, JSON_OPTIONS, cap_numbers


class GrammarError(ValueError):
    """A grammar that does not compile: the message says where."""


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        """tokenizer: the deployment's (fast) transformers tokenizer; vocab_size: the width of the logits"""
        import llguidance.hf

        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None
        )
        # special tokens whose text a grammar's literal matches can be set in a mask that the matcher then refuses
        # to take (it wants the bytes spelled out): they are checked one by one whenever a mask allows them
        # (end tokens excepted: the mask allows them exactly when the grammar may end)
        ends = set(eos_token_ids)
        self.end_ids = np.array(sorted(ends), dtype=np.int64)
        self.special_ids = np.array(
            [t for t in range(vocab_size) if t not in ends and self.tokenizer.is_special_token(t)], dtype=np.int64
        )

    @staticmethod
    def from_json_schema(schema: dict | bool | None) -> str:
        """A grammar for JSON that matches ``schema`` (None: any JSON object), its numbers' digits capped."""
        from llguidance import LLMatcher

        return LLMatcher.grammar_from_json_schema(
            cap_numbers(ANY_OBJECT if schema is None else schema), defaults=JSON_OPTIONS
        )

    @staticmethod
    def from_regex(pattern: str) -> str:
        from llguidance import LLMatcher

        return LLMatcher.grammar_from_regex(pattern)

    @staticmethod
    def from_lark(lark: str) -> str:
        from llguidance import LLMatcher

        return LLMatcher.grammar_from_lark(lark)

    def compile(self, grammar: str) -> Grammar:
        """Compile and compute the first mask: the lexer builds its automaton lazily, so a grammar it gives up on
        ("too many expressions constructed") compiles and fails only at its first token. That happens here, where
        requests are built, rather than on the engine thread."""
        from llguidance import LLMatcher

        try:
            matcher = LLMatcher(self.tokenizer, grammar, log_level=0, limits=_limits())
            if matcher.is_error():
                raise GrammarError(_error(matcher))
            probe = RowGrammar(matcher.deep_copy(), self.vocab_size, self.special_ids, self.end_ids)
            probe.allowed()  # (not the forced tokens: computing them holds the GIL, see RowGrammar.forced)
            # copies share the lexer's automaton and its limits: a grammar whose first mask used them all up fails
            # in the next row that starts from it
            RowGrammar(matcher.deep_copy(), self.vocab_size, self.special_ids, self.end_ids).allowed()
        except GrammarError as exc:
            if str(exc).startswith("NoExtension"):  # stopped before its first byte: nothing can match it
                raise GrammarError("no output can match it: its language is empty") from None
            raise
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # llguidance's own errors, and a panic in it (pyo3's is a BaseException)
            raise GrammarError(f"the grammar engine failed on it ({type(exc).__name__})") from None
        return Grammar(matcher, self.vocab_size, self.special_ids, self.end_ids)

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for (a byte-level token may hold part of a character)."""
        return self.tokenizer.decode_bytes([token])


def _error(matcher) -> str:
    return matcher.get_error().replace("<non-verbose/>", "").strip()


def _limits():
    from llguidance import LLParserLimits

    # verbose_errors off: an error then names the problem without the parser's state and the grammar's text
    return LLParserLimits(verbose_errors=False)


FORCED_BUDGET = 0.01  # seconds one forced run may take before a row stops asking for them


class Grammar:
    """A compiled grammar. Shared by every row that uses it; never advanced itself."""

    def __init__(self, matcher, vocab_size: int, special_ids: np.ndarray, end_ids: np.ndarray):
        self._prototype = matcher
        self.vocab_size = vocab_size
        self.special_ids, self.end_ids = special_ids, end_ids

    def start(self) -> RowGrammar:
        return RowGrammar(self._prototype.deep_copy(), self.vocab_size, self.special_ids, self.end_ids)


class RowGrammar:
    """One row's matcher. ``seconds`` totals the time spent in it (masks, checks, advancing)."""

    def __init__(self, matcher, vocab_size: int, special_ids: np.ndarray, end_ids: np.ndarray):
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._special_ids, self._end_ids = special_ids, end_ids  # [n], [e]
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.uint32)  # [words]: one bit per token
        self.seconds = 0.0
        self._taken: list[int] = []  # the tokens the matcher holds, drafts it is advanced through included
        # the last forced run computed and where it began in _taken: while the row takes its tokens, the rest of the
        # run is what is forced next. A grammar can force a long literal, and computing the run costs time in
        # proportion to its length: computed once per run, not once per step. (Forced tokens are only drafts: the
        # target and the masks decide what is emitted.)
        self._forced_from: int | None = None
        self._forced_run: list[int] = []
        self._forced_off = False

    def forced(self, limit: int) -> list[int]:
        """The tokens the grammar forces from here (a key, a closing quote): drafts that cost no proposer."""
        if limit <= 0:
            return []
        at = self._forced_from
        if at is not None and len(self._taken) >= at:
            taken = self._taken[at:]
            rest = self._forced_run[len(taken) :]
            if rest and self._forced_run[: len(taken)] == taken:
                return rest[:limit]
        if self._forced_off:
            return []
        t0 = time.perf_counter()
        run = self._matcher.compute_ff_tokens()
        took = time.perf_counter() - t0
        self.seconds += took
        self._check()
        self._forced_from, self._forced_run = len(self._taken), run
        # llguidance computes the whole run, holding the GIL, at ~0.17 s per 100k forced bytes: a grammar that forces
        # a long literal ("a{100000}") drafts no forced tokens after its first slow run (which still stalls the
        # engine thread once)
        self._forced_off = took > FORCED_BUDGET
        return run[:limit]

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` the grammar allows in a row from here (nothing after an end-of-sequence token)."""
        if not tokens:
            return 0
        t0 = time.perf_counter()
        n = self._matcher.validate_tokens(list(tokens))
        self.seconds += time.perf_counter() - t0
        self._check()
        return n

    def allows(self, token: int) -> bool:
        return self.valid_prefix([token]) == 1

    def allowed(self) -> torch.Tensor:
        """[vocab] bool: the tokens allowed next. (numpy, not torch: this may run on the mask thread during a pass,
        where a torch op would start a second OpenMP pool beside the pass's.)"""
        return torch.from_numpy(self._allowed())

    def _allowed(self) -> np.ndarray:
        t0 = time.perf_counter()
        bits = self._bits
        self._matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        self._check()  # a matcher that failed leaves an empty mask, which must not read as "the grammar may end"
        mask = np.unpackbits(bits.view(np.uint8), bitorder="little")[: self.vocab_size].view(bool)
        for token in self._special_ids[mask[self._special_ids]].tolist():
            if self._matcher.validate_tokens([token]) != 1:
                mask[token] = False
        if not mask.any():  # a grammar no token can continue: end the row rather than sample from nothing
            mask[self._end_ids] = True
        self.seconds += time.perf_counter() - t0
        return mask

    def advance(self, tokens: Sequence[int]) -> None:
        """Take ``tokens`` (the engine cuts them at the first end-of-sequence token, so they are all allowed)."""
        if not tokens:
            return
        t0 = time.perf_counter()
        ok = self._matcher.consume_tokens(list(tokens))
        self.seconds += time.perf_counter() - t0
        self._taken.extend(tokens)
        if not ok:
            raise GrammarError(f"the grammar refused tokens {list(tokens)}: {_error(self._matcher)}")

    def _check(self) -> None:
        """A matcher that failed (its lexer gave up, say) stays failed: every later answer of it is meaningless."""
        if self._matcher.is_error():
            raise GrammarError(_error(self._matcher))

    def rollback(self, n: int) -> None:
        if n:
            self._matcher.rollback(n)
            del self._taken[-n:]

    def masks(self, drafts: Sequence[int]) -> torch.Tensor:
        """[k + 1, vocab] bool: the allowed tokens at each verified position, the one after the last accepted token and
        the one after each draft (the matcher is advanced through the drafts and rolled back)."""
        masks = [self._allowed()]
        taken = 0
        for token in drafts:
            if self.complete:  # the token is an end token: the row ends at it, whatever follows
                masks.append(masks[-1])
                continue
            self.advance([token])
            taken += 1
            masks.append(self._allowed())
        self.rollback(taken)
        return torch.from_numpy(np.stack(masks))

    def take_seconds(self) -> float:
        """The time spent in the matcher since the last call."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    @property
    def complete(self) -> bool:
        """Nothing may follow but an end-of-sequence token."""
        return self._matcher.is_stopped()
