"""Where depctl keeps things, and how the CLI finds the daemon.

- ``DEPCTL_HOME`` (default: the platform's user data dir): deployment specs, the daemon's pid/port file and log.
- ``DEPCTL_CACHE`` (default: the platform's user cache dir): converted model weights, shared by every home,
  so that tests pointing ``DEPCTL_HOME`` at a temp dir still reuse a model converted once.
- ``DEPCTL_PORT`` (default 8642): the port ``depctl daemon start`` binds on 127.0.0.1.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

DEFAULT_PORT = 8642
DEFAULT_HOST = "127.0.0.1"


def home() -> Path:
    path = Path(os.environ.get("DEPCTL_HOME") or platformdirs.user_data_dir("depctl"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def cache_dir() -> Path:
    path = Path(os.environ.get("DEPCTL_CACHE") or platformdirs.user_cache_dir("depctl"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def deployments_dir() -> Path:
    path = home() / "deployments"
    path.mkdir(parents=True, exist_ok=True)
    return path


def daemon_file() -> Path:
    """JSON written by the daemon once it listens: {"pid", "host", "port", "started_at"}."""
    return home() / "daemon.json"


def daemon_log() -> Path:
    return home() / "daemon.log"


def default_port() -> int:
    raw = os.environ.get("DEPCTL_PORT")
    if not raw:
        return DEFAULT_PORT
    try:
        port = int(raw)
    except ValueError:
        raise ValueError(f"DEPCTL_PORT must be a port number, got {raw!r}") from None
    if not 0 <= port < 65536:  # 0: any free port (the daemon writes the one it got to daemon.json)
        raise ValueError(f"DEPCTL_PORT must be between 0 and 65535, got {port}")
    return port


def debug() -> bool:
    return os.environ.get("DEPCTL_DEBUG", "") not in ("", "0", "false")


def python_module(module: str) -> list[str]:
    """The command that runs ``python -m module`` in this interpreter without the current directory on its path: run
    from a folder that holds a ``depctl/`` directory (a clone's parent), ``-m`` would import that one instead."""
    import sys

    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", module]
    code = f"import runpy, sys; del sys.path[0]; runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
    return [sys.executable, "-c", code]
