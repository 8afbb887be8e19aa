"""The deployment manager: reconciles the spec store (what users asked for) with what is loaded (what is).

The daemon owns status; it never writes into a spec. States (as Fireworks and dstack name them):

    CREATING -> READY | FAILED        a new spec is being loaded
    READY -> UPDATING -> READY | FAILED   the spec changed in a way that needs a reload (the old engine keeps
                                      serving meanwhile); a draft-token-count change applies in place
    any -> DELETING -> (gone)         the spec file was removed; in-flight requests finish first

A spec file that does not parse shows up as FAILED with the file and the problem, and touches no other
deployment. Each loaded engine belongs to one ``EngineWorker`` thread, which loads it, calibrates it and runs every
step (see ``runtime.worker``); a ``--engine vllm`` deployment belongs to a ``VLLMServer``, which starts and supervises
a vLLM server process (see ``runtime.vllm_server``; a crash there is FAILED, then CREATING again as it restarts). Loads
and server start-ups take turns on one lock so two big models never load at once.
Reconciling happens on a poll of the store (every ``POLL_SECONDS``) and at once when the CLI calls
``POST /depctl/v1/reconcile`` after a write.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

from depctl.errors import DepctlError
from depctl.spec import DeploymentSpec, describe_engine, describe_speculation
from depctl.store import SpecStore
from runtime.loader import LoadedDeployment, LoadError, load_deployment, reporting
from runtime.vllm_server import VLLMServer, reap_orphans, stats_from_metrics
from runtime.worker import EngineWorker

log = logging.getLogger("depctl.manager")

POLL_SECONDS = 2.0
WATCH_SECONDS = 0.25  # how often the poller checks the running load against its time limit
DEFAULT_LOAD_TIMEOUT = 900.0


class State(str, enum.Enum):
    CREATING = "CREATING"
    READY = "READY"
    UPDATING = "UPDATING"
    DELETING = "DELETING"
    FAILED = "FAILED"


@dataclass
class Deployment:
    id: str
    spec: DeploymentSpec | None  # None when the file is broken
    state: State
    reason: str | None = None
    worker: EngineWorker | None = None  # the thread serving the loaded engine
    server: VLLMServer | None = None  # or the vLLM server serving it (--engine vllm)
    loaded_spec: DeploymentSpec | None = None  # the spec the loaded engine was built from
    generation: int = 0  # bumps on every spec change; a load for an older generation is discarded
    state_since: float = field(default_factory=time.time)
    ready_at: float | None = None
    load_seconds: float | None = None

    @property
    def loaded(self) -> LoadedDeployment | None:
        worker = self.worker
        return worker.loaded if worker is not None else None

    @property
    def serving(self) -> bool:
        """Something is there to answer requests (the state says whether it should)."""
        server = self.server
        return self.loaded is not None or (server is not None and server.ready)

    @property
    def tokenizer(self):
        loaded, server = self.loaded, self.server
        return loaded.tokenizer if loaded else (server.tokenizer if server else None)

    @property
    def max_context(self) -> int | None:
        loaded, server = self.loaded, self.server
        return loaded.max_context if loaded else (server.max_model_len if server else None)

    def set_state(self, state: State, reason: str | None = None) -> None:
        if state != self.state:
            log.info("deployment %s: %s -> %s%s", self.id, self.state.value, state.value, f" ({reason})" if reason else "")
        self.state = state
        self.reason = reason
        self.state_since = time.time()

    @property
    def proxied(self) -> VLLMServer | None:
        """The vLLM server that answers this deployment's requests, if that is what serves it."""
        return self.server if self.worker is None else None

    def status(self) -> dict:
        """What ``deployment get`` shows. For a vLLM deployment it reads the server's counters (an HTTP call, cached
        a second): never call it on the event loop."""
        spec = self.spec or self.loaded_spec
        worker = self.worker
        out = {
            "id": self.id,
            "state": self.state.value,
            "reason": self.reason,
            "state_since": self.state_since,
            "model": spec.model if spec else None,
            "speculation": describe_speculation(spec.speculation) if spec else None,
            "engine": describe_engine(spec) if spec else None,
            "ready_at": self.ready_at,
            "load_seconds": self.load_seconds,
            # vLLM's gauge names: requests in the running batch (prefilling included), and queued behind it
            "num_requests_running": worker.num_running if worker else 0,
            "num_requests_waiting": worker.num_waiting if worker else 0,
        }
        server = self.server
        if server is not None:
            metrics = server.metrics()
            out["vllm"] = server.status()
            out["num_requests_running"] = int(metrics.get("vllm:num_requests_running", 0))
            out["num_requests_waiting"] = int(metrics.get("vllm:num_requests_waiting", 0))
            out["device"] = server.device
            out["dtype"] = server.dtype
            out["max_context"] = server.max_model_len
            out["max_batch_size"] = spec.max_batch_size if spec else None
            if server.ready:
                out["stats"] = stats_from_metrics(metrics)
        loaded = self.loaded
        if loaded:
            engine = loaded.engine
            out["device"] = str(loaded.target.device)
            out["dtype"] = str(loaded.target.dtype).removeprefix("torch.")
            out["weights"] = loaded.target.precision  # the dtype's name, or "int8 weights"
            out["compiled"] = loaded.compiled
            out["products"] = loaded.products
            if loaded.draft is not None:
                out["draft_precision"] = loaded.draft.precision
            out["max_context"] = loaded.max_context
            out["max_batch_size"] = worker.max_batch_size
            out["stats"] = engine.stats.to_dict()
            out["policy"] = engine.policy.snapshot()
            if hasattr(engine.proposer, "snapshot"):
                out["suffix_index"] = engine.proposer.snapshot()
        return out


Loader = Callable[[DeploymentSpec], LoadedDeployment]


def _reload_needed(old: DeploymentSpec, new: DeploymentSpec) -> bool:
    """Everything but the draft token count, the display name and timestamps needs new weights or a new proposer."""

    def key(spec: DeploymentSpec) -> dict:
        fields = spec.model_dump(exclude={"display_name", "created_at", "updated_at"})
        if spec.engine == "depctl":  # our engine changes K in place; a vLLM server takes it only at start-up
            fields["speculation"].pop("num_draft_tokens", None)
        return fields

    return key(old) != key(new)


class DeploymentManager:
    def __init__(self, store: SpecStore, loader: Loader = load_deployment, load_timeout: float = DEFAULT_LOAD_TIMEOUT):
        self.store = store
        self.loader = loader
        self.load_timeout = load_timeout
        self.deployments: dict[str, Deployment] = {}
        self._lock = threading.RLock()  # guards self.deployments and state transitions
        # one load at a time (two big models never load at once): the turn belongs to one _Turn, and the poller
        # takes it back from a load that overran load_timeout so that a hung load never blocks the others
        self._turn_cond = threading.Condition()
        self._turn: _Turn | None = None
        self._stop = threading.Event()
        self._fingerprint: dict | None = None
        self._poller: threading.Thread | None = None
        self._servers: set[VLLMServer] = set()

    # ---- lifecycle ----
    def start(self) -> None:
        reap_orphans()  # vLLM servers a killed daemon left behind: gone before anything starts again
        self.reconcile()
        self._poller = threading.Thread(target=self._poll, name="depctl-poll", daemon=True)
        self._poller.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            for dep in self.deployments.values():
                if dep.worker is not None:
                    dep.worker.stop(drain=False)
            servers = list(self._servers)
        for server in servers:
            server.stop()
        for server in servers:  # the daemon exits only once its vLLM servers have
            server.wait_stopped(timeout=30)

    def _poll(self) -> None:
        next_reconcile = time.monotonic() + POLL_SECONDS
        while not self._stop.wait(WATCH_SECONDS):
            try:
                self._check_load_time()
                if time.monotonic() >= next_reconcile:
                    next_reconcile = time.monotonic() + POLL_SECONDS
                    self.reconcile()
            except Exception:  # a poll must never die; the next one retries
                log.exception("reconcile failed")

    # ---- reads ----
    def get(self, deployment_id: str) -> Deployment | None:
        with self._lock:
            return self.deployments.get(deployment_id)

    def all(self) -> list[Deployment]:
        with self._lock:
            return list(self.deployments.values())

    # ---- reconcile ----
    def reconcile(self, force: bool = False) -> None:
        with self._lock:
            fingerprint = self.store.fingerprint()
            if not force and fingerprint == self._fingerprint:
                return
            self._fingerprint = fingerprint
            specs, broken = self.store.list()
            wanted = {s.id: s for s in specs}
            changes = [(b.id, partial(self._on_broken, b.id, b.problem)) for b in broken]
            changes += [(s.id, partial(self._on_spec, s)) for s in specs]
            changes += [(dep_id, partial(self._on_deleted, dep)) for dep_id, dep in list(self.deployments.items())
                        if dep_id not in wanted and dep_id not in {b.id for b in broken}]
            for dep_id, apply in changes:
                try:
                    apply()
                except Exception:  # one deployment's trouble never stops the others' reconciling
                    log.exception("reconciling deployment %s failed", dep_id)

    def _on_spec(self, spec: DeploymentSpec) -> None:
        dep = self.deployments.get(spec.id)
        if dep is None or dep.state == State.DELETING:
            # new, or re-created while the deleted one drains: a deployment of its own (the draining one's exit
            # only forgets its own record), never an in-place change to an engine that is on its way out
            dep = self.deployments[spec.id] = Deployment(spec.id, spec, State.CREATING)
            self._schedule_load(dep)
            return
        if dep.spec == spec:
            return  # unchanged (a FAILED deployment is retried when its spec changes or the daemon restarts)
        dep.spec = spec
        dep.generation += 1
        if dep.serving and dep.loaded_spec is not None and not _reload_needed(dep.loaded_spec, spec):
            # the draft token count (depctl's engine) or just the name changed: apply in place, no reload
            if dep.worker is not None:
                dep.worker.set_num_draft_tokens(getattr(spec.speculation, "num_draft_tokens", 0))  # on its thread
            dep.loaded_spec = spec
            dep.set_state(State.READY)
            return
        dep.set_state(State.UPDATING if dep.serving else State.CREATING)
        self._schedule_load(dep)

    def _on_broken(self, dep_id: str, problem: str) -> None:
        dep = self.deployments.get(dep_id)
        reason = f"the spec file is broken: {problem}"
        if dep is None or dep.state == State.DELETING:
            dep = self.deployments[dep_id] = Deployment(dep_id, None, State.FAILED, reason)
        if dep.reason != reason or dep.spec is not None:
            dep.spec = None
            dep.generation += 1
            dep.set_state(State.FAILED, reason)
            self._release(dep)

    def _on_deleted(self, dep: Deployment) -> None:
        if dep.state == State.DELETING:
            return
        dep.generation += 1
        dep.set_state(State.DELETING)

        def forget() -> None:
            with self._lock:
                if self.deployments.get(dep.id) is dep and dep.state == State.DELETING:
                    del self.deployments[dep.id]
            _free_memory()

        worker = dep.worker or dep.server
        if worker is None:
            forget()
        else:
            worker.stop(drain=True, then=forget)  # in-flight requests finish first (depctl's engine)

    def _release(self, dep: Deployment) -> None:
        worker, dep.worker, dep.loaded_spec = dep.worker, None, None
        server, dep.server = dep.server, None
        if worker is not None:
            worker.stop(drain=True, then=_free_memory)
        if server is not None:
            server.stop()

    def _schedule_load(self, dep: Deployment) -> None:
        generation, spec = dep.generation, dep.spec
        t0 = time.time()

        def current() -> bool:
            with self._lock:
                return dep.generation == generation and self.deployments.get(dep.id) is dep

        if spec.engine == "vllm":
            self._start_server(dep, spec, generation, current, t0)
            return

        def progress(message: str) -> None:  # a long step of the load (a first compile), shown by `deployment get`
            with self._lock:
                if current() and dep.state in (State.CREATING, State.UPDATING):
                    dep.reason = message

        def load() -> LoadedDeployment:
            turn = _Turn(dep, generation)
            self._take_turn(turn)
            try:
                if not current():
                    raise _Superseded()
                with reporting(progress):
                    return self.loader(spec)
            finally:
                self._end_turn(turn)

        def on_loaded(worker: EngineWorker, loaded: LoadedDeployment) -> bool:
            return self._serving_now(dep, current, spec, t0, worker=worker)

        def on_failed(worker: EngineWorker, exc: BaseException) -> None:
            if isinstance(exc, _Superseded):
                return
            if isinstance(exc, (LoadError, DepctlError)):
                error = getattr(exc, "message", None) or str(exc)
            else:  # an unexpected failure still ends in FAILED, with the type named
                log.error("loading %s failed", dep.id, exc_info=exc)
                error = f"{type(exc).__name__}: {exc}".splitlines()[0]
            with self._lock:
                if not current():
                    return
                dep.set_state(State.FAILED, error)
                self._release(dep)

        EngineWorker(dep.id, load, on_loaded, on_failed, spec.max_batch_size).start()

    def _serving_now(self, dep: Deployment, current, spec: DeploymentSpec, t0: float,
                     worker: EngineWorker | None = None, server: VLLMServer | None = None) -> bool:
        """A load (or server start) finished: it serves from now on and the previous one, if any, is let go."""
        with self._lock:
            if not current():
                return False  # stale: drop what we loaded
            previous = [p for p in (dep.worker, dep.server) if p is not None and p is not server]
            dep.worker, dep.server, dep.loaded_spec = worker, server, spec
            dep.load_seconds = round(time.time() - t0, 2)
            dep.ready_at = time.time()
            dep.set_state(State.READY)
        _freeze_heap()
        for p in previous:
            p.stop(drain=True, then=_free_memory)  # the old engine finishes what it was serving
        return True

    def _start_server(self, dep: Deployment, spec: DeploymentSpec, generation: int, current, t0: float) -> None:
        turn = _Turn(dep, generation)

        def wanted() -> bool:
            """Starting for the spec as it is, or already the deployment's server (which a display-name change,
            say, must not stop); once neither, the server stops itself."""
            with self._lock:
                return (self.deployments.get(dep.id) is dep and dep.state != State.DELETING
                        and (current() or dep.server is server))

        def on_starting(server: VLLMServer, progress: str) -> None:
            with self._lock:
                if not wanted():
                    return
                if dep.state == State.UPDATING and dep.server is not server:
                    dep.reason = progress  # the previous engine serves until this one is up
                else:
                    dep.set_state(State.CREATING, progress)  # new, or restarting after a crash

        def on_failed(server: VLLMServer, reason: str, retrying: bool) -> None:
            with self._lock:
                if not wanted():
                    return
                dep.set_state(State.FAILED, reason)
                if dep.server is not server or not retrying:
                    # as for a failed load: the previous engine goes too (it no longer matches the spec); a server
                    # still retrying becomes the deployment's once it is up
                    self._release(dep)

        def on_ready(server: VLLMServer) -> bool:
            return self._serving_now(dep, wanted, spec, t0, server=server)

        def exited() -> None:
            with self._lock:
                self._servers.discard(server)

        server = VLLMServer(spec, load_timeout=self.load_timeout, wanted=wanted,
                            take_turn=lambda: self._take_turn(turn), end_turn=lambda: self._end_turn(turn),
                            on_starting=on_starting, on_ready=on_ready, on_failed=on_failed)
        with self._lock:
            self._servers.add(server)  # every live server, so that `daemon stop` waits for all of them
            if not dep.serving:
                dep.server = server
        server.stop_callbacks.append(exited)
        server.start()

    # ---- the load turn ----
    def _take_turn(self, turn: "_Turn") -> None:
        with self._turn_cond:
            while self._turn is not None:
                self._turn_cond.wait()
            self._turn = turn
            turn.started = time.monotonic()

    def _end_turn(self, turn: "_Turn") -> None:
        with self._turn_cond:
            if self._turn is turn:
                self._turn = None
                self._turn_cond.notify_all()

    def _check_load_time(self) -> None:
        """Fail a load that overran ``load_timeout`` and give the turn to the next one. Its thread cannot be killed
        (it may sit in a read that never returns); whatever it loads later is dropped as stale."""
        with self._turn_cond:
            turn = self._turn
            if turn is None or time.monotonic() - turn.started < self.load_timeout:
                return
        dep = turn.dep
        with self._lock:
            if dep.generation == turn.generation and self.deployments.get(dep.id) is dep:
                dep.generation += 1  # what the stuck load returns, if ever, is stale
                dep.set_state(State.FAILED, (
                    f"the model did not finish loading within {self.load_timeout:g}s (DEPCTL_LOAD_TIMEOUT, or "
                    f"`depctl daemon start --load-timeout`): check that its files are readable (not a FIFO or a hung "
                    f"network mount); `depctl deployment update` retries"))
                self._release(dep)
        log.error("deployment %s: load exceeded %gs; the next load goes ahead", dep.id, self.load_timeout)
        self._end_turn(turn)


@dataclass(eq=False)
class _Turn:
    dep: Deployment
    generation: int
    started: float = 0.0


class _Superseded(Exception):
    """A newer spec (or a delete) arrived while this load waited its turn."""


def _freeze_heap() -> None:
    """Collect, then move every object alive out of the collector's reach (``gc.freeze``): a loaded model is hundreds
    of thousands of objects, and a full collection walks them all on whichever thread triggers it, the GIL held (with
    SmolLM2 loaded: 200 ms on the event loop's thread, once in a minute of serving one client, every stream stalled
    meanwhile; frozen, the same collection took 0.5 ms). Frozen objects are still freed when their last reference
    goes; ``_free_memory`` unfreezes to reclaim cycles."""
    import gc

    gc.collect()
    gc.freeze()


def _free_memory() -> None:
    """After an engine let go of its model: collect everything, its reference cycles included, then freeze again."""
    import gc

    import torch

    gc.unfreeze()
    _freeze_heap()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
