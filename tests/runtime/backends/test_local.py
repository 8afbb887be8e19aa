"""LocalBackend and the engine thread: a thread of its own loads and calibrates a deployment's engine, the one engine
thread steps it; requests come through the worker's typed inbox."""

from __future__ import annotations

import contextlib
import queue
import threading

from depctl.spec import DeploymentSpec, NgramSpeculation
from depctl_runtime.backends.loader import load_deployment
from depctl_runtime.backends.local import LocalBackend
from depctl_runtime.backends.worker import EngineHost
from depctl_runtime.kernels.surgery import BlockedLinear, OneDNNLinear, WeightMajorLinear
from depctl_runtime.speculation import GenerationParams


class RecordingOwner:
    """The manager's side, reduced to what a test checks: the backend's reports."""

    def __init__(self):
        self.ready_event, self.failures, self.progress_messages, self.exits = threading.Event(), [], [], 0

    @contextlib.contextmanager
    def load_turn(self):
        yield

    def wanted(self, backend) -> bool:
        return True

    def progress(self, backend, stage) -> None:
        self.progress_messages.append(str(stage))

    def ready(self, backend) -> bool:
        self.ready_event.set()
        return True

    def failed(self, backend, reason: str, retrying: bool) -> None:
        self.failures.append(reason)
        self.ready_event.set()

    def exited(self, backend) -> None:
        self.exits += 1


def _start(spec, torch_threads: set | None = None, calibrate: bool = True):
    loaded_on = {}

    def load(spec, report):
        loaded = load_deployment(spec, calibrate=calibrate, report=report)  # loading and calibration run here
        loaded_on["thread"] = threading.current_thread()
        if torch_threads is not None:  # the output layer runs in every forward, transformers' or ours
            loaded.engine.target.model.get_output_embeddings().register_forward_hook(
                lambda *_: torch_threads.add(threading.get_ident())
            )
        return loaded

    owner = RecordingOwner()
    backend = LocalBackend(spec, owner, loader=load)
    backend.start()
    assert owner.ready_event.wait(600), "the load did not finish"  # a cold cache compiles first
    return backend, owner, loaded_on


def _collect(q: queue.SimpleQueue) -> list[int]:
    tokens = []
    while True:
        out = q.get(timeout=60)
        tokens += out.token_ids
        if out.finish_reason:
            return tokens


def test_one_thread_does_all_torch_work_and_requests_batch(tiny_model_dir):
    spec = DeploymentSpec(
        id="w",
        model=str(tiny_model_dir),
        max_batch_size=4,
        device="cpu",
        dtype="float32",
        speculation=NgramSpeculation(ngram_length=2, num_draft_tokens=4),
    )
    torch_threads: set = set()
    backend, owner, loaded_on = _start(spec, torch_threads)
    assert backend.ready and not owner.failures
    # the load's stages are reported
    assert any(m.startswith(("calibrating: ", "warming up: ")) for m in owner.progress_messages)
    # the loader's surgery is a module swap, visible on the model the engine runs
    modules = backend.loaded.engine.target.model.modules()
    assert any(isinstance(m, (BlockedLinear, OneDNNLinear, WeightMajorLinear)) for m in modules)
    outputs = [queue.SimpleQueue() for _ in range(6)]
    params = GenerationParams(max_tokens=20, ignore_eos=True)
    for i, q in enumerate(outputs):  # submitted from this (another) thread
        backend.worker.submit([5, 17, 42, i, 3], params, q.put)
    assert all(len(_collect(q)) == 20 for q in outputs)
    # loading ran on a thread of its own, which then ended; every step ran on the one engine thread
    loaded_on["thread"].join(10)
    assert not loaded_on["thread"].is_alive()
    assert torch_threads == {EngineHost.get().thread.ident}
    done = threading.Event()
    backend.stop(drain=True, then=done.set)
    assert done.wait(30) and backend.wait_stopped(1) and not backend.ready and owner.exits == 1


def test_a_request_that_cannot_run_gets_an_error_not_a_hang(tiny_model_dir):
    backend, _, _ = _start(DeploymentSpec(id="w", model=str(tiny_model_dir), device="cpu"), calibrate=False)
    out = queue.SimpleQueue()
    backend.worker.submit([], GenerationParams(), out.put)  # an empty prompt
    assert isinstance(out.get(timeout=60), ValueError)
    stopped = threading.Event()
    backend.stop(drain=False, then=stopped.set)
    assert stopped.wait(30)


def test_a_drain_that_ends_with_the_last_request_exits(tiny_model_dir):
    # the bug: stop(drain=True) arriving while a request ran left the thread blocked on its inbox once the request
    # finished: the deleted deployment never went away
    backend, _, _ = _start(DeploymentSpec(id="w", model=str(tiny_model_dir), device="cpu"), calibrate=False)
    out, worker = queue.SimpleQueue(), backend.worker
    worker.submit([5, 17, 42], GenerationParams(max_tokens=200, ignore_eos=True), out.put)
    stopped = threading.Event()
    backend.stop(drain=True, then=stopped.set)
    assert len(_collect(out)) == 200  # drained: the request ran to its end
    assert stopped.wait(10)
    late = queue.SimpleQueue()
    worker.submit([5, 17], GenerationParams(), late.put)  # after the exit: refused, not lost
    assert isinstance(late.get(timeout=10), RuntimeError)


def test_a_stop_while_loading_drops_the_engine_and_runs_then_at_once(tiny_model_dir):
    release, owner = threading.Event(), RecordingOwner()

    def slow_load(spec, report):
        release.wait(30)
        return load_deployment(spec, calibrate=False, report=report)

    backend = LocalBackend(DeploymentSpec(id="w", model=str(tiny_model_dir), device="cpu"), owner, loader=slow_load)
    backend.start()
    stopped = threading.Event()
    backend.stop(drain=True, then=stopped.set)
    assert stopped.is_set()  # nothing to drain while loading
    release.set()
    for _ in range(600):
        if owner.exits:
            break
        threading.Event().wait(0.1)
    assert owner.exits == 1 and not owner.ready_event.is_set() and not backend.ready


def test_an_engine_thread_that_crashes_fails_its_requests_and_reports(tiny_model_dir):
    backend, owner, _ = _start(DeploymentSpec(id="w", model=str(tiny_model_dir), device="cpu"), calibrate=False)
    worker = backend.worker
    worker._step = None  # a bug in the loop itself: calling it raises TypeError
    out = queue.SimpleQueue()
    worker.submit([5, 17, 42], GenerationParams(max_tokens=5), out.put)
    assert isinstance(out.get(timeout=30), TypeError)
    assert worker.exited.wait(10) and "engine thread failed" in owner.failures[0]
    assert not backend.ready and owner.exits == 1 and backend.wait_stopped(1)


def test_status_counts_the_weights_as_held_packed_ones_at_their_packed_size(tiny_model_dir):
    from depctl_runtime.kernels.quantized import packed_bytes

    held = {}
    for quantization in ("none", "int4"):
        spec = DeploymentSpec(
            id=f"m-{quantization}",
            model=str(tiny_model_dir),
            device="cpu",
            dtype="float32",
            compile=False,
            quantization=quantization,
        )
        backend, owner, _ = _start(spec, calibrate=False)
        assert backend.ready and not owner.failures
        status, model = backend.status(), backend.loaded.target.model
        assert 0 < status["weights_bytes"] <= status["memory_bytes"]  # and the KV cache, once allocated
        tensors = {t.data_ptr(): t.nbytes for t in (*model.parameters(), *model.buffers())}  # tied ones count once
        assert status["weights_bytes"] == sum(tensors.values())  # packed weights are buffers, at their own size
        assert (packed_bytes(model) > 0) == (quantization == "int4")
        held[quantization] = status["weights_bytes"]
        done = threading.Event()
        backend.stop(drain=True, then=done.set)
        assert done.wait(30)
    assert held["int4"] < held["none"]
