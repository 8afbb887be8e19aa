"""EngineWorker: a thread of its own loads and calibrates a deployment's engine, the one engine thread steps it;
requests come through its inbox."""

from __future__ import annotations

import queue
import threading

from depctl.spec import DeploymentSpec, NgramSpeculation
from runtime.engine import GenerationParams
from runtime.engine.surgery import BlockedLinear, OneDNNLinear, WeightMajorLinear
from runtime.loader import load_deployment
from runtime.worker import EngineHost, EngineWorker


def _start(spec, torch_threads: set, ready: threading.Event):
    loaded_on = {}

    def load():
        loaded = load_deployment(spec)  # loading and calibration run here, on the worker thread
        loaded_on["thread"] = threading.get_ident()
        # the output layer runs in every forward, transformers' or ours (runtime.engine.decoder)
        loaded.engine.target.model.get_output_embeddings().register_forward_hook(
            lambda *_: torch_threads.add(threading.get_ident()))
        return loaded

    def on_loaded(worker, loaded):
        ready.set()
        return True

    worker = EngineWorker("t", load, on_loaded, lambda w, exc: ready.set(), spec.max_batch_size).start()
    return worker, loaded_on


def test_one_thread_does_all_torch_work_and_requests_batch(tiny_model_dir):
    spec = DeploymentSpec(id="w", model=str(tiny_model_dir), max_batch_size=4, device="cpu", dtype="float32",
                          speculation=NgramSpeculation(ngram_length=2, num_draft_tokens=4))
    torch_threads, ready = set(), threading.Event()
    worker, loaded_on = _start(spec, torch_threads, ready)
    assert ready.wait(60) and worker.loaded is not None
    # the loader's surgery is a module swap, visible on the model the engine runs
    assert any(isinstance(m, (BlockedLinear, OneDNNLinear, WeightMajorLinear)) for m in worker.loaded.engine.target.model.modules())
    outputs = [queue.SimpleQueue() for _ in range(6)]
    params = GenerationParams(max_tokens=20, ignore_eos=True)
    for i, q in enumerate(outputs):  # submitted from this (another) thread
        worker.submit([5, 17, 42, i, 3], params, q.put)
    texts = []
    for q in outputs:
        tokens = []
        while True:
            out = q.get(timeout=60)
            tokens += out.token_ids
            if out.finish_reason:
                break
        texts.append(tokens)
    assert all(len(t) == 20 for t in texts)
    # loading ran on the worker's own thread, which then ended; every step ran on the one engine thread
    assert loaded_on["thread"] == worker.thread.ident and not worker.thread.is_alive()
    assert torch_threads == {EngineHost.get().thread.ident}
    done = threading.Event()
    worker.stop(drain=True, then=done.set)
    assert done.wait(30)
    worker.thread.join(10)
    assert not worker.thread.is_alive()


def test_a_request_that_cannot_run_gets_an_error_not_a_hang(tiny_model_dir):
    spec = DeploymentSpec(id="w", model=str(tiny_model_dir), device="cpu")
    worker, _ = _start(spec, set(), threading.Event())
    out = queue.SimpleQueue()
    worker.submit([], GenerationParams(), out.put)  # an empty prompt
    assert isinstance(out.get(timeout=60), ValueError)
    stopped = threading.Event()
    worker.stop(drain=False, then=stopped.set)
    assert stopped.wait(30)


def test_a_drain_that_ends_with_the_last_request_exits(tiny_model_dir):
    # the bug: stop(drain=True) arriving while a request ran left the thread blocked on its inbox once the request
    # finished: the deleted deployment never went away
    spec = DeploymentSpec(id="w", model=str(tiny_model_dir), device="cpu")
    ready = threading.Event()
    worker, _ = _start(spec, set(), ready)
    assert ready.wait(60)
    out = queue.SimpleQueue()
    worker.submit([5, 17, 42], GenerationParams(max_tokens=200, ignore_eos=True), out.put)
    stopped = threading.Event()
    worker.stop(drain=True, then=stopped.set)
    tokens, item = 0, None
    while item is None or not item.finish_reason:
        item = out.get(timeout=60)
        tokens += len(item.token_ids)
    assert tokens == 200  # drained: the request ran to its end
    assert stopped.wait(10)


def test_an_engine_thread_that_crashes_fails_its_requests_and_reports(tiny_model_dir):
    spec = DeploymentSpec(id="w", model=str(tiny_model_dir), device="cpu")
    ready, failures = threading.Event(), []

    def on_failed(worker, exc):
        failures.append(exc)
        ready.set()

    worker = EngineWorker("w", lambda: load_deployment(spec, calibrate=False), lambda w, l: ready.set() or True,
                          on_failed, 1).start()
    assert ready.wait(60)
    ready.clear()
    worker._step = None  # a bug in the loop itself: calling it raises TypeError
    out = queue.SimpleQueue()
    worker.submit([5, 17, 42], GenerationParams(max_tokens=5), out.put)
    assert isinstance(out.get(timeout=30), TypeError)
    assert ready.wait(10) and "engine thread failed" in str(failures[0].message)
    worker.thread.join(10)
    assert not worker.thread.is_alive()
