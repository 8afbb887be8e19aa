"""The serving layer's pieces that need no daemon: tokenizing without holding the GIL, exactly as the tokenizer
would."""

from __future__ import annotations

import threading
import time

from depctl_runtime.api.serving import encode
from tests.tiny import byte_tokenizer


def test_encode_equals_the_tokenizer():
    tok = byte_tokenizer()
    for text in ["", "hello", "<|im_start|>user\nhi<|im_end|>", "ünïcödé ✓ " * 20]:
        for special in (True, False):
            assert encode(tok, text, special) == tok(text, add_special_tokens=special)["input_ids"]


def test_encode_lets_other_threads_run():
    # a single `encode` holds the GIL for the whole call (2.7 s for 6 MB here), which froze the daemon's event loop
    tok = byte_tokenizer()
    text = "hello world " * 150_000  # 1.8 MB: about a second of tokenizing
    gaps, done = [], threading.Event()

    def tick():
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    t0 = time.perf_counter()
    encode(tok, text, False)
    took = time.perf_counter() - t0
    done.set()
    ticker.join()
    # held, the GIL would let the ticker in once, after the whole call: relative bounds, whatever the machine's speed
    assert len(gaps) >= 3 and max(gaps) < took / 2, (len(gaps), max(gaps), took)


def test_a_stopping_daemon_still_says_which_deployments_do_not_exist():
    # while the daemon drained, a request naming a deployment that does not exist got 503 "retry once it is back":
    # a client with retries would retry a request that can never succeed (the chaos run caught it). It is a 404, as it
    # is at any other time; a request for a deployment that does exist gets the 503.
    import asyncio
    from types import SimpleNamespace

    import pytest

    from depctl_runtime.api.errors import APIError
    from depctl_runtime.api.serving import Service

    deps = {"real": SimpleNamespace(id="real")}
    service = Service(SimpleNamespace(get=deps.get), metrics=None)

    async def drain():
        service.begin_drain(timeout=60)

    asyncio.run(drain())
    with pytest.raises(APIError) as missing:
        service.deployment("ghost")
    assert missing.value.status == 404 and "does not exist" in str(missing.value)
    with pytest.raises(APIError) as stopping:
        service.deployment("real")
    assert stopping.value.status == 503 and stopping.value.code == "daemon_stopping"


def test_requests_waiting_for_a_load_hold_no_thread_that_others_need(depctl_home, tiny_model_dir):
    # the bug: a request for an IDLE deployment slept in a worker thread until the load finished; 45 such requests
    # left a status request waiting more than 30 s for a thread
    import asyncio

    import httpx

    from depctl.settings import Settings
    from depctl.spec import DeploymentSpec
    from depctl.store import SpecStore
    from depctl_runtime.app import create_app
    from depctl_runtime.backends.loader import load_deployment
    from depctl_runtime.manager import DeploymentManager, State

    release, loads = threading.Event(), []

    def loader(spec, report):
        loads.append(spec.id)
        if loads.count("nap") > 1:  # the load after the idle unload: held until the test lets it go
            release.wait(120)
        return load_deployment(spec, calibrate=False, report=report)

    store = SpecStore()
    for dep_id, keep_alive in (("nap", 1.0), ("other", None)):
        # no compiled passes: the test is about threads, and a compile per load was most of its time
        spec = DeploymentSpec(id=dep_id, model=str(tiny_model_dir), device="cpu", keep_alive=keep_alive, compile=False)
        store.create(spec)
    manager = DeploymentManager(store, loader=loader)
    app = create_app(manager=manager, settings=Settings())
    manager.start()
    woken = []  # a request for the idle deployment wakes it, then waits for the load
    wake = manager.wake
    manager.wake = lambda dep: (woken.append(dep.id), wake(dep))[-1]

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=180) as client:
            deadline = time.monotonic() + 120
            while manager.get("nap").state != State.IDLE or manager.get("other").state != State.READY:
                assert time.monotonic() < deadline, (manager.get("nap").state, manager.get("other").state)
                await asyncio.sleep(0.1)
            body = {"model": "nap", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            waiting = [asyncio.ensure_future(client.post("/v1/chat/completions", json=body)) for _ in range(100)]
            deadline = time.monotonic() + 60
            while len(woken) < 100:  # every waiter has reached its wait
                assert time.monotonic() < deadline, len(woken)
                await asyncio.sleep(0.02)
            assert manager.get("nap").waking
            # each answers while the 100 wait (before the fix they waited for the load: never, here)
            status = await asyncio.wait_for(client.get("/depctl/v1/deployments"), 30)
            other = await asyncio.wait_for(
                client.post("/v1/completions", json={"model": "other", "prompt": "a", "max_tokens": 2}), 30
            )
            tokenized = await asyncio.wait_for(client.post("/tokenize", json={"model": "other", "prompt": "ab"}), 30)
            assert status.status_code == other.status_code == tokenized.status_code == 200, other.text
            assert not any(w.done() for w in waiting)
            release.set()
            answers = await asyncio.gather(*waiting)
            assert all(r.status_code == 200 for r in answers), answers[0].text

    try:
        asyncio.run(scenario())
    finally:
        release.set()
        manager.stop()
