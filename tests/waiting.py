"""Waiting on a condition, never on the clock: a test that sleeps a fixed time races the machine it runs on."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], what: str, timeout: float = 60.0, interval: float = 0.02) -> T:
    """Poll ``condition`` until it returns something true, and return that; fail naming ``what`` after ``timeout``
    seconds (generous: a busy 2-core machine is slow, and a passing run never waits for the deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:.0f}s for {what}; last seen: {value!r}")
        time.sleep(interval)
