"""Every test gets its own DEPCTL_HOME (specs, daemon file, log) in a temp dir; the model cache is shared."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def depctl_home(tmp_path, monkeypatch):
    home = tmp_path / "depctl-home"
    monkeypatch.setenv("DEPCTL_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # never wait ~50 s on a hub retry for a path that does not exist
    monkeypatch.delenv("DEPCTL_DEBUG", raising=False)
    return home


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from tests.tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny-target"), seed=0)


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory):
    from tests.tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny-draft"), seed=1, layers=1)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("DEPCTL_SKIP_REAL"):
        skip = pytest.mark.skip(reason="DEPCTL_SKIP_REAL is set: real-model tests skipped on request")
        for item in items:
            if "real_model" in item.keywords:
                item.add_marker(skip)
