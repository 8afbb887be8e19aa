"""``depctl serve``: the daemon in the foreground, as a container or a systemd unit runs it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from typer.testing import CliRunner

from depctl.cli import app

pytestmark = pytest.mark.slow  # `depctl serve` in a subprocess


def test_serve_runs_in_the_foreground_logs_to_it_and_stops_on_sigterm(depctl_home, tmp_path):
    env = {**os.environ, "DEPCTL_HOME": str(depctl_home), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "depctl", "serve", "--port", "0"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        info = None
        while time.monotonic() < deadline and info is None:
            assert proc.poll() is None, proc.stdout.read()
            try:
                info = json.loads((depctl_home / "daemon.json").read_text())
                httpx.get(f"http://127.0.0.1:{info['port']}/health", timeout=2).raise_for_status()
            except (OSError, ValueError, httpx.HTTPError):
                info = None
                time.sleep(0.2)
        assert info is not None, "the daemon did not come up"
        assert info["pid"] == proc.pid  # the command became the daemon: signals reach it directly
        # it writes no log file: status says where its log is, and `daemon logs` does not show an older daemon's
        (depctl_home / "daemon.log").write_text("an earlier background daemon's log\n")
        status = CliRunner().invoke(app, ["daemon", "status", "-o", "json"])
        assert json.loads(status.stdout)["log"] == f"the stderr of `depctl serve` (pid {proc.pid})"
        logs = CliRunner().invoke(app, ["daemon", "logs"])
        assert logs.exit_code != 0 and "earlier background" not in logs.output
        assert "logs to that command's stderr" in " ".join(logs.output.split())
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0
    assert "listening on http://127.0.0.1" in out and "stopping" in out  # its log is this terminal's
    assert not (depctl_home / "daemon.json").exists()
