"""The serving layer's pieces that need no daemon: tokenizing without holding the GIL, exactly as the tokenizer would."""

from __future__ import annotations

import threading
import time

from runtime.api.serving import encode
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
