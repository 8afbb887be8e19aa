"""The real vLLM, end to end: run where vLLM is installed, and by CI (.ci/run sets DEPCTL_TEST_VLLM=1).

Setup goes through the project's own command, `depctl engine install vllm --with-ray` (its own virtualenv, ~3.5 GB,
a few minutes the first time; reused after). Then: what `deployment export` prints is checked against vLLM's own
argument parser, engine config (SpeculativeConfig included) and Ray Serve's LLMConfig; and a deployment with n-gram
speculation runs on vLLM through the daemon: create, a chat completion and a stream through the `openai` client,
vLLM's speculation counters moved, delete, nothing left running.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import openai
import psutil
import pytest

from depctl import engines, models
from depctl.export import ray_serve_config, vllm_argv
from depctl.spec import DeploymentSpec, DraftModelSpeculation, NgramSpeculation
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
CHECK = Path(__file__).parent / "check_in_vllm.py"


def _wanted() -> str | None:
    """Why these are skipped, or None to run them: on when asked (DEPCTL_TEST_VLLM=1, which installs vLLM) and
    whenever vLLM is already installed, unless DEPCTL_TEST_VLLM=0."""
    asked = os.environ.get("DEPCTL_TEST_VLLM")
    if asked == "1":
        return None
    if asked == "0":
        return "real vLLM: DEPCTL_TEST_VLLM=0 turns these off"
    env = engines.vllm_env()
    if env is not None and engines.has_ray(env.python):
        return None
    return (
        "real vLLM is not installed: `depctl engine install vllm --with-ray` (~3.5 GB) runs these from then on; "
        "DEPCTL_TEST_VLLM=1 installs it and runs them (CI does)"
    )


pytestmark = [pytest.mark.engines, pytest.mark.skipif(_wanted() is not None, reason=_wanted() or "")]


@pytest.fixture(scope="module")
def vllm_python() -> str:
    env = engines.vllm_env()
    if env is None or not engines.has_ray(env.python):
        proc = subprocess.run(
            [sys.executable, "-m", "depctl", "engine", "install", "vllm", "--with-ray"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        env = engines.vllm_env()
    return env.python


@pytest.fixture(scope="module")
def model_dir() -> str:
    return models.materialize(models.resolve(models.DEFAULT_MODEL))


def _check(python: str, *args: str) -> dict:
    proc = subprocess.run(
        [python, str(CHECK), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    assert proc.returncode == 0, f"vLLM refused it:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "speculation",
    [
        NgramSpeculation(ngram_length=3, num_draft_tokens=4),
        DraftModelSpeculation(draft_model="smollm2-135m-instruct", num_draft_tokens=3),
    ],
)
def test_export_is_what_vllm_builds(vllm_python, model_dir, speculation):
    eager = isinstance(speculation, DraftModelSpeculation)  # --no-compile is vLLM's --enforce-eager
    spec = DeploymentSpec(
        id="v",
        model="smollm2-135m-instruct",
        engine="vllm",
        speculation=speculation,
        max_context_length=2048,
        max_batch_size=4,
        compile=not eager,
    )
    described = _check(vllm_python, "argv", json.dumps(vllm_argv(spec, model_dir, model_dir)), "--build")
    assert described["enforce_eager"] is eager
    built = described["built"]
    assert built["method"] == speculation.method
    assert built["num_speculative_tokens"] == speculation.num_draft_tokens
    assert (built["max_model_len"], built["max_num_seqs"]) == (2048, 4)
    if isinstance(speculation, NgramSpeculation):
        assert built["prompt_lookup_min"] == built["prompt_lookup_max"] == 3
    else:
        assert built["draft_model"] == model_dir
    # Ray Serve: the same settings as engine_kwargs, through vLLM's engine args and Ray's LLMConfig
    llm = ray_serve_config(spec, model_dir, model_dir, 1, 4)["applications"][0]["args"]["llm_configs"][0]
    built = _check(
        vllm_python, "kwargs", json.dumps({"model": model_dir, "engine_kwargs": llm["engine_kwargs"]}), "--build"
    )["built"]
    assert built["method"] == speculation.method and built["max_model_len"] == 2048
    ray = _check(vllm_python, "ray", json.dumps(llm))
    assert ray["model_id"] == "v" and ray["autoscaling"]["max_replicas"] == 4


def test_parallel_settings_parse(vllm_python, model_dir):
    spec = DeploymentSpec(
        id="v",
        model="smollm2-135m-instruct",
        engine="vllm",
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        ray_address="auto",
    )
    parsed = _check(vllm_python, "argv", json.dumps(vllm_argv(spec, model_dir, None)))
    assert (parsed["tensor_parallel_size"], parsed["pipeline_parallel_size"]) == (2, 2)
    assert parsed["distributed_executor_backend"] == "ray"


def _depctl(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "depctl", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def _ours(home: Path) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get("DEPCTL_HOME") == str(home):
                found.append(p)
        except psutil.Error:
            pass
    return found


def test_a_deployment_runs_on_vllm_through_depctl(vllm_python, depctl_home):
    try:
        r = _depctl(
            "deployment",
            "create",
            "smollm2-135m-instruct",
            "--deployment-id",
            "v",
            "--engine",
            "vllm",
            "--ngram-speculation-length",
            "3",
            "--draft-token-count",
            "4",
            "--max-context-length",
            "2048",
            "--wait-timeout",
            "900",
            "-o",
            "json",
        )
        assert r.returncode == 0, r.stderr[-3000:]
        status = json.loads(r.stdout)["status"]
        assert status["state"] == "READY" and status["engine"] == "vllm" and status["vllm"]["pid"]
        url = json.loads((depctl_home / "daemon.json").read_text())
        client = openai.OpenAI(
            base_url=f"http://{url['host']}:{url['port']}/v1", api_key="unused", max_retries=0, timeout=300
        )
        text = "the quick brown fox jumps over the lazy dog. " * 3
        messages = [{"role": "user", "content": f"Repeat exactly: {text}"}]
        r1 = client.chat.completions.create(model="v", messages=messages, max_tokens=48, temperature=0)
        assert r1.model == "v" and r1.id.startswith("chatcmpl-") and "fox" in r1.choices[0].message.content
        streamed = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model="v", messages=messages, max_tokens=48, temperature=0, stream=True
            )
            if c.choices
        )
        assert streamed == r1.choices[0].message.content  # greedy: the stream says what the whole answer said
        _structured_fields_pass_through(client)
        stats = json.loads(_depctl("deployment", "get", "v", "-o", "json").stdout)["status"]["stats"]
        assert stats["source"] == "vllm" and stats["requests"] >= 2
        assert stats["drafts"] > 0 and stats["accepted_tokens"] > 0, stats  # vLLM's counters moved
        assert _depctl("deployment", "delete", "v").returncode == 0
        wait_until(
            lambda: not [p for p in _ours(depctl_home) if "vllm" in " ".join(p.cmdline())],
            "the deleted deployment's vLLM server to exit",
        )
    finally:
        _depctl("daemon", "stop", timeout=120)
    wait_until(lambda: not _ours(depctl_home), "every process the daemon started to exit", timeout=30)


def _structured_fields_pass_through(client) -> None:
    """The same fields as on our engine (tests/runtime/api/test_openai_api.py), answered by vLLM."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "year": {"type": "integer"}},
        "required": ["city", "year"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model="v",
        messages=[{"role": "user", "content": "Paris hosted the Olympics in 1924. Reply with JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "fact", "schema": schema}},
        max_tokens=60,
        temperature=0,
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.completions.create(
        model="v",
        prompt="id: ",
        max_tokens=10,
        temperature=0,
        extra_body={"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}},
    )
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", r.choices[0].text), r.choices[0].text
    r = client.chat.completions.create(
        model="v",
        messages=[{"role": "user", "content": "Say hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        presence_penalty=0.5,
        frequency_penalty=0.5,
    )
    content = r.choices[0].logprobs.content
    assert content and all(t.logprob <= 0 and len(t.top_logprobs) >= 2 for t in content)
