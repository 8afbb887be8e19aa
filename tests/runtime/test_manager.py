"""The deployment manager: reconciling the store with what is loaded, through deletes, re-creates, broken files and
loads that never finish."""

from __future__ import annotations

import threading
import time

import pytest

from depctl.spec import DeploymentSpec, NgramSpeculation
from depctl.store import SpecStore
from depctl_runtime.backends.base import Stage
from depctl_runtime.backends.loader import load_deployment
from depctl_runtime.manager import DeploymentManager, State
from depctl_runtime.speculation import GenerationParams
from tests.waiting import wait_until


def _spec(dep_id, model, **kw):
    return DeploymentSpec(
        id=dep_id,
        model=str(model),
        device="cpu",
        speculation=NgramSpeculation(ngram_length=2, num_draft_tokens=4),
        **kw,
    )


def _wait(manager, dep_id, states, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        manager.reconcile(force=True)
        dep = manager.get(dep_id)
        if dep is not None and dep.state.value in states:
            return dep
        time.sleep(0.05)
    dep = manager.get(dep_id)
    raise AssertionError(
        f"{dep_id} is {dep.state.value if dep else 'gone'} ({dep.reason if dep else ''}), not {states}"
    )


def _serves(dep) -> bool:
    return dep.backend is not None and dep.backend.loaded is not None


@pytest.fixture
def manager(depctl_home):
    m = DeploymentManager(SpecStore(), loader=lambda spec, **kw: load_deployment(spec, calibrate=False, **kw))
    yield m
    m.stop()


def test_recreate_while_the_old_engine_drains_loads_a_new_one(manager, tiny_model_dir):
    # the bug: delete (the old engine drains its streams), re-create the same id at once: the re-create was applied
    # in place to the draining engine, which then exited, leaving READY with no model (503 for every request)
    store = manager.store
    store.create(_spec("d", tiny_model_dir, compile=False))  # eager: the 400 tokens must still be draining
    dep = _wait(manager, "d", ("READY",))
    old = dep.backend
    done = threading.Event()
    dep.backend.worker.submit(
        list(b"abcabcabc"),
        GenerationParams(max_tokens=400, ignore_eos=True),
        lambda out: done.set() if isinstance(out, BaseException) or out.finish_reason else None,
    )
    store.delete("d")
    manager.reconcile(force=True)
    assert manager.get("d").state == State.DELETING
    store.create(_spec("d", tiny_model_dir, display_name="again"))  # (a new created_at, as from the CLI)
    manager.reconcile(force=True)
    assert done.wait(60)  # the old engine finished its request (a delete lets in-flight requests finish)
    dep = _wait(manager, "d", ("READY", "FAILED"))
    assert dep.state == State.READY and _serves(dep), dep.reason
    assert old.wait_stopped(60)  # the old worker's exit (its owner told) must not take the new deployment with it
    manager.reconcile(force=True)
    dep = manager.get("d")
    assert dep is not None and dep.state == State.READY and _serves(dep)


def test_ready_always_means_serving(manager, tiny_model_dir):
    # delete and re-create many times in a row, with and without traffic: READY must always come with an engine
    store = manager.store
    for i in range(6):
        store.create(_spec("r", tiny_model_dir, display_name=f"v{i}"))
        dep = _wait(manager, "r", ("READY",))
        if i % 2 == 0:
            dep.backend.worker.submit(
                list(b"hello hello"), GenerationParams(max_tokens=50, ignore_eos=True), lambda out: None
            )
        store.delete("r")
        manager.reconcile(force=True)
    store.create(_spec("r", tiny_model_dir))
    dep = _wait(manager, "r", ("READY",))
    assert _serves(dep)


def test_undecodable_spec_does_not_stop_reconciling(manager, tiny_model_dir):
    store = manager.store
    (store.root / "s1.yaml").write_bytes(b"\x00\xff\xfe garbage")
    store.create(_spec("ok", tiny_model_dir))
    assert _wait(manager, "ok", ("READY",)).state == State.READY
    assert manager.get("s1").state == State.FAILED and "not UTF-8" in manager.get("s1").reason
    store.delete("ok")
    manager.reconcile(force=True)
    _wait_gone(manager, "ok")


def _wait_gone(manager, dep_id, timeout=30.0):
    deadline = time.monotonic() + timeout
    while manager.get(dep_id) is not None:
        assert time.monotonic() < deadline, f"{dep_id} still {manager.get(dep_id).state}"
        manager.reconcile(force=True)
        time.sleep(0.05)


def test_a_hung_load_fails_after_the_load_timeout_and_others_still_load(depctl_home, tiny_model_dir):
    release = threading.Event()
    # loaded before the clock starts, so that only the hung load can run past the 1 s limit however busy the machine
    loaded = {name: load_deployment(_spec(name, tiny_model_dir), calibrate=False) for name in ("hung", "after")}
    hung_thread: list[threading.Thread] = []

    def loader(spec, **kw):
        if spec.id == "hung":
            hung_thread.append(threading.current_thread())
            release.wait(120)  # a model file that never finishes reading (a FIFO, a dead network mount)
        return loaded[spec.id]

    manager = DeploymentManager(SpecStore(), loader=loader, load_timeout=1.0)
    manager.start()  # its poller watches the load time
    try:
        manager.store.create(_spec("hung", tiny_model_dir))
        manager.reconcile(force=True)
        manager.store.create(_spec("after", tiny_model_dir))
        dep = _wait(manager, "after", ("READY",), timeout=30)
        assert _serves(dep)
        hung = _wait(manager, "hung", ("FAILED",), timeout=10)
        assert "did not finish loading within 1s" in hung.reason and "DEPCTL_LOAD_TIMEOUT" in hung.reason
        release.set()  # the stuck load finally returns: its result is dropped, the state stays FAILED
        hung_thread[0].join(30)  # (the load's thread has handed its result over and ended)
        assert not hung_thread[0].is_alive()
        manager.reconcile(force=True)
        assert manager.get("hung").state == State.FAILED and not _serves(manager.get("hung"))
    finally:
        release.set()
        manager.stop()


def test_a_long_load_step_shows_in_the_deployments_reason_while_it_runs(depctl_home, tiny_model_dir):
    release = threading.Event()

    def loader(spec, report):
        report(Stage("compiling", "the decode and verify passes"))
        release.wait(60)
        return load_deployment(spec, calibrate=False)

    manager = DeploymentManager(SpecStore(), loader=loader)
    try:
        manager.store.create(_spec("slow", tiny_model_dir))
        manager.reconcile(force=True)
        deadline = time.monotonic() + 10
        while manager.get("slow").reason != "compiling: the decode and verify passes":
            assert time.monotonic() < deadline, manager.get("slow").reason
            time.sleep(0.02)
        assert manager.get("slow").state == State.CREATING
        status = manager.get("slow").status()
        assert status["reason"] == "compiling: the decode and verify passes"
        assert status["stage"]["name"] == "compiling" and time.time() - status["stage"]["since"] < 10
        release.set()
        dep = _wait(manager, "slow", ("READY",), timeout=30)
        # the stage goes; how the passes run stays
        assert dep.reason is None and dep.status()["stage"] is None and dep.status()["compiled"]
        # and what runs the target's products (ours where the C++ ops build; oneDNN's or weight-major loops without)
        assert dep.status()["products"].startswith(("depctl blocked ", "oneDNN", "weight-major")), dep.status()
    finally:
        release.set()
        manager.stop()


def test_a_load_waiting_for_anothers_turn_says_which_it_waits_for(depctl_home, tiny_model_dir):
    release = threading.Event()
    loaded = load_deployment(_spec("second", tiny_model_dir), calibrate=False)

    def loader(spec, report):
        if spec.id == "first":
            report(Stage("compiling", "the decode and verify passes"))
            release.wait(60)
            return load_deployment(spec, calibrate=False)
        return loaded

    manager = DeploymentManager(SpecStore(), loader=loader)
    try:
        manager.store.create(_spec("first", tiny_model_dir))
        manager.reconcile(force=True)
        wait_until(lambda: manager.get("first").reason == "compiling: the decode and verify passes", "first compiles")
        manager.store.create(_spec("second", tiny_model_dir))
        manager.reconcile(force=True)
        wanted = "waiting: for first to finish loading (one load at a time)"
        wait_until(lambda: manager.get("second").reason == wanted, "second says what it waits for", timeout=10)
        status = manager.get("second").status()
        assert status["state"] == "CREATING" and status["stage"]["name"] == "waiting"
        release.set()
        assert _wait(manager, "second", ("READY",), timeout=30).reason is None
    finally:
        release.set()
        manager.stop()


def test_a_loaded_model_is_out_of_the_collectors_reach_and_a_deleted_one_is_still_freed(manager, tiny_model_dir):
    """A full collection walks every object in the process; with SmolLM2 loaded, one took 200 ms on the daemon's
    event loop while it served, holding the GIL and so stalling every stream. Once a load serves, the heap it leaves
    is frozen (``gc.freeze``): collections walk only what came after. A deleted deployment's model must still be
    freed (its reference cycles too)."""
    import gc
    import weakref

    gc.unfreeze()
    store = manager.store
    store.create(_spec("g", tiny_model_dir, compile=False))
    dep = _wait(manager, "g", ("READY",))
    model = weakref.ref(dep.backend.worker.loaded.engine.target.model)
    deadline = time.monotonic() + 10
    while gc.get_freeze_count() == 0:
        assert time.monotonic() < deadline, "nothing was frozen after the load"
        time.sleep(0.05)
    del dep
    store.delete("g")
    manager.reconcile(force=True)
    _wait_gone(manager, "g")
    deadline = time.monotonic() + 10
    while model() is not None:
        assert time.monotonic() < deadline, "the deleted deployment's model is still alive"
        time.sleep(0.05)


def test_keep_alive_counts_from_ready_not_from_a_load_longer_than_it(depctl_home, tiny_model_dir):
    """A 2 s keep-alive on a load that took 3 s once unloaded the deployment the moment it was READY."""

    def slow_loader(spec, report):
        time.sleep(1.5)  # a load longer than the keep-alive
        return load_deployment(spec, calibrate=False)

    manager = DeploymentManager(SpecStore(), loader=slow_loader)  # not started: the test plays the meter's part
    try:
        manager.store.create(_spec("nap", tiny_model_dir, keep_alive=1.0))
        manager.reconcile(force=True)
        dep = _wait(manager, "nap", ("READY",), timeout=30)
        manager._unload_if_idle(dep, time.monotonic())  # the meter's first look once READY
        assert dep.state == State.READY
        manager._unload_if_idle(dep, dep.last_active + 1.01)  # idle for the keep-alive
        assert dep.state == State.IDLE
        # keep-alive "forever" (none): never unloaded, however long it idles
        manager.store.update("nap", lambda s: s.model_copy(update={"keep_alive": None}))
        dep = _wait(manager, "nap", ("READY",), timeout=30)
        manager._unload_if_idle(dep, time.monotonic() + 3600)
        assert dep.state == State.READY
    finally:
        manager.stop()


def test_sampling_defaults_change_without_a_reload():
    from depctl.spec import DeploymentSpec, SamplingDefaults
    from depctl_runtime.manager import _reload_needed

    spec = DeploymentSpec(id="dep", model="m")
    assert not _reload_needed(spec, spec.model_copy(update={"sampling": SamplingDefaults(temperature=0.0)}))
    assert _reload_needed(spec, spec.model_copy(update={"max_batch_size": 2}))


def test_a_change_that_needs_no_reload_leaves_a_load_under_way_alone(depctl_home, tiny_model_dir):
    """`deployment update --temperature 0` while the model loads: the load goes on (it took a second full load of
    Qwen2.5-Coder-1.5B, four minutes on 2 cores), and the deployment serves with the new defaults."""
    from depctl.spec import SamplingDefaults

    release, loads = threading.Event(), []

    def loader(spec, **kw):
        loads.append(spec)
        release.wait(60)
        return load_deployment(spec, calibrate=False, **kw)

    manager = DeploymentManager(SpecStore(), loader=loader)
    try:
        manager.store.create(_spec("d", tiny_model_dir, compile=False))
        manager.reconcile(force=True)
        wait_until(lambda: loads, "the load to start")
        manager.store.update("d", lambda s: s.model_copy(update={"sampling": SamplingDefaults(temperature=0.0)}))
        manager.reconcile(force=True)
        release.set()
        dep = _wait(manager, "d", ("READY",))
        assert len(loads) == 1 and dep.spec.sampling.temperature == 0.0 and _serves(dep)
    finally:
        release.set()
        manager.stop()
