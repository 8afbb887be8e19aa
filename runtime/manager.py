"""The deployment manager: reconciles the spec store (what users asked for) with what is loaded (what is).

The daemon owns status; it never writes into a spec. States (as Fireworks and dstack name them):

    CREATING -> READY | FAILED        a new spec is being loaded
    READY -> UPDATING -> READY | FAILED   the spec changed in a way that needs a reload (the old engine keeps
                                      serving meanwhile); a draft-token-count change applies in place
    any -> DELETING -> (gone)         the spec file was removed; in-flight requests finish first

A spec file that does not parse shows up as FAILED with the file and the problem, and touches no other
deployment. Loads run one at a time on a single loader thread so two big models never load at once.
Reconciling happens on a poll of the store (every ``POLL_SECONDS``) and at once when the CLI calls
``POST /depctl/v1/reconcile`` after a write.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from depctl.errors import DepctlError
from depctl.spec import DeploymentSpec, describe_speculation
from depctl.store import SpecStore
from runtime.loader import LoadedDeployment, LoadError, load_deployment

log = logging.getLogger("depctl.manager")

POLL_SECONDS = 2.0


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
    loaded: LoadedDeployment | None = None
    loaded_spec: DeploymentSpec | None = None  # the spec the loaded engine was built from
    generation: int = 0  # bumps on every spec change; a load for an older generation is discarded
    lock: threading.Lock = field(default_factory=threading.Lock)  # one sequence at a time through the engine
    state_since: float = field(default_factory=time.time)
    ready_at: float | None = None
    load_seconds: float | None = None
    waiting: int = 0  # requests queued behind the lock

    def set_state(self, state: State, reason: str | None = None) -> None:
        if state != self.state:
            log.info("deployment %s: %s -> %s%s", self.id, self.state.value, state.value, f" ({reason})" if reason else "")
        self.state = state
        self.reason = reason
        self.state_since = time.time()

    def status(self) -> dict:
        spec = self.spec or self.loaded_spec
        engine = self.loaded.engine if self.loaded else None
        out = {
            "id": self.id,
            "state": self.state.value,
            "reason": self.reason,
            "state_since": self.state_since,
            "model": spec.model if spec else None,
            "speculation": describe_speculation(spec.speculation) if spec else None,
            "ready_at": self.ready_at,
            "load_seconds": self.load_seconds,
            "queued_requests": self.waiting,
        }
        if self.loaded:
            out["device"] = str(self.loaded.target.device)
            out["dtype"] = str(self.loaded.target.dtype).removeprefix("torch.")
            if self.loaded.draft is not None:
                out["draft_precision"] = self.loaded.draft.precision
            out["max_context"] = self.loaded.max_context
            out["stats"] = engine.stats.to_dict()
            out["policy"] = engine.policy.snapshot()
        return out


Loader = Callable[[DeploymentSpec], LoadedDeployment]


def _reload_needed(old: DeploymentSpec, new: DeploymentSpec) -> bool:
    """Everything but the draft token count, the display name and timestamps needs new weights or a new proposer."""

    def key(spec: DeploymentSpec) -> tuple:
        s = spec.speculation.model_dump()
        s.pop("num_draft_tokens", None)
        return (spec.model, spec.device, spec.dtype, tuple(sorted(s.items())))

    return key(old) != key(new)


class DeploymentManager:
    def __init__(self, store: SpecStore, loader: Loader = load_deployment):
        self.store = store
        self.loader = loader
        self.deployments: dict[str, Deployment] = {}
        self._lock = threading.RLock()  # guards self.deployments and state transitions
        self._loads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="depctl-loader")
        self._stop = threading.Event()
        self._fingerprint: dict | None = None
        self._poller: threading.Thread | None = None

    # ---- lifecycle ----
    def start(self) -> None:
        self.reconcile()
        self._poller = threading.Thread(target=self._poll, name="depctl-poll", daemon=True)
        self._poller.start()

    def stop(self) -> None:
        self._stop.set()
        self._loads.shutdown(wait=False, cancel_futures=True)

    def _poll(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            try:
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
            for b in broken:
                self._on_broken(b.id, b.problem)
            for spec in specs:
                self._on_spec(spec)
            for dep_id in list(self.deployments):
                if dep_id not in wanted and dep_id not in {b.id for b in broken}:
                    self._on_deleted(self.deployments[dep_id])

    def _on_spec(self, spec: DeploymentSpec) -> None:
        dep = self.deployments.get(spec.id)
        if dep is None:
            dep = self.deployments[spec.id] = Deployment(spec.id, spec, State.CREATING)
            self._schedule_load(dep)
            return
        if dep.spec == spec:
            return  # unchanged (a FAILED deployment is retried when its spec changes or the daemon restarts)
        dep.spec = spec
        dep.generation += 1
        if dep.loaded is not None and dep.loaded_spec is not None and not _reload_needed(dep.loaded_spec, spec):
            # the draft token count (or just the name) changed: apply in place, no reload
            k = getattr(spec.speculation, "num_draft_tokens", 0)
            dep.loaded.engine.set_num_draft_tokens(k)
            dep.loaded_spec = spec
            dep.set_state(State.READY)
            return
        dep.set_state(State.UPDATING if dep.loaded is not None else State.CREATING)
        self._schedule_load(dep)

    def _on_broken(self, dep_id: str, problem: str) -> None:
        dep = self.deployments.get(dep_id)
        reason = f"the spec file is broken: {problem}"
        if dep is None:
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

        def finish() -> None:
            with dep.lock:  # in-flight requests finish first
                dep.loaded = None
            with self._lock:
                if self.deployments.get(dep.id) is dep and dep.state == State.DELETING:
                    del self.deployments[dep.id]
            _free_memory()

        threading.Thread(target=finish, name=f"depctl-delete-{dep.id}", daemon=True).start()

    def _release(self, dep: Deployment) -> None:
        def release() -> None:
            with dep.lock:
                dep.loaded = None
                dep.loaded_spec = None
            _free_memory()

        threading.Thread(target=release, daemon=True).start()

    def _schedule_load(self, dep: Deployment) -> None:
        generation, spec = dep.generation, dep.spec
        self._loads.submit(self._load, dep, generation, spec)

    def _load(self, dep: Deployment, generation: int, spec: DeploymentSpec) -> None:
        with self._lock:
            if dep.generation != generation:
                return  # superseded by a newer spec (or deleted) while queued
        t0 = time.time()
        try:
            loaded = self.loader(spec)
        except (LoadError, DepctlError) as exc:
            loaded, error = None, getattr(exc, "message", None) or str(exc)
        except Exception as exc:  # an unexpected failure still ends in FAILED, with the type named
            log.exception("loading %s failed", dep.id)
            loaded, error = None, f"{type(exc).__name__}: {exc}".splitlines()[0]
        else:
            error = None
        with self._lock:
            if dep.generation != generation or self.deployments.get(dep.id) is not dep:
                return  # stale: drop what we loaded
            if loaded is None:
                dep.set_state(State.FAILED, error)
                self._release(dep)
                return
            previous = dep.loaded
            dep.loaded, dep.loaded_spec = loaded, spec
            dep.load_seconds = round(time.time() - t0, 2)
            dep.ready_at = time.time()
            dep.set_state(State.READY)
        if previous is not None:
            del previous  # the old engine's weights go once in-flight requests drop their references
            _free_memory()


def _free_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
