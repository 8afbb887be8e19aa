"""Talking to the daemon: finding it, starting and stopping it, and an HTTP client for its API."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Iterator

import httpx
import psutil
from filelock import FileLock
from httpx_sse import connect_sse

from depctl import config
from depctl.errors import DaemonError, DaemonNotRunning, DepctlError, WaitTimeout
from depctl.settings import ALREADY_RUNNING

START_TIMEOUT = 60.0


@dataclass(frozen=True)
class DaemonInfo:
    pid: int
    host: str
    port: int
    started_at: float
    api_key: str | None = None  # the daemon's key (daemon.json is readable by its owner only)
    drain_timeout: float = 10.0
    log: str | None = None  # its log file; None: it logs to the stderr of the `depctl serve` that runs it

    @property
    def url(self) -> str:
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)  # bound everywhere: talk locally
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    @property
    def headers(self) -> dict:
        key = os.environ.get("DEPCTL_API_KEY") or self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}


def tree_rss(pid: int) -> int | None:
    """Resident bytes of a process and all its descendants (the daemon with its vLLM servers, or one server with its
    workers); None when it is gone."""
    try:
        root = psutil.Process(pid)
        return sum(p.memory_info().rss for p in (root, *root.children(recursive=True)))
    except psutil.Error:
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def daemon_info() -> DaemonInfo | None:
    """The running daemon per ``daemon.json``, or None (no file, or its process is gone)."""
    try:
        raw = json.loads(config.daemon_file().read_text())
        info = DaemonInfo(
            int(raw["pid"]),
            str(raw["host"]),
            int(raw["port"]),
            float(raw.get("started_at", 0)),
            raw.get("api_key"),
            float(raw.get("drain_timeout", 10.0)),
            raw.get("log", str(config.daemon_log())),  # (a daemon from before the field: always the file)
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return info if _pid_alive(info.pid) else None


def _healthy(info: DaemonInfo) -> bool:
    try:
        return httpx.get(f"{info.url}/health", timeout=2.0, headers=info.headers).status_code == 200
    except httpx.HTTPError:
        return False


def start_daemon(
    port: int | None = None, timeout: float = START_TIMEOUT, env: dict | None = None
) -> tuple[DaemonInfo, bool]:
    """Start the daemon in the background unless one runs; returns (info, started_now).

    Several CLI calls at once (``deployment create`` x N with no daemon) take turns on a start lock, so one starts it
    and the others find it; the daemon's own lock on the home makes a second daemon impossible anyway."""
    with FileLock(str(config.home() / "start.lock"), timeout=timeout + 10):
        info = daemon_info()
        if info is not None and _healthy(info):
            return info, False
        return _spawn(port, timeout, env or {})


def _spawn(port: int | None, timeout: float, env: dict) -> tuple[DaemonInfo, bool]:
    log_path = config.daemon_log()
    cmd = config.python_module("depctl_runtime") + ([] if port is None else ["--port", str(port)])
    with open(log_path, "ab") as log:
        log.write(f"\n--- depctl daemon starting {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n".encode())
        log.flush()
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            env={**os.environ, **env, "DEPCTL_DAEMON_LOG": str(log_path)},
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() == ALREADY_RUNNING:  # one started outside this lock (`python -m depctl_runtime` by hand)
            info = daemon_info()
            if info is not None and _healthy(info):
                return info, False
            time.sleep(0.2)
            continue
        if proc.poll() is not None:
            raise DaemonError(
                f"the daemon exited at start-up (status {proc.returncode}): {_log_tail(log_path)}",
                f"see the full log with `depctl daemon logs` ({log_path})",
            )
        info = daemon_info()
        if info is not None and info.pid == proc.pid and _healthy(info):
            return info, True
        time.sleep(0.2)
    raise DaemonError(f"the daemon did not answer within {timeout:.0f}s", f"see `depctl daemon logs` ({log_path})")


def stop_daemon(timeout: float | None = None) -> DaemonInfo | None:
    """SIGTERM: the daemon drains (running requests get its drain timeout), then exits; SIGKILL if it does not."""
    info = daemon_info()
    if info is None:
        return None
    os.kill(info.pid, signal.SIGTERM)
    deadline = time.monotonic() + (info.drain_timeout + 20 if timeout is None else timeout)
    while time.monotonic() < deadline and _pid_alive(info.pid):
        time.sleep(0.1)
    if _pid_alive(info.pid):
        os.kill(info.pid, signal.SIGKILL)
    config.daemon_file().unlink(missing_ok=True)
    return info


def _log_tail(path, lines: int = 3) -> str:
    try:
        text = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:])


class Client:
    """The daemon's HTTP API. Connection problems become ``DaemonNotRunning``; error envelopes ``DaemonError``."""

    def __init__(self, info: DaemonInfo | None = None, timeout: float = 600.0):
        info = info or daemon_info()
        if info is None:
            raise DaemonNotRunning()
        self.info = info
        self.http = httpx.Client(base_url=info.url, timeout=httpx.Timeout(timeout, connect=5.0), headers=info.headers)

    def _request(self, method: str, path: str, **kwargs) -> httpx.Response:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.ConnectError:
            raise DaemonNotRunning(f"the depctl daemon at {self.info.url} is not answering") from None
        except httpx.TimeoutException:
            raise DaemonError(f"the daemon at {self.info.url} did not answer in time") from None
        if response.status_code >= 400:
            raise _api_error(response)
        return response

    def chat_completion(self, body: dict) -> dict:
        return self._request("POST", "/v1/chat/completions", json=body).json()

    def deployments(self) -> list[dict]:
        return self._request("GET", "/depctl/v1/deployments").json()

    def deployment(self, deployment_id: str) -> dict | None:
        try:
            return self._request("GET", f"/depctl/v1/deployments/{deployment_id}").json()
        except DaemonError as exc:
            if getattr(exc, "status", None) == 404:
                return None
            raise

    def wake(self, deployment_id: str) -> dict:
        """Load an IDLE deployment again now; its status (the load runs on)."""
        return self._request("POST", f"/depctl/v1/deployments/{deployment_id}/wake").json()

    def reconcile(self) -> list[dict]:
        return self._request("POST", "/depctl/v1/reconcile").json()

    def wait_settled(self, deployment_id: str, timeout: float, gone: bool = False, on_poll=None) -> dict | None:
        """Poll until the deployment is READY or FAILED (or gone, when ``gone``)."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.deployment(deployment_id)
            if on_poll:
                on_poll(status)
            if gone and status is None:
                return None
            if not gone and status is not None and status["state"] in ("READY", "FAILED"):
                return status
            if time.monotonic() > deadline:
                state = status["state"] if status else "gone"
                raise WaitTimeout(
                    f"deployment {deployment_id!r} is still {state} after {timeout:.0f}s",
                    f"check it later with `depctl deployment get {deployment_id}`, or raise --wait-timeout",
                )
            time.sleep(0.25)

    def stream(self, path: str, body: dict) -> Iterator[dict]:
        """POST with ``stream: true``; yields the parsed SSE data objects (stops at ``[DONE]``). Closing the
        generator early closes the connection, which cancels the request in the daemon."""
        try:
            with connect_sse(self.http, "POST", path, json={**body, "stream": True}) as source:
                if source.response.status_code >= 400:
                    source.response.read()
                    raise _api_error(source.response)
                for event in source.iter_sse():
                    if event.data == "[DONE]":
                        return
                    obj = event.json()
                    if "error" in obj:
                        raise DaemonError(obj["error"].get("message", "generation failed"))
                    yield obj
        except httpx.ConnectError:
            raise DaemonNotRunning(f"the depctl daemon at {self.info.url} is not answering") from None


def _api_error(response: httpx.Response) -> DepctlError:
    try:
        err = response.json().get("error", {})
        message = err.get("message") or response.text
    except ValueError:
        message = response.text[:300]
    exc = DaemonError(f"the daemon answered {response.status_code}: {message}")
    exc.status = response.status_code
    return exc
