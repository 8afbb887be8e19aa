"""The processes behind a vLLM deployment: a free loopback port, the launcher that ties the server's life to the
daemon's (``PR_SET_PDEATHSIG``), killing a server with everything it started, and reaping the servers an earlier
daemon left behind (each one is recorded in ``$DEPCTL_HOME/run/vllm-<id>.json``)."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
from pathlib import Path

import psutil

from depctl import config
from depctl.errors import DepctlError

log = logging.getLogger("depctl.vllm")

STOP_GRACE = 15.0  # seconds between SIGTERM and SIGKILL


# Runs in vLLM's interpreter: ask the kernel for SIGTERM when the thread that started us dies, then become the server.
LAUNCHER = """
import os, runpy, signal, sys
try:
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG (Linux)
    if os.getppid() != int(os.environ.get("DEPCTL_PARENT_PID", "0")):
        sys.exit("the depctl daemon exited before vLLM started")
except (AttributeError, OSError):
    pass
module = sys.argv[1]
sys.argv = [module] + sys.argv[2:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


class LaunchError(DepctlError):
    pass


def run_dir() -> Path:
    path = config.home() / "run"
    path.mkdir(parents=True, exist_ok=True)
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_tree(pid: int, grace: float) -> None:
    """SIGTERM the process group led by ``pid`` (and every descendant found now), SIGKILL what outlives ``grace``."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return
    try:
        os.killpg(pid, signal.SIGTERM)
    except OSError:
        pass
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    psutil.wait_procs(alive, timeout=5)


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


def reap_orphans() -> list[int]:
    """Kill the vLLM servers an earlier daemon of this home left running; return their pids."""
    reaped = []
    for record in run_dir().glob("vllm-*.json"):
        try:
            info = json.loads(record.read_text())
            proc = psutil.Process(info["pid"])
            if abs(proc.create_time() - info["create_time"]) < 1.0:  # the same process, not a reused pid
                log.warning(
                    "stopping vLLM server pid %d left by an earlier daemon (deployment %s)",
                    info["pid"],
                    info.get("deployment"),
                )
                kill_tree(info["pid"], STOP_GRACE)
                reaped.append(info["pid"])
        except (OSError, ValueError, KeyError, psutil.Error):
            pass
        record.unlink(missing_ok=True)
    return reaped


def exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def shorten(line: str, limit: int = 300) -> str:
    # vLLM's log prefix: "(APIServer pid=123) ERROR 11-23 10:00:00 [file.py:12] message"
    line = re.sub(r"^(\(\w+ pid=\d+\) )?(INFO|WARNING|ERROR|DEBUG|CRITICAL) \d\d-\d\d [\d:.]+ \[[^\]]+\] ", "", line)
    return line if len(line) <= limit else line[: limit - 3] + "..."
