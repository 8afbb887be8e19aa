"""The deployment manager: reconciles the spec store (what users asked for) with what is loaded (what is).

The daemon owns status; it never writes into a spec. States (as Fireworks and dstack name them):

    CREATING -> READY | FAILED        a new spec is being loaded
    READY -> UPDATING -> READY | FAILED   the spec changed in a way that needs a reload (the old engine keeps
                                      serving meanwhile); a draft-token-count change applies in place
    any -> DELETING -> (gone)         the spec file was removed; in-flight requests finish first

A spec file that does not parse shows up as FAILED with the file and the problem, and touches no other
deployment. What serves a deployment is its ``Backend`` (``backends``): depctl's own engine, or a supervised
vLLM server (a crash there is FAILED, then CREATING again as it restarts). A backend reports its life through its
``_Owner``; loads and server start-ups take turns so that two big models never load at once.
Reconciling happens on a poll of the store (every ``POLL_SECONDS``) and at once when the CLI calls
``POST /depctl/v1/reconcile`` after a write.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterator

from depctl.spec import DeploymentSpec, describe_duration, describe_engine, describe_speculation
from depctl.store import SpecStore
from depctl_runtime.backends import Backend, Loader, make_backend
from depctl_runtime.backends.base import Stage
from depctl_runtime.backends.vllm_process import reap_orphans
from depctl_runtime.meter import ACCEPTANCE_WINDOW, RATE_WINDOW, SAMPLE_SECONDS, Meter

log = logging.getLogger("depctl.manager")

POLL_SECONDS = 2.0
WATCH_SECONDS = 0.25  # how often the poller checks the running load against its time limit
DEFAULT_LOAD_TIMEOUT = 900.0


WAKING = "loading again for a request (it was unloaded when idle)"


class State(str, enum.Enum):
    CREATING = "CREATING"
    READY = "READY"
    UPDATING = "UPDATING"
    DELETING = "DELETING"
    FAILED = "FAILED"
    IDLE = "IDLE"  # unloaded after its keep-alive with nothing to do; the next request loads it again


@dataclass
class Deployment:
    id: str
    spec: DeploymentSpec | None  # None when the file is broken
    state: State
    reason: str | None = None
    backend: Backend | None = None  # what serves it, or is being started to
    loaded_spec: DeploymentSpec | None = None  # the spec the serving backend was built from
    generation: int = 0  # bumps on every spec change; a load for an older generation is discarded
    state_since: float = field(default_factory=time.time)
    stage: Stage | None = None  # the step a load or start is at, while there is one
    stage_since: float = 0.0
    meter: Meter = field(default_factory=Meter)
    last_active: float = field(default_factory=time.monotonic)  # a request arrived, ran or waited
    waking: bool = False  # loading again after an idle unload: requests wait for it instead of a 503
    ready_at: float | None = None
    load_seconds: float | None = None

    @property
    def serving(self) -> bool:
        """Something is there to answer requests (the state says whether it should)."""
        backend = self.backend
        return backend is not None and backend.ready

    @property
    def max_context(self) -> int | None:
        return self.backend.max_context if self.backend is not None else None

    def set_state(self, state: State, reason: str | None = None) -> None:
        if state != self.state:
            log.info(
                "deployment %s: %s -> %s%s", self.id, self.state.value, state.value, f" ({reason})" if reason else ""
            )
            self.state_since = time.time()
        self.state = state
        self.reason = reason
        if state not in (State.CREATING, State.UPDATING):
            self.stage = None
        self.waking = self.waking and state == State.CREATING

    def enter(self, stage: Stage) -> None:
        """A backend's load or start moved on (a new stage is logged with how long the last one took)."""
        now = time.time()
        if self.stage is None or stage.name != self.stage.name:
            took = f"; {self.stage.name} took {now - self.stage_since:.1f}s" if self.stage else ""
            log.info("deployment %s: %s%s", self.id, stage, took)
            self.stage_since = now
        self.stage = stage

    def status(self) -> dict:
        """What ``deployment get`` shows. A vLLM backend reads its server's counters (an HTTP call, cached a second):
        never call it on the event loop."""
        spec = self.spec or self.loaded_spec
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
            "stage": None
            if self.stage is None
            else {
                "name": self.stage.name,
                "detail": self.stage.detail,
                "fraction": self.stage.fraction,
                "since": self.stage_since,
            },
            # vLLM's gauge names: requests in the running batch (prefilling included), and queued behind it
            "num_requests_running": 0,
            "num_requests_waiting": 0,
        }
        backend = self.backend
        if backend is not None:
            out.update(backend.status())
            out.setdefault("memory_bytes", backend.counters().memory_bytes)
        out["recent"] = self.meter.snapshot()
        return out


def _log_activity(dep: Deployment) -> None:
    meter = dep.meter
    rate, acceptance = meter.tokens_per_second(), meter.acceptance_rate()
    running, waiting = meter.queue()
    log.info(
        "deployment %s: %.1f tok/s generated, %d running, %d waiting%s",
        dep.id,
        rate or 0.0,
        running,
        waiting,
        "" if acceptance is None else f", acceptance {acceptance:.0%} (last {ACCEPTANCE_WINDOW:.0f}s)",
    )


def _reload_needed(old: DeploymentSpec, new: DeploymentSpec, k_in_place: bool = True) -> bool:
    """Everything but the display name, the settings read per request and timestamps (and the draft token count,
    where ``k_in_place``) needs new weights or a new proposer."""

    def key(spec: DeploymentSpec) -> dict:
        live = {"display_name", "keep_alive", "record_prompts", "sampling", "created_at", "updated_at"}
        fields = spec.model_dump(exclude=live)
        if k_in_place:
            fields["speculation"].pop("num_draft_tokens", None)
        return fields

    return key(old) != key(new)


class DeploymentManager:
    def __init__(self, store: SpecStore, loader: Loader | None = None, load_timeout: float = DEFAULT_LOAD_TIMEOUT):
        """``loader``: how depctl's engine loads a spec (tests pass a fake one)."""
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
        self._backends: set[Backend] = set()  # every live backend, so that `daemon stop` waits for all of them

    # ---- lifecycle ----
    def start(self) -> None:
        reap_orphans()  # vLLM servers a killed daemon left behind: gone before anything starts again
        self.reconcile()
        self._poller = threading.Thread(target=self._poll, name="depctl-poll", daemon=True)
        self._poller.start()
        threading.Thread(target=self._measure, name="depctl-meter", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            backends = list(self._backends)
        for backend in backends:
            backend.stop(drain=False)
        deadline = time.monotonic() + 30
        for backend in backends:  # the daemon exits only once its backends (vLLM's processes) have
            backend.wait_stopped(timeout=max(deadline - time.monotonic(), 0))

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

    def _measure(self) -> None:
        """Sample every serving deployment's counters once a second; every ``RATE_WINDOW`` seconds log a line for
        each one that did something, as vLLM and llama.cpp's servers do."""
        next_log = time.monotonic() + RATE_WINDOW
        while not self._stop.wait(SAMPLE_SECONDS):
            now = time.monotonic()
            for dep in self.all():
                backend = dep.backend
                try:
                    if backend is not None and backend.ready:
                        counters = backend.counters(fresh=True)  # vLLM's too: keep-alive must see its load
                        dep.meter.sample(counters, now)
                        if counters.running or counters.waiting or dep.meter.active(SAMPLE_SECONDS):
                            dep.last_active = now
                except Exception:  # a backend on its way out: the next sample finds the new one
                    log.debug("sampling %s failed", dep.id, exc_info=True)
                self._unload_if_idle(dep, now)
            if now >= next_log:
                next_log = now + RATE_WINDOW
                for dep in self.all():
                    if dep.meter.active():
                        _log_activity(dep)

    # ---- idle unload (a spec's keep_alive) ----
    def _unload_if_idle(self, dep: Deployment, now: float) -> None:
        with self._lock:
            spec = dep.loaded_spec
            if dep.state != State.READY or spec is None or spec.keep_alive is None:
                return
            if now - dep.last_active < spec.keep_alive or self.deployments.get(dep.id) is not dep:
                return
            idle = describe_duration(spec.keep_alive)
            log.info("deployment %s: idle for %s (keep-alive): unloading until the next request", dep.id, idle)
            dep.generation += 1
            self._release(dep)
            dep.set_state(State.IDLE, f"unloaded after {idle} idle (keep-alive); the next request loads it again")

    def wake(self, dep: Deployment) -> None:
        """A request for an IDLE deployment: load it again (requests wait for it, and ``get`` says so)."""
        with self._lock:
            if dep.state != State.IDLE or self.deployments.get(dep.id) is not dep:
                return
            log.info("deployment %s: a request arrived while idle: loading it again", dep.id)
            dep.generation += 1
            dep.last_active = time.monotonic()
            dep.set_state(State.CREATING, WAKING)
            dep.waking = True
            self._schedule_load(dep)

    def touch(self, dep: Deployment) -> None:
        dep.last_active = time.monotonic()

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
            changes += [
                (dep_id, partial(self._on_deleted, dep))
                for dep_id, dep in list(self.deployments.items())
                if dep_id not in wanted and dep_id not in {b.id for b in broken}
            ]
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
        if (
            dep.state in (State.CREATING, State.UPDATING)
            and dep.spec is not None
            and not _reload_needed(dep.spec, spec, k_in_place=False)
        ):
            # the load under way is of the spec as it was: a change it does not depend on (a sampling default, the
            # name; not a draft token count, which the loading engine would not see) applies as it stands, rather
            # than discarding that load for another
            dep.spec = spec
            return
        dep.spec = spec
        dep.generation += 1
        if dep.serving and dep.loaded_spec is not None and _in_place(dep.loaded_spec, spec, dep.backend):
            # the draft token count or just the name changed: applied in place, no reload
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

        if dep.backend is None:
            forget()
        else:
            dep.backend.stop(drain=True, then=forget)  # in-flight requests finish first

    def _release(self, dep: Deployment) -> None:
        backend, dep.backend, dep.loaded_spec = dep.backend, None, None
        if backend is not None:
            backend.stop(drain=True, then=_free_memory)

    def _schedule_load(self, dep: Deployment) -> None:
        owner = _Owner(self, dep, dep.generation, dep.spec, time.time())
        backend = make_backend(dep.spec, owner, self.load_timeout, self.loader)
        self._backends.add(backend)
        if not dep.serving:  # nothing serves meanwhile: status shows the one starting
            previous, dep.backend = dep.backend, backend
            if previous is not None:
                previous.stop(drain=False)
        backend.start()

    # ---- the load turn ----
    def _take_turn(self, turn: "_Turn", waiting: Callable[[str], None] | None = None) -> None:
        """Wait for the one load turn; ``waiting(id)`` hears which deployment holds it, once per holder (called
        without the turn's lock: it takes the manager's)."""
        told = None
        while True:
            with self._turn_cond:
                if self._turn is None:
                    self._turn = turn
                    turn.started = time.monotonic()
                    return
                holder = self._turn.dep.id
                if waiting is None or holder == told:
                    self._turn_cond.wait()
                    continue
            waiting(holder)
            told = holder

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
                dep.set_state(
                    State.FAILED,
                    (
                        f"the model did not finish loading within {self.load_timeout:g}s (DEPCTL_LOAD_TIMEOUT, or "
                        f"`depctl daemon start --load-timeout`): check that its files are readable (not a FIFO or a "
                        f"hung network mount); `depctl deployment update` retries"
                    ),
                )
                self._release(dep)
        log.error("deployment %s: load exceeded %gs; the next load goes ahead", dep.id, self.load_timeout)
        self._end_turn(turn)


@dataclass(eq=False)
class _Turn:
    dep: Deployment
    generation: int
    started: float = 0.0


class _Owner:
    """One backend's line to the manager (``backends.base.Owner``), for one generation of its deployment."""

    def __init__(self, manager: DeploymentManager, dep: Deployment, generation: int, spec: DeploymentSpec, t0: float):
        self.manager, self.dep, self.generation, self.spec, self.t0 = manager, dep, generation, spec, t0

    @contextlib.contextmanager
    def load_turn(self) -> Iterator[None]:
        turn = _Turn(self.dep, self.generation)
        self.manager._take_turn(turn, self._waiting_for)
        try:
            yield
        finally:
            self.manager._end_turn(turn)

    def wanted(self, backend: Backend) -> bool:
        """Loading for the spec as it is, or already the deployment's backend (which a display-name change, say, must
        not stop)."""
        dep = self.dep
        with self.manager._lock:
            return (
                self.manager.deployments.get(dep.id) is dep
                and dep.state != State.DELETING
                and (dep.generation == self.generation or dep.backend is backend)
            )

    def _waiting_for(self, holder: str) -> None:
        """Another deployment's load holds the turn: say so in this one's status while it waits."""
        dep = self.dep
        stage = Stage("waiting", f"for {holder} to finish loading (one load at a time)")
        with self.manager._lock:
            if self.manager.deployments.get(dep.id) is not dep or dep.generation != self.generation:
                return
            if dep.state == State.UPDATING:
                dep.reason = str(stage)
            elif dep.state == State.CREATING:
                dep.set_state(State.CREATING, str(stage))
            else:
                return
            dep.enter(stage)

    def progress(self, backend: Backend, stage: Stage) -> None:
        dep = self.dep
        with self.manager._lock:
            if not self.wanted(backend):
                return
            if dep.state == State.UPDATING and dep.backend is not backend:
                dep.reason = str(stage)  # the previous engine serves until this one is up
            elif dep.state in (State.CREATING, State.FAILED):
                dep.set_state(State.CREATING, str(stage))  # new, or restarting after a crash
            else:
                return
            dep.enter(stage)

    def ready(self, backend: Backend) -> bool:
        """The backend serves from now on and the previous one, if any, is let go; False: it is not wanted."""
        dep = self.dep
        with self.manager._lock:
            if not self.wanted(backend):
                return False
            previous = dep.backend if dep.backend is not backend else None
            dep.backend, dep.loaded_spec = backend, self.spec
            dep.load_seconds = round(time.time() - self.t0, 2)
            dep.ready_at = time.time()
            dep.last_active = time.monotonic()  # keep-alive counts from here: a load longer than it is not idleness
            dep.set_state(State.READY)
        _freeze_heap()
        if previous is not None:
            previous.stop(drain=True, then=_free_memory)  # the old engine finishes what it was serving
        return True

    def failed(self, backend: Backend, reason: str, retrying: bool) -> None:
        dep = self.dep
        with self.manager._lock:
            if not self.wanted(backend):
                return
            dep.set_state(State.FAILED, reason)
            if dep.backend is not backend or not retrying:
                # the previous engine goes too (it no longer matches the spec); a backend still retrying stays the
                # deployment's and serves once it is up
                self.manager._release(dep)

    def exited(self, backend: Backend) -> None:
        with self.manager._lock:
            self.manager._backends.discard(backend)


def _in_place(old: DeploymentSpec, new: DeploymentSpec, backend: Backend) -> bool:
    """Only the name, or a draft token count the backend takes without a restart, changed."""
    if not _reload_needed(old, new, k_in_place=False):
        return True
    k = getattr(new.speculation, "num_draft_tokens", 0)
    return not _reload_needed(old, new, k_in_place=True) and backend.set_num_draft_tokens(k)


def _freeze_heap() -> None:
    """Collect, then move every object alive out of the collector's reach (``gc.freeze``): a loaded model is hundreds
    of thousands of objects, and a full collection walks them all on whichever thread triggers it, the GIL held: on
    the event loop, every stream stalls meanwhile. Frozen objects are still freed when their last reference
    goes; ``_free_memory`` unfreezes to reclaim cycles."""
    import gc

    gc.collect()
    gc.freeze()


def _free_memory() -> None:
    """After an engine let go of its model: collect everything, its reference cycles included, then freeze again;
    and hand the freed heap back to the system. glibc keeps freed blocks below its mmap threshold (a model's weights,
    after the first large free raises it) in its arenas, and a daemon grew by about that much a reload."""
    import ctypes
    import gc

    import torch

    gc.unfreeze()
    _freeze_heap()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): its allocator decides
        pass
