"""--engine vllm in the daemon, against a stand-in vLLM server (fake_vllm/): start-up, the proxy (depctl's ids,
validation and error envelope), vLLM's counters in the status, crash restarts, start-up failures, and no process
left behind by delete, a daemon stop, or a daemon killed with SIGKILL. The real vLLM: tests/engines."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import psutil
import pytest

from depctl.spec import DeploymentSpec, NgramSpeculation
from depctl.store import SpecStore
from depctl_runtime.backends.vllm_process import reap_orphans, run_dir
from depctl_runtime.backends.vllm_wire import parse_metrics, stats_from_metrics
from tests.daemon_util import DaemonProcess
from tests.waiting import wait_until

pytestmark = pytest.mark.slow  # daemons supervising a stand-in vLLM server, with restarts

FAKE = Path(__file__).parent / "fake_vllm"


@pytest.fixture
def fake_python(tmp_path) -> str:
    """An interpreter that imports the stand-in ``vllm`` (and this venv's torch, as the engine probe wants)."""
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{FAKE}" exec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def _daemon(home: Path, fake_python: str, tmp_path: Path, **env) -> DaemonProcess:
    return DaemonProcess(
        home, env={"DEPCTL_VLLM_PYTHON": fake_python, "FAKE_VLLM_RECORD": str(tmp_path / "bodies.jsonl"), **env}
    ).start()


def _spec(tiny_model_dir, dep_id="v", **kw) -> DeploymentSpec:
    return DeploymentSpec(
        id=dep_id,
        model=str(tiny_model_dir),
        engine="vllm",
        device="cpu",
        speculation=NgramSpeculation(ngram_length=3, num_draft_tokens=4),
        **kw,
    )


def _servers(home: Path) -> list[psutil.Process]:
    """The stand-in servers this test's daemon started (their environment names the daemon's home's record file)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if "vllm.entrypoints.openai.api_server" in " ".join(p.info["cmdline"] or ()) and p.environ().get(
                "DEPCTL_HOME"
            ) == str(home):
                found.append(p)
        except psutil.Error:
            pass
    return found


def _gone(home: Path, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _servers(home):
            return True
        time.sleep(0.2)
    return False


def test_serves_through_the_daemon_with_depctls_ids_errors_and_counters(
    depctl_home, tiny_model_dir, fake_python, tmp_path
):
    SpecStore().create(_spec(tiny_model_dir, max_context_length=64))
    d = _daemon(depctl_home, fake_python, tmp_path)
    try:
        status = d.wait_state("v")
        assert status["state"] == "READY", status
        assert status["engine"] == "vllm" and status["vllm"]["version"] == "0.0.0+fake" and status["vllm"]["pid"]
        assert "fake vLLM: argv" in d.log_text()  # vLLM's output reaches the daemon's log
        client = openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        r = client.chat.completions.create(model="v", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
        assert r.choices[0].message.content == "hello from vllm"
        assert r.model == "v" and r.id.startswith("chatcmpl-") and r.id != "chatcmpl-fromvllm"
        raw = d.post(
            "/v1/chat/completions", {"model": "v", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        ).json()
        assert set(raw) <= {"id", "object", "created", "model", "choices", "usage"}  # not vLLM's extras
        assert set(raw["choices"][0]) == {"index", "message", "finish_reason", "logprobs"}
        assert raw["choices"][0]["message"] == {"role": "assistant", "content": "hello from vllm"}

        chunks = list(
            client.chat.completions.create(
                model="v", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True
            )
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "hello from vllm"
        assert all(c.usage is None for c in chunks) and len({c.id for c in chunks}) == 1
        chunks = list(
            client.completions.create(
                model="v", prompt="abc", max_tokens=5, stream=True, stream_options={"include_usage": True}
            )
        )
        assert chunks[-1].usage.completion_tokens == 3 and "".join(c.choices[0].text for c in chunks if c.choices)
        # under speculation a chunk may carry several tokens: the count is vLLM's, not the chunks'
        r = client.completions.create(model="v", prompt="abc", max_tokens=7)
        assert r.choices[0].text == "hello from vllm" and r.usage.completion_tokens == 7
        assert r.usage.prompt_tokens_details.cached_tokens == 3  # vLLM's prefix cache, as vLLM counted it

        bodies = [json.loads(line) for line in (tmp_path / "bodies.jsonl").read_text().splitlines()]
        assert all(b["model"] == "v" and "speculate" not in b for b in bodies)
        assert bodies[2]["stream_options"] == {"include_usage": True}  # asked for the daemon's metrics

        # depctl's own validation first: the same 400s as its own engine
        with pytest.raises(openai.BadRequestError, match="context holds 64 tokens"):
            client.chat.completions.create(model="v", messages=[{"role": "user", "content": "hi"}], max_tokens=500)
        with pytest.raises(openai.BadRequestError, match="n"):
            client.chat.completions.create(model="v", messages=[{"role": "user", "content": "hi"}], n=17)
        # vLLM's own refusals, in depctl's envelope
        r = d.post(
            "/v1/chat/completions", {"model": "v", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 13}
        )
        assert r.status_code == 400
        assert r.json()["error"] == {
            "message": "fake refusal of max_tokens=13",
            "type": "invalid_request_error",
            "param": "max_tokens",
            "code": None,
        }

        # the daemon reads vLLM's counters at most once a second: wait for a reading that has the requests in it
        stats = wait_until(
            lambda: (s := d.get("/depctl/v1/deployments/v").json()["stats"]).get("drafts") and s,
            "vLLM's counters to be read",
        )
        assert (
            stats["source"] == "vllm"
            and stats["drafts"] > 0
            and stats["accepted_per_position"][:2] == [2 * stats["requests"], 2 * stats["requests"]]
        )
        assert "depctl:spec_decode_num_drafts_total" in d.get("/metrics").text
        assert [m["id"] for m in d.get("/v1/models").json()["data"]] == ["v"]
        assert d.get("/v1/models").json()["data"][0]["max_model_len"] == 64

        SpecStore().delete("v")
        d.post("/depctl/v1/reconcile")
        assert _gone(depctl_home), "delete left the vLLM server running"
    finally:
        d.stop()
    assert _gone(depctl_home)


def test_a_crashed_server_is_failed_then_restarted(depctl_home, tiny_model_dir, fake_python, tmp_path):
    SpecStore().create(_spec(tiny_model_dir))
    d = _daemon(depctl_home, fake_python, tmp_path)
    try:
        first = d.wait_state("v")["vllm"]["pid"]
        os.kill(first, signal.SIGKILL)
        failed = d.wait_state("v", ("FAILED",), timeout=10)
        assert "was killed by SIGKILL" in failed["reason"] and "restarting in" in failed["reason"]
        back = d.wait_state("v", ("READY",), timeout=60)
        assert back["vllm"]["restarts"] == 1 and back["vllm"]["pid"] != first
        assert d.post("/v1/completions", {"model": "v", "prompt": "a", "max_tokens": 2}).status_code == 200
    finally:
        d.stop()
    assert _gone(depctl_home), "daemon stop left the vLLM server running"


def test_a_restart_counts_its_time_from_when_it_began_not_from_the_last_log_line(
    depctl_home, tiny_model_dir, fake_python, tmp_path
):
    SpecStore().create(_spec(tiny_model_dir))
    d = _daemon(depctl_home, fake_python, tmp_path, FAKE_VLLM_SLOW_START="4")
    try:
        os.kill(d.wait_state("v", ("READY",), timeout=60)["vllm"]["pid"], signal.SIGKILL)
        restarting = d.wait_state("v", ("CREATING",), timeout=20)
        seen = set()
        while restarting["state"] == "CREATING":  # the server logs a line every 0.2 s while it loads
            seen.add(restarting["state_since"])
            time.sleep(0.3)
            restarting = d.get("/depctl/v1/deployments/v").json()
        assert restarting["state"] == "READY"
        assert len(seen) == 1, f"the restart's clock was reset {len(seen) - 1} times while it loaded"
        assert restarting["state_since"] - seen.pop() >= 3  # it was CREATING for the whole load
    finally:
        d.stop()


def test_a_server_that_cannot_start_is_failed_with_its_error_after_three_tries(
    depctl_home, tiny_model_dir, fake_python, tmp_path
):
    SpecStore().create(_spec(tiny_model_dir))
    d = _daemon(depctl_home, fake_python, tmp_path, FAKE_VLLM_FAIL="1")
    try:
        status = d.wait_state("v", ("FAILED",), timeout=30)
        assert "fake start-up failure" in status["reason"]
        deadline = time.monotonic() + 30
        while "gave up after 3 attempts" not in status["reason"] and time.monotonic() < deadline:
            time.sleep(0.3)
            status = d.get("/depctl/v1/deployments/v").json()
        assert "gave up after 3 attempts" in status["reason"] and "status 1" in status["reason"]
        r = d.post("/v1/completions", {"model": "v", "prompt": "a"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "deployment_failed"
    finally:
        d.stop()


def test_a_killed_daemon_takes_its_servers_along_and_a_new_one_starts_no_duplicate(
    depctl_home, tiny_model_dir, fake_python, tmp_path
):
    SpecStore().create(_spec(tiny_model_dir))
    d = _daemon(depctl_home, fake_python, tmp_path)
    d.wait_state("v")
    d.kill()  # SIGKILL: no shutdown code runs
    assert _gone(depctl_home, 10), "the server outlived a daemon killed with SIGKILL"
    d = _daemon(depctl_home, fake_python, tmp_path)
    try:
        assert d.wait_state("v")["state"] == "READY"
        assert len(_servers(depctl_home)) == 1
    finally:
        d.stop()
    assert _gone(depctl_home)


def test_a_new_daemon_reaps_servers_an_old_one_left(depctl_home):
    # a server whose daemon died without PR_SET_PDEATHSIG's help (not Linux, or a double fork)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        record = run_dir() / "vllm-old.json"
        record.write_text(
            json.dumps({"pid": proc.pid, "create_time": psutil.Process(proc.pid).create_time(), "deployment": "old"})
        )
        (run_dir() / "vllm-reused.json").write_text(json.dumps({"pid": os.getpid(), "create_time": 1.0}))
        assert reap_orphans() == [proc.pid]
        assert proc.wait(20) is not None
        assert not list(run_dir().glob("vllm-*.json"))  # and this process (a reused pid) was left alone
    finally:
        proc.kill()


def test_vllm_metrics_become_depctl_stats():
    text = """# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="v"} 4.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="v"} 16.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="v"} 10.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="v",position="1"} 3.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="v",position="0"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="v",position="0"} 1.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="v"} 2.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="v"} 1.0
"""
    stats = stats_from_metrics(parse_metrics(text))
    assert stats["requests"] == 3 and stats["drafts"] == 4 and stats["draft_tokens"] == 16
    assert stats["acceptance_rate"] == 0.625 and stats["mean_acceptance_length"] == 3.5
    assert stats["accepted_per_position"] == [5, 3]  # ordered by position, summed over engines
    assert stats_from_metrics({})["acceptance_rate"] is None


def test_the_call_grammar_depctl_adds_to_tool_choice_auto_is_not_sent_to_vllm():
    from depctl.spec import DeploymentSpec
    from depctl_runtime.backends import GenerateRequest
    from depctl_runtime.backends.base import Constraint
    from depctl_runtime.backends.vllm import VLLMBackend
    from depctl_runtime.speculation import GenerationParams

    backend = VLLMBackend(DeploymentSpec(id="v", model="m"), owner=None, load_timeout=1)
    lazy = GenerateRequest([1], GenerationParams(), (), Constraint("grammar", "start: x", "tools", optional=True))
    assert backend.prepare(lazy).constraint is None
    asked = GenerateRequest([1], GenerationParams(), (), Constraint("regex", "a+", "structured_outputs.regex"))
    assert backend.prepare(asked).constraint == asked.constraint


def test_a_request_that_needs_a_special_token_shown_asks_vllm_to_show_them():
    from depctl_runtime.backends import GenerateRequest
    from depctl_runtime.backends.vllm_wire import completion_payload
    from depctl_runtime.speculation import GenerationParams

    plain = GenerateRequest([1], GenerationParams())
    assert "skip_special_tokens" not in completion_payload("m", plain)  # vLLM's default: dropped
    mistral = GenerateRequest([1], GenerationParams(), shown_tokens=(5,))  # Mistral's [TOOL_CALLS]
    assert completion_payload("m", mistral)["skip_special_tokens"] is False
