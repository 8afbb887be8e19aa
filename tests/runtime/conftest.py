"""Tiny models shared by the engine tests (built once per session: no network, no downloads)."""

from __future__ import annotations

import pytest

from depctl_runtime.model.decoder import fuse_projections
from tests.tiny import tiny_llama


@pytest.fixture(scope="session")
def target():
    return tiny_llama(0)


@pytest.fixture(scope="session")
def draft():
    return tiny_llama(1, layers=1)


@pytest.fixture(scope="session")
def fused_target():
    """A target stepped through depctl's own forward (``model.decoder``), whose prompt passes stop within layers."""
    model = tiny_llama(2, layers=3)
    fuse_projections(model)
    return model
