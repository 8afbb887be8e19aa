"""Typed errors, each with a one-line message and an optional hint naming the next command.

The CLI maps every ``DepctlError`` to ``Error: <message>`` (+ ``Hint: <hint>``) on stderr and a non-zero exit;
anything else is a bug and prints a traceback only with ``DEPCTL_DEBUG=1``.
"""

from __future__ import annotations


def first_line(exc: BaseException | str, limit: int = 400) -> str:
    """An exception as one line for a status, a log or an error message: ``Type: first line``, cut at ``limit``."""
    text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}".strip()
    line = (text.strip().splitlines() or [""])[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."


class DepctlError(Exception):
    exit_code = 1

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint


class UsageError(DepctlError):
    """Bad flags or arguments; nothing was written."""

    exit_code = 2


class SpecError(DepctlError):
    """A spec file on disk could not be read or does not validate."""


class NotFoundError(DepctlError):
    exit_code = 3


class ConflictError(DepctlError):
    exit_code = 4


class ModelResolutionError(DepctlError):
    """A model reference is neither a local directory, a .gguf file, a packaged alias nor a hub id."""

    exit_code = 2


class ModelFetchError(DepctlError):
    """A packaged model could not be downloaded, reassembled or converted."""


class DaemonNotRunning(DepctlError):
    def __init__(self, message: str = "the depctl daemon is not running", hint: str | None = None):
        super().__init__(message, hint or "start it with `depctl daemon start` (logs: `depctl daemon logs`)")


class DaemonError(DepctlError):
    """The daemon answered with an error."""


class WaitTimeout(DepctlError):
    exit_code = 5
