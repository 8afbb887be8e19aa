"""The whole path with a real daemon in a subprocess and a tiny model: the CLI writes specs, the daemon loads them,
answers completions, follows updates and deletes, reports failures, and comes back after a crash."""

from __future__ import annotations

import json
import os
import time

import pytest
from typer.testing import CliRunner

from depctl.cli import app
from depctl.spec import DeploymentSpec
from depctl.store import SpecStore
from tests.daemon_util import DaemonProcess
from tests.tiny import LONG, LONG_ANSWER, save_tiny
from tests.waiting import wait_until

pytestmark = pytest.mark.slow  # a real daemon in a subprocess, driven by the CLI

runner = CliRunner()


def cli(*args: str):
    result = runner.invoke(app, list(args))
    return result


def cli_json(*args: str):
    result = cli(*args, "-o", "json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture
def daemon(depctl_home):
    d = DaemonProcess(depctl_home).start()
    yield d
    d.stop()


def test_create_serve_update_delete_restart(daemon, tiny_model_dir, tiny_draft_dir, depctl_home):
    rec = cli_json(
        "deployment",
        "create",
        str(tiny_model_dir),
        "--deployment-id",
        "tiny",
        "--ngram-speculation-length",
        "3",
        "--draft-token-count",
        "4",
    )
    assert rec["status"]["state"] == "READY"
    assert rec["speculation"] == {"method": "ngram", "ngram_length": 3, "num_draft_tokens": 4}

    body = {"model": "tiny", "prompt": "abcabcabc", "max_tokens": 24, "temperature": 0}
    first = daemon.post("/v1/completions", body).json()
    assert first["object"] == "text_completion" and first["usage"]["completion_tokens"] == 24
    assert first["usage"]["speculation"]["drafted_tokens"] > 0

    # a new draft token count applies in place: no reload (ready_at unchanged), same output
    ready_at = daemon.get("/depctl/v1/deployments/tiny").json()["ready_at"]
    rec = cli_json("deployment", "update", "tiny", "--draft-token-count", "2")
    assert rec["status"]["state"] == "READY" and rec["status"]["ready_at"] == ready_at
    assert rec["status"]["policy"]["max_draft_tokens"] == 2
    assert daemon.post("/v1/completions", body).json()["choices"][0]["text"] == first["choices"][0]["text"]

    # switching to a draft model reloads; greedy output is still the target's
    rec = cli_json("deployment", "update", "tiny", "--draft-model", str(tiny_draft_dir), "--draft-token-count", "3")
    assert rec["status"]["state"] == "READY" and rec["speculation"]["method"] == "draft_model"
    assert rec["status"]["draft_precision"] == ("int8" if rec["status"]["device"] == "cpu" else rec["status"]["dtype"])
    assert daemon.post("/v1/completions", body).json()["choices"][0]["text"] == first["choices"][0]["text"]
    # a new draft precision reloads the draft; the output is still the target's
    rec = cli_json("deployment", "update", "tiny", "--draft-precision", "float32")
    assert rec["status"]["state"] == "READY" and rec["status"]["draft_precision"] == "float32"
    assert rec["speculation"]["num_draft_tokens"] == 3
    assert daemon.post("/v1/completions", body).json()["choices"][0]["text"] == first["choices"][0]["text"]
    rec = cli_json("deployment", "update", "tiny", "--disable-speculative-decoding")
    assert rec["speculation"] == {"method": "none"} and rec["status"]["state"] == "READY"

    # crash the daemon; a new one brings the deployment back from the store
    daemon.kill()
    daemon.start()
    assert daemon.wait_state("tiny")["state"] == "READY"
    assert daemon.post("/v1/completions", body).json()["choices"][0]["text"] == first["choices"][0]["text"]
    listed = cli_json("deployment", "list")
    assert [(r["id"], r["status"]["state"]) for r in listed] == [("tiny", "READY")]

    result = cli("deployment", "delete", "tiny")
    assert result.exit_code == 0, result.stderr
    assert daemon.get("/depctl/v1/deployments/tiny").status_code == 404
    assert cli_json("deployment", "list") == []
    assert daemon.post("/v1/completions", body).status_code == 404


def test_failures_are_reported_and_isolated(daemon, tiny_model_dir, tmp_path, depctl_home):
    # a deployment that works, next to three that cannot
    assert (
        cli_json("deployment", "create", str(tiny_model_dir), "--deployment-id", "good")["status"]["state"] == "READY"
    )

    broken_model = tmp_path / "broken-model"
    broken_model.mkdir()
    (broken_model / "config.json").write_text('{"model_type": "no-such-architecture"}')
    result = cli("deployment", "create", str(broken_model), "--deployment-id", "wontload")
    assert result.exit_code == 1
    assert "FAILED" in result.stderr and "failed to load" in result.stderr
    assert "depctl deployment delete wontload" in " ".join(result.stderr.split())

    other_tok = save_tiny(tmp_path / "other-tokenizer", seed=2, byte_offset=7)
    result = cli(
        "deployment",
        "create",
        str(tiny_model_dir),
        "--deployment-id",
        "mismatch",
        "--draft-model",
        str(other_tok),
        "--draft-token-count",
        "4",
    )
    assert result.exit_code == 1
    assert "does not use the target's tokenizer" in " ".join(result.stderr.split())

    (depctl_home / "deployments" / "handmade.yaml").write_text("id: handmade\nmodel: [oops\n")
    rows = {r["id"]: r for r in cli_json("deployment", "list")}
    assert rows["good"]["status"]["state"] == "READY"
    assert rows["wontload"]["status"]["state"] == "FAILED"
    assert rows["handmade"]["status"]["state"] == "FAILED" and "handmade.yaml" in rows["handmade"]["status"]["reason"]
    daemon_view = daemon.wait_state("handmade", ("FAILED",))
    assert "handmade.yaml" in daemon_view["reason"]

    # a FAILED deployment answers 503 with its state; the good one still answers
    r = daemon.post("/v1/completions", {"model": "wontload", "prompt": "x"})
    assert r.status_code == 503 and "FAILED" in r.json()["error"]["message"]
    assert daemon.post("/v1/completions", {"model": "good", "prompt": "x", "max_tokens": 3}).status_code == 200


def test_cuda_request_without_cuda_fails_with_reason(daemon, tiny_model_dir):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the failure path cannot be shown here")
    result = cli("deployment", "create", str(tiny_model_dir), "--deployment-id", "gpu", "--device", "cuda")
    assert result.exit_code == 2 and "sees no CUDA GPU" in result.stderr  # the CLI refuses before writing
    assert not (daemon.home / "deployments" / "gpu.yaml").exists()
    # a spec written by hand gets as far as the daemon, which says why it cannot load it
    SpecStore(daemon.home / "deployments").create(
        DeploymentSpec(id="gpu", model=str(tiny_model_dir), device="cuda", compile=False)
    )
    status = daemon.wait_state("gpu")
    assert status["state"] == "FAILED" and "torch sees no CUDA GPU" in status["reason"]


def test_daemon_binds_localhost_and_cli_autostarts(depctl_home, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("DEPCTL_PORT", "0")
    result = cli("deployment", "create", str(tiny_model_dir), "--deployment-id", "auto", "-o", "json")
    try:
        assert result.exit_code == 0, result.stderr
        assert "starting one" in result.stderr
        info = json.loads((depctl_home / "daemon.json").read_text())
        assert info["host"] == "127.0.0.1"
        status = cli_json("daemon", "status")
        assert status["deployments"] == {"auto": "READY"}
    finally:
        assert cli("daemon", "stop").exit_code == 0
    assert not (depctl_home / "daemon.json").exists()
    assert cli("daemon", "status").exit_code != 0


def _daemon_pids(home) -> list[int]:
    import psutil

    pids = []
    for proc in psutil.process_iter(["cmdline", "environ"]):
        try:
            cmd = proc.info["cmdline"] or []
            env = proc.info["environ"] or {}
        except (psutil.Error, OSError):
            continue
        if "depctl_runtime" in cmd:  # python [-P] -m depctl_runtime ...
            if env.get("DEPCTL_HOME") == str(home):
                pids.append(proc.pid)
    return pids


def test_one_daemon_per_home_however_many_start_at_once(depctl_home, monkeypatch):
    # the bug: `daemon start & daemon start` left a daemon serving that `status` did not see and `stop` could not stop
    import subprocess
    import sys

    monkeypatch.setenv("DEPCTL_PORT", "0")
    starts = [
        subprocess.Popen(
            [sys.executable, "-m", "depctl", "daemon", "start"], stderr=subprocess.PIPE, text=True, env={**os.environ}
        )
        for _ in range(4)
    ]
    try:
        errs = [p.communicate(timeout=120)[1] for p in starts]
        assert all(p.returncode == 0 for p in starts), errs
        assert sum("Started" in e for e in errs) == 1 and sum("Already running" in e for e in errs) == 3, errs
        assert len(_daemon_pids(depctl_home)) == 1
        # a daemon started by hand on the same home refuses, naming the running one
        info = json.loads((depctl_home / "daemon.json").read_text())
        hand = subprocess.run(
            [sys.executable, "-m", "depctl_runtime", "--port", "0"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ},
        )
        assert hand.returncode == 3 and f"pid {info['pid']}" in hand.stderr
        assert cli_json("daemon", "status")["pid"] == info["pid"]
    finally:
        assert cli("daemon", "stop").exit_code == 0
    assert _daemon_pids(depctl_home) == []
    assert cli("daemon", "status").exit_code != 0


def test_cli_uses_the_daemons_api_key(depctl_home, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("DEPCTL_PORT", "0")
    result = cli("daemon", "start", "--api-key", "sk-local-key")
    try:
        assert result.exit_code == 0, result.stderr
        info = json.loads((depctl_home / "daemon.json").read_text())
        assert (depctl_home / "daemon.json").stat().st_mode & 0o077 == 0  # it holds the key: owner only
        url = f"http://{info['host']}:{info['port']}"
        import httpx

        assert httpx.get(url + "/v1/models").status_code == 401
        rec = cli_json("deployment", "create", str(tiny_model_dir), "--deployment-id", "keyed")
        assert rec["status"]["state"] == "READY"
        assert cli("generate", "keyed", "hi", "--max-tokens", "3").exit_code == 0
        monkeypatch.setenv("DEPCTL_API_KEY", "sk-wrong")  # the environment wins over daemon.json
        result = cli("deployment", "list")
        assert result.exit_code != 0 and "401" in result.stderr
    finally:
        monkeypatch.delenv("DEPCTL_API_KEY")
        assert cli("daemon", "stop").exit_code == 0


def test_stop_drains_then_cuts_streams_with_an_error_and_done(depctl_home, tmp_path):
    # graceful stop: a stream still running after the drain time is cut with an error event and [DONE] (it used to
    # end mid-stream with neither), the daemon exits 0, and the next start restores the deployment
    from depctl.spec import DeploymentSpec
    from depctl.store import SpecStore

    # the stream must outlast the 0.3 s drain: 30000 tokens (a tiny model with room for them) and compile=False,
    # seconds on any machine. On a quiet machine the eager tiny model once wrote 500 tokens within the drain.
    model = save_tiny(tmp_path / "long-context", seed=0, max_positions=LONG)
    SpecStore().create(DeploymentSpec(id="d", model=str(model), compile=False))
    daemon = DaemonProcess(depctl_home, env={"DEPCTL_DRAIN_TIMEOUT": "0.3"}).start()
    try:
        _stop_mid_stream(daemon)
    finally:
        daemon.stop()


def _stop_mid_stream(daemon) -> None:
    import threading

    import httpx

    daemon.wait_state("d")
    lines = []

    def long_stream():
        body = {
            "model": "d",
            "prompt": "go",
            "max_tokens": LONG_ANSWER,
            "ignore_eos": True,
            "stream": True,
            "speculate": False,
        }
        with httpx.stream("POST", daemon.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    lines.append(line[5:].strip())

    reader = threading.Thread(target=long_stream)
    reader.start()
    while not lines:
        time.sleep(0.01)
    t0 = time.monotonic()
    daemon.proc.terminate()
    assert daemon.proc.wait(30) == 0
    reader.join(30)
    assert time.monotonic() - t0 < 0.3 + 8
    assert lines[-1] == "[DONE]"
    error = json.loads(lines[-2])["error"]
    assert error["code"] == "daemon_stopping" and "DEPCTL_DRAIN_TIMEOUT" in error["message"]
    assert 3 < len(lines) < LONG_ANSWER  # it streamed for the drain time, then was cut
    daemon.log.close()
    daemon.start()
    assert daemon.wait_state("d")["state"] == "READY"


def test_keep_alive_unloads_an_idle_deployment_and_a_request_loads_it_again(daemon, tiny_model_dir):
    rec = cli_json(
        "deployment", "create", str(tiny_model_dir), "--deployment-id", "nap", "--no-compile", "--keep-alive", "2s"
    )
    assert rec["status"]["state"] == "READY" and rec["keep_alive"] == 2.0
    body = {"model": "nap", "prompt": "abcabcabc", "max_tokens": 8, "temperature": 0}
    first = daemon.post("/v1/completions", body).json()["choices"][0]["text"]
    idle = daemon.wait_state("nap", ("IDLE",), timeout=30)
    assert "unloaded after 2s idle" in idle["reason"] and idle.get("memory_bytes") is None
    assert [m["id"] for m in daemon.get("/v1/models").json()["data"]] == ["nap"]  # still offered
    # the next request waits while it loads again, and gets the same answer
    again = daemon.post("/v1/completions", body)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == first
    assert daemon.get("/depctl/v1/deployments/nap").json()["state"] == "READY"
    # forever: it stays loaded, applied without a reload
    ready_at = daemon.get("/depctl/v1/deployments/nap").json()["ready_at"]
    rec = cli_json("deployment", "update", "nap", "--keep-alive", "forever")
    assert rec["keep_alive"] is None and rec["status"]["ready_at"] == ready_at
    # (that it then never unloads is test_manager's, without waiting on the clock)


def test_generate_says_it_is_loading_a_deployment_unloaded_by_keep_alive(daemon, tiny_model_dir):
    """Its first line names the wait as it starts, then the load's stages; the answer's first-token time is the
    answer's alone, not the load's."""
    import re

    cli_json(
        "deployment", "create", str(tiny_model_dir), "--deployment-id", "nap", "--no-compile", "--keep-alive", "1s"
    )
    daemon.wait_state("nap", ("IDLE",), timeout=30)
    result = cli("generate", "nap", "hello", "--max-tokens", "4")
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    assert lines[0].endswith("] loading nap (unloaded after keep-alive)"), result.stderr
    assert any("loading nap (unloaded after keep-alive): " in line for line in lines[1:]), result.stderr
    load_seconds = daemon.get("/depctl/v1/deployments/nap").json()["load_seconds"]
    first_token_ms = float(re.search(r"first token (\d+) ms", result.stderr).group(1))
    assert first_token_ms < 1000 * load_seconds, (first_token_ms, load_seconds)


def test_reloads_and_deletes_give_their_memory_back(daemon, depctl_home, tmp_path):
    """A compiled library keeps aliases of the weights it borrows that torch 2.13's runtime never drops: every reload
    of a 135M deployment once kept ~1 GB for the life of the daemon."""
    import psutil

    model = save_tiny(tmp_path / "bigger", seed=0, hidden=512, layers=4)  # ~40 MB of float32 weights a load
    store = SpecStore()
    store.create(DeploymentSpec(id="m", model=str(model), device="cpu", max_batch_size=4))
    daemon.wait_state("m", ("READY",), timeout=600)  # the first load builds the library (later loads reuse it)
    proc = psutil.Process(daemon.proc.pid)

    def reload(times: int) -> None:
        for _ in range(times):
            ready_at = daemon.get("/depctl/v1/deployments/m").json()["ready_at"]
            store.update("m", lambda s: s.model_copy(update={"max_batch_size": 12 - s.max_batch_size}))
            deadline = time.monotonic() + 120
            while daemon.get("/depctl/v1/deployments/m").json().get("ready_at") == ready_at:
                assert time.monotonic() < deadline, daemon.log_text()
                daemon.post("/depctl/v1/reconcile")
                time.sleep(0.2)
            assert daemon.post("/v1/completions", {"model": "m", "prompt": "a", "max_tokens": 4}).status_code == 200

    def grown() -> int:
        return proc.memory_info().rss - start

    reload(2)  # allocator pools and caches warm up
    start = proc.memory_info().rss
    reload(20)
    # a replaced engine is freed once its last request is done: wait for that, not for a time
    wait_until(lambda: grown() < 150 * 2**20, "the replaced engines' memory to go back", timeout=30)
    store.delete("m")
    wait_until(
        lambda: daemon.post("/depctl/v1/reconcile") and daemon.get("/depctl/v1/deployments/m").status_code == 404,
        "the deployment to be deleted",
    )
    wait_until(lambda: grown() < 150 * 2**20, "the last engine's weights to go with it", timeout=30)
