"""Run a real daemon (``python -m depctl_runtime``) in a subprocess for the end-to-end tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


class DaemonProcess:
    def __init__(self, home: Path, env: dict | None = None):
        self.home = home
        self.env = env or {}
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        key = self.env.get("DEPCTL_API_KEY")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def start(self, timeout: float = 60.0) -> "DaemonProcess":
        env = {**os.environ, "DEPCTL_HOME": str(self.home), "HF_HUB_OFFLINE": "1", **self.env}
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "daemon.json").unlink(missing_ok=True)
        self.log = open(self.home / "test-daemon.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "depctl_runtime", "--port", "0"],
            env=env,
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"daemon exited: {self.log_text()}"
            try:
                info = json.loads((self.home / "daemon.json").read_text())
                if info["pid"] == self.proc.pid:
                    self.url = f"http://{info['host']}:{info['port']}"
                    httpx.get(self.url + "/health", timeout=2).raise_for_status()
                    return self
            except (OSError, ValueError, KeyError, httpx.HTTPError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"daemon did not start: {self.log_text()}")

    def log_text(self) -> str:
        return (self.home / "test-daemon.log").read_text(errors="replace")[-3000:]

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()

    def get(self, path: str, **kwargs) -> httpx.Response:
        return httpx.get(self.url + path, **{"timeout": 30, "headers": self.headers, **kwargs})

    def post(self, path: str, body: dict | None = None, **kwargs) -> httpx.Response:
        return httpx.post(self.url + path, json=body, **{"timeout": 120, "headers": self.headers, **kwargs})

    def wait_state(self, dep_id: str, states: tuple[str, ...] = ("READY", "FAILED"), timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.post("/depctl/v1/reconcile")
            r = self.get(f"/depctl/v1/deployments/{dep_id}")
            if r.status_code == 200 and r.json()["state"] in states:
                return r.json()
            time.sleep(0.2)
        raise TimeoutError(f"{dep_id} not in {states}: {self.log_text()}")
