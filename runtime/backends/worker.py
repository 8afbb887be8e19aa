"""The engine thread: every loaded engine of the process is stepped by one ``EngineHost`` thread, round robin.

torch's CPU kernels run on an OpenMP pool owned by the thread that first ran a parallel region, and an idle pool
beside a busy one slows it (more OpenMP threads than cores, each region waiting for a wake-up). So a deployment is
loaded on a thread of its own, which exits once it hands its engine to the host, and every step of every deployment
runs on the host's one thread and one pool.

Other threads talk to an ``EngineWorker`` only through typed messages in its inbox (``Submit``, ``Cancel``,
``SetDraftTokens``, ``Stop``); outputs go back through each request's sink, called on the engine thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import traceback
from dataclasses import dataclass
from typing import Callable

from depctl_runtime.backends.loader import LoadedDeployment
from depctl_runtime.speculation import GenerationParams, Scheduler, Sequence, StepOutput

log = logging.getLogger("depctl.worker")

Sink = Callable[[object], None]  # receives StepOutputs, then possibly an exception; called on the engine thread


class Handle:
    """A submitted request, as its submitter sees it."""

    def __init__(self, worker: EngineWorker):
        self._worker = worker
        self.seq: Sequence | None = None  # set on the engine thread once the request is admitted

    def cancel(self) -> None:
        self._worker.post(Cancel(self))


@dataclass(frozen=True)
class Submit:
    handle: Handle
    prompt_ids: list[int]
    params: GenerationParams
    sink: Sink


@dataclass(frozen=True)
class Cancel:
    handle: Handle


@dataclass(frozen=True)
class SetDraftTokens:
    k: int


@dataclass(frozen=True)
class Stop:
    drain: bool  # finish the requests already submitted first
    then: Callable[[], None] | None = None


Message = Submit | Cancel | SetDraftTokens | Stop


class EngineWorker:
    """One deployment's loaded engine and its scheduler, stepped by the ``EngineHost``."""

    def __init__(
        self,
        name: str,
        loaded: LoadedDeployment,
        max_batch_size: int,
        host: EngineHost,
        on_crash: Callable[[BaseException], None],
    ):
        self.name = name
        self.loaded = loaded
        self.max_batch_size = max_batch_size
        # None once exited; idle time also trains a learning head (``loaded.learner``)
        self.scheduler: Scheduler | None = Scheduler(loaded.engine, max_batch_size, background=loaded.learner)
        self._host = host
        self._on_crash = on_crash
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._sinks: dict[int, Sink] = {}
        self._stopping: Stop | None = None
        self._thens: list[Callable[[], None] | None] = []  # every stop's ``then``, run on exit
        self._exit_lock = threading.Lock()
        self.exited = threading.Event()

    # ---- any thread ----
    def submit(self, prompt_ids: list[int], params: GenerationParams, sink: Sink) -> Handle:
        handle = Handle(self)
        self.post(Submit(handle, prompt_ids, params, sink))
        return handle

    def post(self, msg: Message) -> None:
        with self._exit_lock:
            if not self.exited.is_set():
                self._inbox.put(msg)
                self._host.wake(self)
                return
        _refuse(msg)  # the worker has gone: answer the message here

    @property
    def num_running(self) -> int:
        scheduler = self.scheduler
        return scheduler.num_running if scheduler else 0

    @property
    def num_waiting(self) -> int:
        scheduler = self.scheduler
        return (scheduler.num_waiting if scheduler else 0) + self._inbox.qsize()

    # ---- the engine thread ----
    @property
    def busy(self) -> bool:
        """Has steps to take, or a stop to carry out (a drain that just ended must not wait for more mail)."""
        return self.scheduler.has_work() or self._stopping is not None

    @property
    def has_idle_work(self) -> bool:
        """Work for when no deployment has requests (``Scheduler.idle``)."""
        scheduler = self.scheduler
        return scheduler is not None and self._stopping is None and scheduler.has_idle_work()

    def idle_tick(self) -> None:
        """A slice of idle work; a failure there is logged and the idle work dropped, never the deployment."""
        try:
            self.scheduler.idle()
        except Exception:  # noqa: BLE001 - the prefix cache misses what it would have kept; requests are untouched
            log.exception("deployment %s: reading finished answers into the prefix cache failed", self.name)
            self.scheduler.answers.clear()
            self.scheduler.abandon()

    def tick(self) -> bool:
        """Read the inbox, then take one step if there is work; False once the worker has exited."""
        try:
            self._read_inbox()
            if self._stopping is not None and (not self._stopping.drain or not self.scheduler.has_work()):
                self._exit(None)
                return False
            if self.scheduler.has_work():
                self._step()
            return True
        except BaseException as exc:  # noqa: BLE001 - a bug here must not leave a READY deployment nobody serves
            log.error(
                "deployment %s: the engine thread failed: %s", self.name, "".join(traceback.format_exception(exc))
            )
            self._exit(exc)
            return False

    def _read_inbox(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._handle(msg)

    def _handle(self, msg: Message) -> None:
        match msg:
            case Submit(handle, prompt_ids, params, sink):
                try:
                    seq = self.scheduler.engine.new_sequence(prompt_ids, params)
                except Exception as exc:  # noqa: BLE001 - a request the engine refuses fails alone
                    _deliver(sink, exc)
                    return
                handle.seq = seq
                self._sinks[seq.id] = sink
                self.scheduler.add(seq)
            case Cancel(handle):
                if handle.seq is not None and handle.seq.id in self._sinks:
                    self.scheduler.cancel(handle.seq)
            case SetDraftTokens(k):
                self.scheduler.engine.set_num_draft_tokens(k)
            case Stop(drain, then):
                if self._stopping is None or not drain:  # an immediate stop overrides a drain
                    self._stopping = msg
                self._thens.append(then)

    def _step(self) -> None:
        try:
            outputs = self.scheduler.step()
        except Exception as exc:  # noqa: BLE001 - the batch's shared work failed: the requests in it end, never the
            # deployment, and each is told generically (the exception may quote any row's state); the waiting stay
            ended = self.scheduler.abandon()
            log.error(
                "deployment %s: a step over requests %s failed: %s",
                self.name,
                [seq.id for seq in ended],
                "".join(traceback.format_exception(exc)),
            )
            outputs = [(seq, StepOutput([], "error", error=seq.fault)) for seq in ended]
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

    def _exit(self, crash: BaseException | None) -> None:
        if crash is not None:
            self._fail_all(crash)
            self._on_crash(crash)
        self._fail_all(RuntimeError("the deployment was stopped before this request finished"))
        with self._exit_lock:
            self.exited.set()
        thens = self._thens
        while True:  # what arrived after the stop: answered here
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(msg, Stop):
                thens.append(msg.then)
            else:
                _refuse(msg)
        self.loaded.release()  # every request has ended: nothing runs this engine again
        self.loaded = self.scheduler = None
        for then in thens:
            if then is not None:
                then()


def _refuse(msg: Message) -> None:
    match msg:
        case Submit(sink=sink):
            _deliver(sink, RuntimeError("the deployment is not serving"))
        case Stop(then=then) if then is not None:
            then()


class EngineHost:
    """The process's one engine thread: steps every attached worker, one step each in turn, and sleeps when none has
    work until a worker gets mail."""

    _instance: EngineHost | None = None
    _instance_lock = threading.Lock()

    @classmethod
    def get(cls) -> EngineHost:
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def __init__(self):
        self._mail: queue.SimpleQueue[EngineWorker] = queue.SimpleQueue()  # workers with something new in their inbox
        self._workers: list[EngineWorker] = []
        self.thread = threading.Thread(target=self._run, name="depctl-engine", daemon=True)
        self.thread.start()

    def wake(self, worker: EngineWorker) -> None:
        """``worker`` has mail (a worker's first mail attaches it)."""
        self._mail.put(worker)

    def _run(self) -> None:
        while True:
            try:
                idle = not any(w.busy or w.has_idle_work for w in self._workers)
                worker = self._mail.get(block=idle)
            except queue.Empty:
                worker = None
            while worker is not None:  # take all the mail: new workers join the round
                if worker not in self._workers and not worker.exited.is_set():
                    self._workers.append(worker)
                try:
                    worker = self._mail.get_nowait()
                except queue.Empty:
                    worker = None
            for w in list(self._workers):
                try:
                    alive = w.tick()  # (catches its own failures; this guards the thread every deployment needs)
                except BaseException:  # noqa: BLE001
                    log.exception("deployment %s: leaving the engine thread failed", w.name)
                    alive = False
                if not alive:
                    self._workers.remove(w)
            if not any(w.busy for w in self._workers):  # no requests anywhere: one deployment's idle work
                for w in self._workers:
                    if w.has_idle_work:
                        w.idle_tick()
                        break


def _deliver(sink: Sink, item: object) -> None:
    try:
        sink(item)
    except Exception:  # a consumer that went away must not stop the batch
        log.exception("delivering an output failed")
