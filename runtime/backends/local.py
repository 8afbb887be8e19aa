"""depctl's own speculative engine as a backend: loaded on a thread of its own, then stepped by the engine thread."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from typing import AsyncIterator, Callable

from depctl.errors import DepctlError, first_line
from depctl.spec import DeploymentSpec, describe_speculation
from depctl_runtime.backends.base import (
    BackendError,
    Counters,
    Delta,
    GenerateRequest,
    Interrupted,
    Loader,
    Logprob,
    Owner,
)
from depctl_runtime.backends.detok import IncrementalDetokenizer, StopMatcher
from depctl_runtime.backends.loader import LoadedDeployment, load_deployment
from depctl_runtime.backends.structured import compile_constraint
from depctl_runtime.backends.weights import LoadError
from depctl_runtime.backends.worker import EngineHost, EngineWorker, SetDraftTokens, Stop
from depctl_runtime.model.runner import held_bytes
from depctl_runtime.speculation import SuffixProposer
from depctl_runtime.speculation.eagle import EagleProposer

log = logging.getLogger("depctl.local")

_CUT = object()  # put in a running request's queue when the daemon's drain time is up


class LocalBackend:
    per_request_speculation = True

    def __init__(self, spec: DeploymentSpec, owner: Owner, loader: Loader | None = None):
        self.spec = spec
        self._owner = owner
        self._loader = loader or load_deployment
        self._worker: EngineWorker | None = None
        self._lock = threading.Lock()  # the worker's arrival vs. a stop that comes first
        self._stop_asked = False  # before the worker existed: the load's result is dropped
        self._stopped = threading.Event()
        self.memory_bytes: int | None = None  # weights and KV cache, once loaded
        self.weights_bytes: int | None = None  # the models' weights as held (packed ones at their packed size)

    # ---- lifecycle ----
    def start(self) -> None:
        threading.Thread(target=self._load, name=f"depctl-load-{self.spec.id}", daemon=True).start()

    def _load(self) -> None:
        """Load, calibrate and hand the engine to the engine thread; this thread then ends, and its OpenMP pool."""
        try:
            with self._owner.load_turn():
                if not self._owner.wanted(self) or self._stop_asked:
                    return self._gone()
                loaded = self._loader(self.spec, report=lambda stage: self._owner.progress(self, stage))
        except BaseException as exc:  # noqa: BLE001 - every failure ends in FAILED with its reason
            if isinstance(exc, (LoadError, DepctlError)):
                reason = getattr(exc, "message", None) or str(exc)
            else:
                log.error("loading %s failed", self.spec.id, exc_info=exc)
                reason = first_line(exc)
            self._owner.failed(self, reason, retrying=False)
            return self._gone()
        self.memory_bytes = held_bytes(loaded.engine.target, loaded.engine.proposer)  # once: the cache is preallocated
        head = getattr(loaded.engine.proposer, "head", None)  # an EAGLE head's (it shares the target's embeddings)
        weights = [m.model for m in (loaded.target, loaded.draft) if m is not None] + ([head] if head else [])
        self.weights_bytes = held_bytes(*weights)
        worker = EngineWorker(self.spec.id, loaded, self.spec.max_batch_size, EngineHost.get(), self._crashed)
        with self._lock:
            if not self._stop_asked:
                self._worker = worker
        if self._worker is None or not self._owner.ready(self):  # stopped or superseded while loading
            loaded.release()
            self._gone()

    def _crashed(self, exc: BaseException) -> None:
        self._owner.failed(
            self,
            f"the engine thread failed ({first_line(exc)}); see "
            "`depctl daemon logs`; `depctl deployment update` reloads it",
            retrying=False,
        )
        self._gone()

    def _gone(self) -> None:
        """Nothing of this backend runs any more (a load that ended without serving, a stop, a crash)."""
        with self._lock:
            self._worker, self._stop_asked = None, True
        self._owner.exited(self)
        self._stopped.set()  # last: whoever waits for the stop also sees the owner told of it

    def stop(self, drain: bool = True, then: Callable[[], None] | None = None) -> None:
        with self._lock:
            worker = self._worker
            if worker is None:  # loading (its result is dropped when it ends) or gone: nothing to drain
                self._stop_asked = True
        if worker is None:
            if then is not None:
                then()
            return

        def stopped() -> None:
            self._gone()
            if then is not None:
                then()

        worker.post(Stop(drain, stopped))

    def wait_stopped(self, timeout: float | None = None) -> bool:
        if self._worker is None:  # loading holds nothing to wait for
            return True
        return self._stopped.wait(timeout)

    def set_num_draft_tokens(self, k: int) -> bool:
        worker = self._worker
        if worker is not None:
            worker.post(SetDraftTokens(k))
        return True

    # ---- reads ----
    @property
    def ready(self) -> bool:
        worker = self._worker
        return worker is not None and not worker.exited.is_set()

    @property
    def worker(self) -> EngineWorker | None:
        return self._worker

    @property
    def loaded(self) -> LoadedDeployment | None:
        worker = self._worker
        return worker.loaded if worker is not None else None

    @property
    def tokenizer(self):
        loaded = self.loaded
        return loaded.tokenizer if loaded else None

    @property
    def max_context(self) -> int | None:
        loaded = self.loaded
        return loaded.max_context if loaded else None

    def status(self) -> dict:
        worker, loaded = self._worker, self.loaded
        if worker is None or loaded is None:
            return {}
        engine = loaded.engine
        out = {
            "num_requests_running": worker.num_running,
            "num_requests_waiting": worker.num_waiting,
            "device": str(loaded.target.device),
            "dtype": str(loaded.target.dtype).removeprefix("torch."),
            "weights": loaded.target.precision,
            "compiled": loaded.compiled,
            "products": loaded.products,
            "max_context": loaded.max_context,
            "max_batch_size": worker.max_batch_size,
            "memory_bytes": self._held(loaded),
            "weights_bytes": self.weights_bytes,
            "stats": engine.stats.to_dict(),
            "policy": engine.policy.snapshot(),
        }
        if loaded.draft is not None:
            out["draft_precision"] = loaded.draft.precision
        if isinstance(engine.proposer, EagleProposer):
            c = engine.proposer.head.config
            out["eagle_head"] = {"aux_layers": list(c.aux_layers), "draft_vocab_size": c.draft_vocab_size}
        if isinstance(engine.proposer, SuffixProposer):
            out["suffix_index"] = engine.proposer.snapshot()
        if loaded.learner is not None:
            out["learning"] = loaded.learner.status()
        if engine.prefix is not None:
            # whether prompts resume mid-block (engine.prefix_mid_block), or at whole blocks only
            out["prefix_cache"] = {**engine.prefix.stats(), "mid_block": engine.prefix_mid_block}
        return out

    def counters(self, fresh: bool = False) -> Counters:
        worker, loaded = self._worker, self.loaded
        if worker is None or loaded is None:
            return Counters()
        stats, proposer = loaded.engine.stats, loaded.engine.proposer
        index = proposer.snapshot() if isinstance(proposer, SuffixProposer) else None
        prefix = loaded.engine.prefix
        return Counters(
            stats.num_drafts,
            stats.num_draft_tokens,
            stats.num_accepted_tokens,
            list(stats.accepted_per_position),
            worker.num_running,
            worker.num_waiting,
            index["tokens"] if index else None,
            index["requests"] if index else None,
            stats.num_grammar_draft_tokens,
            stats.num_grammar_accepted_tokens,
            stats.grammar_seconds,
            stats.num_generated_tokens,
            self._held(loaded),
            prefix.queries if prefix else None,
            prefix.hits if prefix else None,
            prefix.bytes if prefix else None,
        )

    def _held(self, loaded) -> int | None:
        """Weights and KV cache (measured once: preallocated), the prefix cache's blocks (they come and go), and a
        learning head's training."""
        prefix = loaded.engine.prefix
        if self.memory_bytes is None:
            return None
        learning = loaded.learner.memory_bytes() if loaded.learner is not None else 0
        return self.memory_bytes + (prefix.bytes if prefix is not None else 0) + learning

    @property
    def method(self) -> str:
        return describe_speculation(self.spec.speculation)

    # ---- requests ----
    def prepare(self, request: GenerateRequest) -> GenerateRequest:
        loaded = self.loaded
        if request.constraint is None or loaded is None:
            return request
        grammar = compile_constraint(loaded.grammars, request.constraint)
        return dataclasses.replace(request, params=dataclasses.replace(request.params, grammar=grammar))

    def _logprobs(self, loaded: LoadedDeployment, out) -> tuple[Logprob, ...]:
        if not out.logprobs:
            return ()
        return tuple(
            Logprob(*_spell(loaded, lp.token), lp.logprob, tuple((*_spell(loaded, t), v) for t, v in lp.top))
            for lp in out.logprobs
        )

    async def generate(self, request: GenerateRequest, cut: asyncio.Future) -> AsyncIterator[Delta]:
        worker, loaded = self._worker, self.loaded
        if worker is None or loaded is None:
            raise BackendError(503, f"deployment {self.spec.id!r} is not serving", code="deployment_not_ready")
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        handle = worker.submit(
            request.prompt_ids, request.params, lambda item: loop.call_soon_threadsafe(outputs.put_nowait, item)
        )

        def on_cut(_) -> None:
            outputs.put_nowait(_CUT)

        cut.add_done_callback(on_cut)
        finished = False
        try:
            detok = IncrementalDetokenizer(loaded.tokenizer, request.shown_tokens)
            stopper = StopMatcher(list(request.stops))
            while True:
                out = await outputs.get()
                if out is _CUT:
                    raise Interrupted()
                if isinstance(out, BaseException):  # refused when submitted, or the deployment stopped
                    finished = True
                    if isinstance(out, ValueError):
                        raise BackendError(400, str(out), code="invalid_value")
                    raise BackendError(503, f"deployment {self.spec.id!r}: {out}", code="deployment_not_ready")
                finished = out.finish_reason is not None
                if out.error is not None:  # this request's own fault, or its step's: never another request's text
                    fault = out.error
                    param = request.constraint.param if fault.part == "grammar" and request.constraint else None
                    raise BackendError(fault.status, fault.message, code=fault.code, param=param)
                if out.finish_reason == "cancelled":
                    return
                n = len(out.token_ids)
                text = stopper.feed(detok.add(out.token_ids))
                counts = dict(
                    drafted=out.drafted,
                    accepted=out.accepted,
                    prediction_accepted=out.prediction_accepted,
                    grammar_drafted=out.grammar_drafted,
                    grammar_accepted=out.grammar_accepted,
                    logprobs=self._logprobs(loaded, out),
                    cached_tokens=out.cached_tokens,
                )
                if stopper.stopped:
                    yield Delta(text, n, "stop", stop=stopper.matched, **counts)
                    return
                if out.finish_reason:
                    text += stopper.feed(detok.flush()) + stopper.flush()
                    finish = "stop" if stopper.stopped else out.finish_reason
                    yield Delta(text, n, finish, stop=stopper.matched, **counts)
                    return
                yield Delta(text, n, None, **counts)
        finally:
            cut.remove_done_callback(on_cut)  # one future for every request: leave nothing on it
            if not finished:  # a stop string, a client that went away, an error: free the batch row
                handle.cancel()


def _spell(loaded: LoadedDeployment, token: int) -> tuple[str, bytes]:
    """A token id as logprobs show it: its text and its bytes (a byte-level token may hold part of a character)."""
    if loaded.grammars is not None:
        raw = loaded.grammars.token_bytes(token)
        return raw.decode("utf-8", errors="replace"), raw
    text = loaded.tokenizer.decode([token])
    return text, text.encode()
