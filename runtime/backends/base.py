"""The seam between the daemon and an engine: what every backend offers, and what it hands back.

A deployment holds one ``Backend``, made from its spec by ``backends.make_backend``. Routes, metrics and status
talk to that protocol only; whether depctl's own engine or a supervised vLLM server answers is the backend's business.

A backend reports its life to its ``Owner`` (the manager's side): it takes the load turn, says what it is doing,
says when it is ready or has failed, and asks whether it is still wanted.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Literal, Protocol

from depctl.spec import DeploymentSpec
from depctl_runtime.speculation.params import GenerationParams

if TYPE_CHECKING:
    from depctl_runtime.backends.loader import LoadedDeployment

# how depctl's engine loads a deployment from its spec (``loader.load_deployment``; tests pass stand-ins)
Loader = Callable[..., "LoadedDeployment"]


@dataclass(frozen=True)
class Constraint:
    """What the output must match, as the request said it: a JSON schema (``None``: any JSON object), a regular
    expression, a Lark grammar (llguidance's dialect), or one of a list of strings."""

    kind: Literal["json", "regex", "grammar", "choice"]
    value: Any
    param: str  # the request field it came from, named in errors
    optional: bool = False  # the request runs without it where it does not compile (tool_choice auto's calls)


@dataclass(frozen=True)
class GenerateRequest:
    """What a backend needs to run one request: token ids in, sampling and stopping rules."""

    prompt_ids: list[int]
    params: GenerationParams
    stops: tuple[str, ...] = ()
    constraint: Constraint | None = None  # compiled into ``params.grammar`` by the backend's ``prepare``
    shown_tokens: tuple[int, ...] = ()  # special tokens the output's text shows (a tool format's marker)


@dataclass(frozen=True)
class Logprob:
    """An emitted token's log-probability under the target, with the most likely tokens at its position."""

    token: str
    bytes: bytes
    logprob: float
    top: tuple[tuple[str, bytes, float], ...] = ()


@dataclass(frozen=True)
class Delta:
    """A run of output: its text, how many tokens it took, and the speculation behind it."""

    text: str
    tokens: int = 0
    finish_reason: str | None = None  # "stop" | "length" on the last delta
    drafted: int = 0
    accepted: int = 0
    prediction_accepted: int = 0
    grammar_drafted: int = 0  # of ``drafted``, tokens the grammar forced
    grammar_accepted: int = 0
    logprobs: tuple[Logprob, ...] = ()  # one per token, when the request asked
    cached_tokens: int = 0  # on the first delta: prompt tokens read from the prefix cache
    stop: str | None = None  # on the last delta: the stop string that ended the output, if one did


@dataclass(frozen=True)
class Counters:
    """Speculation and queue counters for ``/metrics``: read without blocking, at scrape time."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    running: int | None = None
    waiting: int | None = None
    suffix_tokens: int | None = None  # suffix speculation's index, where there is one
    suffix_requests: int | None = None
    grammar_draft_tokens: int | None = None  # of draft_tokens, those a grammar forced (depctl's engine only)
    grammar_accepted_tokens: int | None = None
    grammar_seconds: float | None = None
    generated_tokens: int = 0  # output tokens since the engine started (rates come from differences)
    memory_bytes: int | None = None  # what the deployment holds: weights and KV cache, or vLLM's processes
    prefix_cache_queries: int | None = None  # prompt tokens looked up in the prefix cache (depctl's engine)
    prefix_cache_hits: int | None = None  # of those, tokens found
    prefix_cache_bytes: int | None = None  # what the cached blocks hold


@dataclass(frozen=True)
class Stage:
    """A step of a long load or start, as ``deployment get`` and the CLI's wait show it: its name (resolving,
    downloading, converting, loading, compiling, calibrating, starting vLLM, ...), what it is doing, and how far it
    is where that is known (0-1)."""

    name: str
    detail: str = ""
    fraction: float | None = None

    def __str__(self) -> str:
        done = f" ({self.fraction:.0%})" if self.fraction is not None else ""
        return f"{self.name}: {self.detail}{done}" if self.detail else f"{self.name}{done}"


class BackendError(Exception):
    """A request the backend could not run, with the HTTP status and OpenAI error code it maps to."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


class Interrupted(Exception):
    """The daemon's drain time ran out while this request was still running."""


class Owner(Protocol):
    """The manager's side of one backend: how it reports its life (see ``depctl_runtime.manager``)."""

    def load_turn(self) -> contextlib.AbstractContextManager[None]: ...

    def wanted(self, backend: Backend) -> bool: ...

    def progress(self, backend: Backend, stage: Stage) -> None: ...

    def ready(self, backend: Backend) -> bool: ...

    def failed(self, backend: Backend, reason: str, retrying: bool) -> None: ...

    def exited(self, backend: Backend) -> None: ...


class Backend(Protocol):
    spec: DeploymentSpec
    tokenizer: object | None  # the model's tokenizer, for building and checking requests
    max_context: int | None  # prompt + output tokens a request may hold
    per_request_speculation: bool  # whether deltas count drafted and accepted tokens

    @property
    def ready(self) -> bool: ...

    def start(self) -> None:
        """Begin loading or starting, on a thread of the backend's own; report to the owner."""

    def prepare(self, request: GenerateRequest) -> GenerateRequest:
        """The request as this backend runs it (a constraint compiled); raises ``BackendError`` (400) for one it
        cannot run. Called where requests are built, off the event loop."""

    def generate(self, request: GenerateRequest, cut: asyncio.Future) -> AsyncIterator[Delta]:
        """The request's output as it is produced (on the event loop). Leaving early cancels the request; ``cut``
        resolving raises ``Interrupted``; a request that cannot run raises ``BackendError``."""

    def set_num_draft_tokens(self, k: int) -> bool:
        """Change K in place; False when this backend takes it only by a restart."""

    def status(self) -> dict:
        """The engine's facts for ``deployment get`` (may block briefly: never call it on the event loop)."""

    def counters(self, fresh: bool = False) -> Counters:
        """Read without blocking (a scrape on the event loop); ``fresh``: up to date even where that costs a call to
        another process (the manager's once-a-second sampling, off the loop)."""

    def stop(self, drain: bool = True, then: Callable[[], None] | None = None) -> None:
        """Stop after what runs finishes (``drain``) or at once; ``then`` runs once it has stopped."""

    def wait_stopped(self, timeout: float | None = None) -> bool: ...
