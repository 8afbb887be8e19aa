"""Every test gets its own DEPCTL_HOME (specs, daemon file, log) in a temp dir and port 0 for any daemon it starts;
the model cache is shared. A daemon a test leaves running in its home is killed afterwards, and the test fails."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest


@pytest.fixture(scope="session", autouse=True)
def native_ops_built(request):
    """depctl's C++ ops are built once per machine, by the first tests that need them; build them here instead, and
    say so, so a first run does not sit silent for a minute inside whichever test came first."""
    from depctl_runtime.kernels import native

    if request.config.getoption("markexpr", "") == "gpu":
        return  # CUDA never uses the CPU ops: a GPU machine's test run need not spend a minute building them first
    plugins = request.config.pluginmanager
    terminal, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    started = time.monotonic()

    def say(line: str) -> None:
        if terminal is not None and capture is not None:
            with capture.global_and_fixture_disabled():
                terminal.write_line(line)

    def building():
        say("building depctl's C++ ops (once per machine; about a minute on 2 idle cores)...")

    if native.available(building=building) and time.monotonic() - started > 5:
        say(f"built depctl's C++ ops in {time.monotonic() - started:.0f}s")


@pytest.fixture
def native_ops():
    """Skips a test where depctl's C++ ops cannot be built (no C++ compiler), as the loader then runs without them."""
    from depctl_runtime.kernels import native

    if not native.available():
        pytest.skip("depctl's C++ ops could not be built here (see the warning above for why)")


@pytest.fixture(autouse=True)
def depctl_home(tmp_path, monkeypatch):
    home = tmp_path / "depctl-home"
    monkeypatch.setenv("DEPCTL_HOME", str(home))
    monkeypatch.setenv("DEPCTL_PORT", "0")  # a daemon a test starts never takes the user's port 8642
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # never wait ~50 s on a hub retry for a path that does not exist
    monkeypatch.delenv("DEPCTL_DEBUG", raising=False)
    monkeypatch.delenv("DEPCTL_API_KEY", raising=False)
    yield home
    left = _live_daemon(home)
    if left is not None:
        os.kill(left, signal.SIGKILL)
        pytest.fail(f"the test left a daemon running in its home (pid {left}): stop it in the test")


def _live_daemon(home) -> int | None:
    try:
        pid = int(json.loads((home / "daemon.json").read_text())["pid"])
        os.kill(pid, 0)
    except (OSError, ValueError, KeyError):
        return None
    return pid


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from tests.tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny-target"), seed=0)


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory):
    from tests.tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny-draft"), seed=1, layers=1)


def pytest_collection_modifyitems(config, items):
    skip_real = pytest.mark.skip(reason="DEPCTL_SKIP_REAL is set: real-model tests skipped on request")
    for item in items:
        if "real_model" in item.keywords:
            item.add_marker(pytest.mark.slow)  # a real model's load and steps: seconds each on 2 cores
            if os.environ.get("DEPCTL_SKIP_REAL"):
                item.add_marker(skip_real)
        if "engines" in item.keywords:
            item.add_marker(pytest.mark.slow)
