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
    assert took > 0.3  # long enough for the check to mean something
    assert max(gaps) < took / 2, (max(gaps), took)


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
