"""What ends one request and not the batch it runs in."""

from __future__ import annotations

import logging

from depctl_runtime.speculation.grammar import GrammarError

log = logging.getLogger("depctl.engine")


class RowFault(Exception):
    """A failure in one request's own part of a step (its grammar, its proposer's guess, its sampling): it ends that
    request alone, and the batch goes on. ``message`` is what the request's sender is told: short, and never another
    request's text, grammar or a parser's state; ``status`` and ``code`` are the HTTP status and API error code."""

    def __init__(self, part: str, message: str, status: int, code: str):
        super().__init__(message)
        self.part, self.message, self.status, self.code = part, message, status, code

    @classmethod
    def of(cls, part: str, exc: BaseException) -> RowFault:
        """The fault a row's ``part`` ("grammar", "proposer", "sampling") raised as ``exc``: a grammar's own error is
        the request's (400, its first line: the matcher's state dump after it is not the sender's business); anything
        else is depctl's, told generically (500; the daemon log has the traceback)."""
        if isinstance(exc, RowFault):
            return exc
        if isinstance(exc, GrammarError):
            problem = (str(exc).strip().splitlines() or ["failed"])[0][:200]
            return cls("grammar", f"the request's grammar failed while generating: {problem}", 400, "invalid_grammar")
        return cls(
            part,
            f"depctl's {part} step failed for this request, which was ended; the rest of the batch ran on "
            "(a fault in depctl: the daemon log has the details)",
            500,
            f"{part}_error",
        )

    @classmethod
    def engine(cls) -> RowFault:
        """For every request of a step whose shared work (the target's pass, a draft model's forward) failed."""
        return cls(
            "engine",
            "the engine failed while running this request's batch, which was ended (a fault in depctl, not in the "
            "request: the daemon log has the details); retry it",
            500,
            "engine_error",
        )


def record_fault(seq, part: str, exc: BaseException) -> RowFault:
    """Mark ``seq`` (a ``Sequence``) as ended by ``exc``, raised in its ``part``; log it with the request's id (a
    fault of depctl's with its traceback, the request's own grammar in a line)."""
    seq.fault = RowFault.of(part, exc)
    if seq.fault.part == "grammar":
        log.info("request %s: %s", seq.id, seq.fault.message)
    else:
        log.error("request %s: its %s failed; it ends alone", seq.id, part, exc_info=exc)
    return seq.fault
