"""Where requests' grammars are compiled: a small pool of threads of its own, with bounds on size, time and queue.

Compiling a grammar takes milliseconds for the schemas people send, and far longer for a crafted one. It never runs on
the threads that build every request and answer ``/tokenize`` and ``/depctl/v1/deployments``, nor on the event loop:
a request awaits its compile here, holding no thread. A compile that overruns its time gets a 400, and its thread
(which cannot be interrupted: the compiler is native code) keeps its slot until it ends, so at most
``workers + queue`` compiles are ever under way; beyond that a request with a grammar gets a 503 at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor

from depctl_runtime.api.errors import APIError
from depctl_runtime.backends import Backend, BackendError, GenerateRequest
from depctl_runtime.backends.structured import GrammarLimits, check_limits

log = logging.getLogger("depctl.grammars")


class GrammarPool:
    def __init__(
        self, limits: GrammarLimits = GrammarLimits(), timeout: float = 10.0, workers: int = 1, queue: int = 32
    ):
        self.limits, self.timeout = limits, timeout
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="depctl-grammar-compile")
        self._capacity = workers + queue
        self._under_way = 0  # read and written on the event loop only

    async def prepare(self, backend: Backend, request: GenerateRequest) -> GenerateRequest:
        """The request as the backend runs it, its constraint compiled (if it has one)."""
        constraint = request.constraint
        if constraint is None:
            return backend.prepare(request)  # nothing to compile: a dataclass copy at most
        try:
            check_limits(constraint, self.limits)
        except BackendError as exc:
            if constraint.optional:
                return self._without(backend, request, exc)
            raise _api_error(exc) from None
        if self._under_way >= self._capacity:
            raise APIError(
                503,
                f"{self._under_way} grammars are being compiled; retry this request shortly",
                param=constraint.param,
                code="grammar_compiler_busy",
            )
        self._under_way += 1
        future = asyncio.get_running_loop().run_in_executor(self._executor, backend.prepare, request)
        future.add_done_callback(self._done)
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.timeout)
        except asyncio.TimeoutError:
            raise APIError(
                400,
                f"{constraint.param}: it was not compiled within {self.timeout:g}s (DEPCTL_GRAMMAR_TIMEOUT; the "
                "time counts from its arrival, so other grammars compiling count too): simplify it, or retry",
                param=constraint.param,
                code="grammar_too_complex",
            ) from None
        except BackendError as exc:
            if constraint.optional:
                return self._without(backend, request, exc)
            raise _api_error(exc) from None

    @staticmethod
    def _without(backend: Backend, request: GenerateRequest, why: BackendError) -> GenerateRequest:
        """The request without the constraint depctl added to it (the client asked for none), which cannot run."""
        log.warning("%s: running unconstrained, as its grammar cannot run: %s", request.constraint.param, why.message)
        return backend.prepare(dataclasses.replace(request, constraint=None))

    def _done(self, _future) -> None:
        self._under_way -= 1

    @property
    def under_way(self) -> int:
        return self._under_way


def _api_error(exc: BackendError) -> APIError:
    return APIError(exc.status, exc.message, param=exc.param, code=exc.code or "invalid_grammar")
