"""EngineWorker: a deployment's engine, loaded on a thread of its own, then stepped by the process's one engine thread.

torch's CPU kernels run on an OpenMP pool that belongs to the thread that first ran a parallel region. A pool whose
thread is alive but idle slows the pool that works: the process then has more OpenMP threads than cores, and libgomp
lets a worker spin only briefly before it sleeps, so each of a step's hundreds of small parallel regions waits for a
wake-up (measured on 2 cores, SmolLM2 bf16: 22-35 ms a forward alone or after another thread's pool had exited,
39-58 ms beside a live idle one; a daemon with a second, idle deployment decoded at 23-26 tok/s against 41). So:

- a worker's own thread loads the weights and calibrates (a load takes seconds to minutes and must not stall the
  deployments that serve), then hands the engine to the ``EngineHost`` and exits, and its pool with it;
- the ``EngineHost`` thread runs every prefill and batch step of every deployment, round robin, on one pool.

Other threads talk to a worker through its inbox: ``submit`` a request (its outputs go to a callback, called on the
engine thread), ``cancel`` it, change K, ``stop``.
"""

from __future__ import annotations

import logging
import queue
import threading
import traceback
from typing import Callable

from depctl.errors import DepctlError
from runtime.engine import GenerationParams, Scheduler, StepOutput

log = logging.getLogger("depctl.worker")

Sink = Callable[[object], None]  # receives StepOutputs, then possibly an exception; called on the worker thread


class Handle:
    """A submitted request, as its submitter sees it."""

    def __init__(self, worker: "EngineWorker"):
        self._worker = worker
        self.seq = None  # set on the worker thread once the request is admitted to the queue

    def cancel(self) -> None:
        self._worker._inbox.put(("cancel", self))


class EngineWorker:
    def __init__(self, name: str, load: Callable[[], object], on_loaded: Callable[["EngineWorker", object], bool],
                 on_failed: Callable[["EngineWorker", BaseException], None], max_batch_size: int):
        self.name = name
        self.loaded = None  # a LoadedDeployment once loading succeeded
        self.scheduler: Scheduler | None = None
        self.max_batch_size = max_batch_size
        self._load, self._on_loaded, self._on_failed = load, on_loaded, on_failed
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[int, Sink] = {}
        self._stopping: tuple[bool, Callable[[], None] | None] | None = None  # (drain, then)
        self._exit_lock = threading.Lock()
        self._exited = False
        self._host: EngineHost | None = None  # set once loaded: the engine thread steps it from then on
        self.thread = threading.Thread(target=self._run, name=f"depctl-load-{name}", daemon=True)

    # ---- any thread ----
    def start(self) -> "EngineWorker":
        self.thread.start()
        return self

    def submit(self, prompt_ids: list[int], params: GenerationParams, sink: Sink) -> Handle:
        handle = Handle(self)
        self._post(("add", handle, prompt_ids, params, sink))
        return handle

    def set_num_draft_tokens(self, k: int) -> None:
        self._post(("k", k))

    def stop(self, drain: bool = True, then: Callable[[], None] | None = None) -> None:
        """Stop after the requests already submitted finish (``drain``) or at once; ``then`` runs on exit."""
        with self._exit_lock:
            if not self._exited:
                self._post(("stop", drain, then))
                return
        if then is not None:
            then()

    def _post(self, msg: tuple) -> None:
        self._inbox.put(msg)
        if self._host is not None:
            self._host.wake(self)

    @property
    def num_running(self) -> int:
        s = self.scheduler
        return s.num_running if s else 0

    @property
    def num_waiting(self) -> int:
        s = self.scheduler
        return (s.num_waiting if s else 0) + self._inbox.qsize()

    # ---- the worker thread ----
    def _run(self) -> None:
        try:
            loaded = self._load()
        except BaseException as exc:  # noqa: BLE001 - every failure ends in FAILED with its reason
            self._on_failed(self, exc)
            self._finish_stop()
            return
        self.loaded = loaded
        self.scheduler = Scheduler(loaded.engine, self.max_batch_size)
        if not self._on_loaded(self, loaded):  # superseded while loading: nobody will send requests here
            self.loaded = self.scheduler = None
            self._finish_stop()
            return
        EngineHost.get().attach(self)  # this thread ends here, and its OpenMP pool with it

    # ---- on the engine thread (EngineHost) ----
    def _tick(self) -> bool:
        """Read the inbox, then take one step if there is work; False once the worker has exited."""
        try:
            self._read_inbox()
            if self._stopping is not None and (not self.scheduler.has_work() or not self._stopping[0]):
                self._exit(None)
                return False
            if self.scheduler.has_work():
                self._step()
            return True
        except BaseException as exc:  # noqa: BLE001 - a bug here must not leave a READY deployment nobody serves
            log.error("deployment %s: the engine thread failed: %s", self.name, "".join(traceback.format_exception(exc)))
            self._exit(exc)
            return False

    def _exit(self, crash: BaseException | None) -> None:
        if crash is not None:
            self._fail_all(crash)
            self._on_failed(self, DepctlError(f"the engine thread failed ({type(crash).__name__}: {crash}); see "
                                              "`depctl daemon logs`; `depctl deployment update` reloads it"))
        self._fail_all(RuntimeError("the deployment was stopped before this request finished"))
        self.loaded = self.scheduler = None
        self._finish_stop()

    @property
    def busy(self) -> bool:
        """Has steps to take, or a stop to carry out (a drain that just ended must not wait for more mail)."""
        return self.scheduler is not None and (self.scheduler.has_work() or self._stopping is not None)

    def _read_inbox(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._handle(msg)

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "add":
            _, handle, prompt_ids, params, sink = msg
            try:
                seq = self.scheduler.engine.new_sequence(prompt_ids, params)
            except Exception as exc:  # noqa: BLE001 - a request the engine refuses fails alone
                _deliver(sink, exc)
                return
            handle.seq = seq
            self._sinks[seq.id] = sink
            self.scheduler.add(seq)
        elif kind == "cancel":
            seq = msg[1].seq
            if seq is not None and seq.id in self._sinks:
                self.scheduler.cancel(seq)
        elif kind == "k":
            self.scheduler.engine.set_num_draft_tokens(msg[1])
        elif kind == "stop":
            self._stopping = (msg[1], msg[2])

    def _step(self) -> None:
        try:
            outputs = self.scheduler.step()
        except Exception as exc:  # a failed step fails the requests in it, never the deployment
            log.error("deployment %s: a step failed: %s", self.name, "".join(traceback.format_exception(exc)))
            self._fail_all(exc)
            self.scheduler = Scheduler(self.scheduler.engine, self.max_batch_size)
            for row in range(self.scheduler.engine.max_rows):
                self.scheduler.engine.release_row(row)
            return
        for seq, out in outputs:
            sink = self._sinks.get(seq.id)
            if out.finish_reason:
                self._sinks.pop(seq.id, None)
            if sink is not None:
                _deliver(sink, out)

    def _fail_all(self, exc: BaseException) -> None:
        sinks, self._sinks = self._sinks, {}
        for sink in sinks.values():
            _deliver(sink, exc)

    def _finish_stop(self) -> None:
        """Exit: answer whatever is still in the inbox, then run the ``then`` of every stop request."""
        with self._exit_lock:
            self._exited = True
        thens = [self._stopping[1]] if self._stopping else []
        try:
            while True:
                msg = self._inbox.get_nowait()
                if msg[0] == "stop":
                    thens.append(msg[2])
                elif msg[0] == "add":
                    _deliver(msg[4], RuntimeError("the deployment is not serving"))
        except queue.Empty:
            pass
        for then in thens:
            if then is not None:
                then()


class EngineHost:
    """The process's one engine thread: steps every attached worker, one step each in turn, and sleeps when none has
    work until a worker gets mail."""

    _instance: "EngineHost | None" = None
    _instance_lock = threading.Lock()

    @classmethod
    def get(cls) -> "EngineHost":
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def __init__(self):
        self._mail: queue.SimpleQueue = queue.SimpleQueue()  # workers with something new in their inbox
        self._workers: list[EngineWorker] = []
        self.thread = threading.Thread(target=self._run, name="depctl-engine", daemon=True)
        self.thread.start()

    def attach(self, worker: EngineWorker) -> None:
        worker._host = self
        self._mail.put(worker)

    def wake(self, worker: EngineWorker) -> None:
        self._mail.put(worker)

    def _run(self) -> None:
        while True:
            try:
                worker = self._mail.get(block=not any(w.busy for w in self._workers))
            except queue.Empty:
                worker = None
            while worker is not None:  # take all the mail: new workers join the round
                if worker not in self._workers and worker.scheduler is not None:
                    self._workers.append(worker)
                try:
                    worker = self._mail.get_nowait()
                except queue.Empty:
                    worker = None
            for w in list(self._workers):
                try:
                    alive = w._tick()  # (catches its own failures; this guards the thread every deployment needs)
                except BaseException:  # noqa: BLE001
                    log.exception("deployment %s: leaving the engine thread failed", w.name)
                    alive = False
                if not alive:
                    self._workers.remove(w)


def _deliver(sink: Sink, item: object) -> None:
    try:
        sink(item)
    except Exception:  # a consumer that went away must not stop the batch
        log.exception("delivering an output failed")


__all__ = ["EngineHost", "EngineWorker", "Handle", "StepOutput"]
