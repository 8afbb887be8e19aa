"""Tiny models shared by the engine tests (built once per session: no network, no downloads)."""

from __future__ import annotations

import pytest

from tests.tiny import tiny_llama


@pytest.fixture(scope="session")
def target():
    return tiny_llama(0)


@pytest.fixture(scope="session")
def draft():
    return tiny_llama(1, layers=1)
