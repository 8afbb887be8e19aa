"""The OpenAI API of a live daemon (tiny models), through the official ``openai`` SDK."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
from prometheus_client.parser import text_string_to_metric_families

from depctl.spec import DeploymentSpec, DraftModelSpeculation, NgramSpeculation, SuffixSpeculation
from depctl.store import SpecStore
from tests.daemon_util import DaemonProcess
from tests.tiny import (
    LLAMA31_TEMPLATE,
    LONG,
    LONG_ANSWER,
    MISTRAL_TEMPLATE,
    MISTRAL_V11_TEMPLATE,
    TOOLS_TEMPLATE,
    VOCAB,
    save_tiny,
    save_tiny_head,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.slow  # a daemon in a subprocess with a dozen deployments

GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, tiny_model_dir, tiny_draft_dir):
    home = tmp_path_factory.mktemp("api-home")
    store = SpecStore(home / "deployments")
    # the deployments whose outputs the tests compare: some compile their passes and some do not, and only in float32
    # do fused kernels agree with eager ops (in bf16 they round apart, as any two builds of a model may)
    tiny = {"model": str(tiny_model_dir), "dtype": "float32"}
    store.create(DeploymentSpec(id="ngram", **tiny, speculation=NgramSpeculation(ngram_length=3, num_draft_tokens=4)))
    store.create(DeploymentSpec(id="plain", **tiny, compile=False))
    # a disconnect must land while the generation is still being written: 30000 eager tokens of a tiny model with room
    # for them, seconds on any machine (400 of the 512-position one once finished before the client hung up)
    long_context = save_tiny(tmp_path_factory.mktemp("long-context"), seed=0, max_positions=LONG)
    store.create(DeploymentSpec(id="long", model=str(long_context), compile=False))
    store.create(DeploymentSpec(id="suffix", **tiny, speculation=SuffixSpeculation(num_draft_tokens=8)))
    store.create(
        DeploymentSpec(
            id="drafted",
            **tiny,
            speculation=DraftModelSpeculation(draft_model=str(tiny_draft_dir), num_draft_tokens=3),
        )
    )
    head = save_tiny_head(tmp_path_factory.mktemp("head") / "head", tiny_model_dir)
    store.create(
        DeploymentSpec(
            id="eagle",
            **tiny,
            compile=False,
            speculation=DraftModelSpeculation(draft_model=str(head), num_draft_tokens=3),
        )
    )
    store.create(DeploymentSpec(id="broken", model=str(tiny_model_dir / "missing")))
    with_tools = save_tiny(
        tmp_path_factory.mktemp("with-tools"), seed=0, chat_template=TOOLS_TEMPLATE, max_positions=2048
    )
    store.create(
        DeploymentSpec(
            id="tools", model=str(with_tools), speculation=NgramSpeculation(ngram_length=2, num_draft_tokens=4)
        )
    )
    llama = save_tiny(tmp_path_factory.mktemp("llama"), seed=0, chat_template=LLAMA31_TEMPLATE, max_positions=4096)
    store.create(DeploymentSpec(id="llama", model=str(llama), compile=False))
    mistral = save_tiny(
        tmp_path_factory.mktemp("mistral"),
        chat_template=MISTRAL_TEMPLATE,
        specials=("[TOOL_CALLS]",),  # a special token, as in Mistral's vocabularies: decoding would drop it
        max_positions=4096,
    )
    store.create(
        DeploymentSpec(
            id="mistral", model=str(mistral), speculation=NgramSpeculation(ngram_length=2, num_draft_tokens=4)
        )
    )
    mistral_v11 = save_tiny(
        tmp_path_factory.mktemp("mistral-v11"),
        chat_template=MISTRAL_V11_TEMPLATE,
        specials=("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
        vocab=VOCAB + 2,
        max_positions=8192,  # the template's own system prompt is 2.7k characters: a token each here
    )
    store.create(DeploymentSpec(id="mistral-v11", model=str(mistral_v11), compile=False))
    store.create(
        DeploymentSpec(
            id="small",
            model=str(tiny_model_dir),
            max_batch_size=2,
            speculation=NgramSpeculation(ngram_length=2, num_draft_tokens=4),
        )
    )
    d = DaemonProcess(home).start()
    deployments = ("ngram", "plain", "suffix", "drafted", "eagle", "broken", "small", "long", "tools", "llama")
    for dep in (*deployments, "mistral", "mistral-v11"):
        d.wait_state(dep)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_lists_ready_deployments(client):
    assert sorted(m.id for m in client.models.list()) == [
        "drafted",
        "eagle",
        "llama",
        "long",
        "mistral",
        "mistral-v11",
        "ngram",
        "plain",
        "small",
        "suffix",
        "tools",
    ]


def test_models_retrieve_answers_for_a_served_deployment_and_404_otherwise(client):
    model = client.models.retrieve("ngram")
    assert model.id == "ngram" and model.owned_by == "depctl" and model.model_extra["max_model_len"] == 512
    for missing in ("nope", "broken"):  # broken: known but never loaded
        with pytest.raises(openai.NotFoundError) as err:
            client.models.retrieve(missing)
        assert err.value.body["code"] == "model_not_found"


def test_tokenize_and_detokenize_a_prompt_and_chat_messages(daemon, client):
    prompt = daemon.post("/tokenize", {"model": "ngram", "prompt": "abcabc"}).json()
    assert prompt["count"] == len(prompt["tokens"]) and prompt["max_model_len"] == 512
    text = daemon.post("/detokenize", {"model": "ngram", "tokens": prompt["tokens"]}).json()["prompt"]
    assert text.endswith("abcabc")
    messages = [{"role": "user", "content": "abcabc"}]
    chat = daemon.post("/tokenize", {"model": "ngram", "messages": messages}).json()
    # the same prompt a chat completion would see: its usage counts exactly these tokens
    usage = client.chat.completions.create(model="ngram", messages=messages, max_tokens=1, **GREEDY).usage
    assert chat["count"] == usage.prompt_tokens and chat["count"] > prompt["count"]
    for body, param in (
        ({"model": "ngram"}, None),
        ({"model": "ngram", "prompt": "a", "messages": messages}, None),
        ({"model": "nope", "prompt": "a"}, "model"),
    ):
        r = daemon.post("/tokenize", body)
        assert r.status_code in (400, 404) and r.json()["error"]["code"], r.text
    r = daemon.post("/detokenize", {"model": "ngram", "tokens": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_n_choices_whole_and_streamed(client):
    # greedy: n identical choices, each its own row; usage counts the prompt once and every choice's tokens
    r = client.completions.create(model="ngram", prompt="abcabcabcabc", max_tokens=12, n=3, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2] and len({c.text for c in r.choices}) == 1
    one = client.completions.create(model="ngram", prompt="abcabcabcabc", max_tokens=12, **GREEDY)
    assert r.choices[0].text == one.choices[0].text
    assert r.usage.prompt_tokens == one.usage.prompt_tokens and r.usage.completion_tokens == 3 * 12
    # sampled with a seed: choice i uses seed + i, so a rerun repeats every choice, and they differ
    body = {"model": "plain", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "seed": 7}
    first = client.chat.completions.create(**body, n=2, temperature=1.0)
    again = client.chat.completions.create(**body, n=2, temperature=1.0)
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in again.choices] and texts[0] != texts[1]
    single = client.chat.completions.create(**body, temperature=1.0)
    assert single.choices[0].message.content == texts[0]
    # streamed: every choice's deltas carry its index, and join to the whole answer's choices
    parts = {0: "", 1: ""}
    finished, usage = set(), None
    for chunk in client.chat.completions.create(
        **body, n=2, temperature=1.0, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            parts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert [parts[0], parts[1]] == texts and finished == {0, 1}
    assert usage.completion_tokens == first.usage.completion_tokens
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="ngram", prompt="abc", max_tokens=2, n=17)
    assert err.value.body["param"] == "n"


def test_completion_shape_and_usage(client):
    r = client.completions.create(model="ngram", prompt="abcabcabcabc", max_tokens=20, **GREEDY)
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 20 and r.usage.total_tokens == r.usage.prompt_tokens + 20
    spec = r.usage.model_extra["speculation"]
    assert spec["drafted_tokens"] >= spec["accepted_tokens"] >= 0


def test_all_deployments_agree_greedily(client):
    # speculation never changes greedy output: n-gram and draft-model deployments equal the plain one
    texts = {
        dep: client.completions.create(model=dep, prompt="hello hello hello", max_tokens=30, **GREEDY).choices[0].text
        for dep in ("plain", "ngram", "suffix", "drafted", "eagle")
    }
    assert texts["ngram"] == texts["plain"] == texts["drafted"] == texts["suffix"] == texts["eagle"]


def test_prompts_are_recorded_only_while_the_owner_turns_recording_on(client, daemon):
    store = SpecStore(daemon.home / "deployments")
    recording = daemon.home / "recordings" / "small.jsonl"
    ask = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name a colour"}]
    client.chat.completions.create(model="small", messages=ask, max_tokens=2)
    assert not recording.exists()
    store.update("small", lambda s: s.model_copy(update={"record_prompts": True}))
    daemon.post("/depctl/v1/reconcile")
    assert daemon.wait_state("small")["state"] == "READY"  # applied in place: nothing reloads
    client.chat.completions.create(model="small", messages=ask, max_tokens=2)
    client.completions.create(model="small", prompt="once upon a time", max_tokens=2)
    lines = [json.loads(line) for line in recording.read_text().splitlines()]
    assert lines == [{"messages": ask}, {"prompt": "once upon a time"}]  # never the answers
    store.update("small", lambda s: s.model_copy(update={"record_prompts": False}))
    daemon.post("/depctl/v1/reconcile")
    client.chat.completions.create(model="small", messages=ask, max_tokens=2)
    assert len(recording.read_text().splitlines()) == 2


def test_firectl_model_form(client, tiny_model_dir):
    model = f"accounts/me/models/{tiny_model_dir.name}#ngram"
    r = client.completions.create(model=model, prompt="ab", max_tokens=3, **GREEDY)
    assert r.usage.completion_tokens == 3


def test_chat_and_streaming_with_usage(client):
    messages = [{"role": "user", "content": "say something"}]
    full = client.chat.completions.create(model="ngram", messages=messages, max_tokens=25, **GREEDY)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    chunks = list(
        client.chat.completions.create(
            model="ngram",
            messages=messages,
            max_tokens=25,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]


def test_completion_streaming(client):
    full = client.completions.create(model="plain", prompt="xyz", max_tokens=15, **GREEDY)
    chunks = list(client.completions.create(model="plain", prompt="xyz", max_tokens=15, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text


def test_stop_strings(client):
    full = client.completions.create(model="plain", prompt="hello", max_tokens=30, **GREEDY).choices[0].text
    visible = [ch for ch in full if ch.isprintable() and ch != "\ufffd"]
    stop = visible[len(visible) // 2]
    r = client.completions.create(model="plain", prompt="hello", max_tokens=30, stop=[stop], **GREEDY)
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"


def test_predicted_outputs(client):
    # A random model writes random bytes, and text with broken UTF-8 does not re-tokenize to the same ids. Pick a
    # prompt whose answer starts with plain ASCII (1 byte = 1 token here), so the prediction is exactly right there.
    for i in range(100):
        messages = [{"role": "user", "content": f"rewrite this {i}"}]
        expected = client.chat.completions.create(model="plain", messages=messages, max_tokens=40, **GREEDY)
        expected = expected.choices[0].message.content
        prefix = expected.split("\ufffd")[0]
        if len(prefix) >= 6:
            break
    else:
        pytest.fail("no prompt gave an ASCII start")
    right = client.chat.completions.create(
        model="plain", messages=messages, max_tokens=40, prediction={"type": "content", "content": expected}, **GREEDY
    )
    assert right.choices[0].message.content == expected
    details = right.usage.completion_tokens_details
    assert details.accepted_prediction_tokens >= len(prefix)  # every token of the ASCII start came from it
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == len(expected.encode())
    # a wrong prediction costs speed, never correctness, also on top of the deployment's own speculation
    wrong = client.chat.completions.create(
        model="ngram",
        messages=messages,
        max_tokens=40,
        prediction={"type": "content", "content": "nothing like it " * 5},
        **GREEDY,
    )
    assert wrong.choices[0].message.content == expected


def test_suffix_speculation_drafts_a_repeated_request_from_the_first(client, daemon):
    prompt = "the deployment has seen this prompt before: "
    first = client.completions.create(model="suffix", prompt=prompt, max_tokens=48, **GREEDY)
    again = client.completions.create(model="suffix", prompt=prompt, max_tokens=48, **GREEDY)
    assert again.choices[0].text == first.choices[0].text
    spec = again.usage.model_extra["speculation"]
    assert spec["method"] == "suffix (k=8)"
    # the second answer is drafted from the first: most of it accepted (the first token comes from the prefill, and
    # the first steps' matches, hence drafts, are still short), and nearly every draft right. How long the drafts are
    # is the policy's choice from measured pass costs, which move with the machine's load (34 of 48 accepted in one
    # fresh-clone run, 35 or more in the others): a majority, not a count tuned to one machine
    assert spec["accepted_tokens"] >= 24 and spec["acceptance_rate"] >= 0.9, spec
    index = daemon.get("/depctl/v1/deployments/suffix").json()["suffix_index"]
    assert index["requests"] >= 2 and index["tokens"] > 0 and index["hits"] > 0
    families = {f.name: f for f in text_string_to_metric_families(daemon.get("/metrics").text)}
    held = {s.labels["deployment"]: s.value for s in families["depctl:suffix_cache_tokens"].samples}
    assert held["suffix"] > 0


def test_suffix_speculation_drafts_only_from_the_same_users_traffic(daemon):
    # The deployment's scope is "user" (the default): another `user` field or another API key never drafts from
    # what one user sent, so its counts (and so its timing and chunking) are a first-time request's. The prompt is
    # one whose prompt and greedy answer repeat no 3 tokens under the tiny model: a first request drafts nothing.
    prompt = "DePTTReXBIUJikjnkobHi0"

    def ask(key: str, user: str):
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key=key, max_retries=0, timeout=60)
        r = client.completions.create(model="suffix", prompt=prompt, max_tokens=32, user=user, **GREEDY)
        return r.choices[0].text, r.usage.model_extra["speculation"]

    first_text, first = ask("key-a", "alice")
    assert first["drafted_tokens"] == 0, first
    runs = {who: ask(key, user) for who, key, user in (("alice", "key-a", "alice"), ("bob", "key-a", "bob"))}
    runs["alice, another key"] = ask("key-b", "alice")
    assert {text for text, _ in runs.values()} == {first_text}
    assert runs["alice"][1]["accepted_tokens"] >= 16, runs  # her own repeat is drafted from her first request
    for who in ("bob", "alice, another key"):
        assert runs[who][1]["drafted_tokens"] == 0, (who, runs[who])


def test_per_request_speculation_control(client, daemon):
    # a repeated request on suffix speculation: its every guess is right, so free drafting drafts on any machine
    # (an n-gram's guesses on a random model's output hit too rarely for the policy to draft on a busy one)
    prompt = "abcabcabcabcabcabcabc"
    ask = lambda **kw: client.completions.create(model="suffix", prompt=prompt, max_tokens=40, **GREEDY, **kw)  # noqa: E731
    first = ask()
    free = ask()
    off = ask(extra_body={"speculation": {"enabled": False}})
    capped = ask(extra_body={"speculation": {"max_draft_tokens": 1}})
    assert first.choices[0].text == free.choices[0].text
    assert off.choices[0].text == capped.choices[0].text == free.choices[0].text  # only the speed changes
    usage = {name: r.usage.model_extra["speculation"] for name, r in (("free", free), ("off", off), ("capped", capped))}
    assert usage["off"]["enabled"] is False and usage["off"]["drafted_tokens"] == 0
    assert usage["free"]["enabled"] is True and usage["free"]["drafted_tokens"] > 0
    # one draft token a step at most: no more draft tokens than steps (each step emits accepted + 1 tokens)
    steps = capped.usage.completion_tokens - 1 - usage["capped"]["accepted_tokens"]
    assert 0 < usage["capped"]["drafted_tokens"] <= steps
    for bad in ({"max_draft_tokens": -1}, {"max_draft_tokens": 99}, {"max_drafts": 2}, {"enabled": "maybe"}):
        r = daemon.post("/v1/completions", {"model": "ngram", "prompt": "a", "max_tokens": 2, "speculation": bad})
        assert r.status_code == 400, bad
        assert r.json()["error"]["param"].startswith("speculation"), r.json()


def test_errors_map_to_sdk_exceptions(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="x")
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="plain", prompt="x", max_tokens=10_000)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="plain", prompt="x", n=0)
    assert e.value.param == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="plain", prompt="x", temperature=-1)
    assert e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="plain", messages=[])
    with pytest.raises(openai.InternalServerError) as e:  # 503: the deployment exists but is FAILED
        client.completions.create(model="broken", prompt="x")
    assert e.value.status_code == 503 and "FAILED" in e.value.message


def test_unknown_fields_are_ignored(daemon):
    r = daemon.post(
        "/v1/completions",
        {"model": "plain", "prompt": "a", "max_tokens": 2, "frequency_penalty": 0, "some_future_field": {"x": 1}},
    )
    assert r.status_code == 200


def test_concurrent_clients_get_their_solo_outputs(client):
    prompts = [f"prompt number {i} " * (i % 3 + 1) for i in range(8)]
    solo = [
        client.completions.create(model="ngram", prompt=p, max_tokens=20, **GREEDY).choices[0].text for p in prompts
    ]
    with ThreadPoolExecutor(8) as pool:
        together = list(
            pool.map(
                lambda p: client.completions.create(model="ngram", prompt=p, max_tokens=20, **GREEDY).choices[0].text,
                prompts,
            )
        )
    assert together == solo


def test_requests_beyond_the_batch_size_wait_and_are_reported(client, daemon):
    # "small" decodes 2 requests at a time: 5 at once means 2 running and up to 3 waiting, in arrival order
    prompts = [f"batch {i} " * (i + 1) for i in range(5)]
    body = dict(max_tokens=150, extra_body={"ignore_eos": True}, **GREEDY)
    solo = [client.completions.create(model="small", prompt=p, **body).choices[0].text for p in prompts]
    seen = []

    def watch():
        while len(seen) < 400:
            status = daemon.get("/depctl/v1/deployments/small").json()
            seen.append((status["num_requests_running"], status["num_requests_waiting"]))
            if seen[-1] == (0, 0) and len(seen) > 5:
                return
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    with ThreadPoolExecutor(5) as pool:
        together = list(
            pool.map(lambda p: client.completions.create(model="small", prompt=p, **body).choices[0].text, prompts)
        )
    watcher.join()
    assert together == solo
    assert max(r for r, _ in seen) == 2  # never more than the batch size...
    assert max(w for _, w in seen) >= 1  # ...and the rest queued
    families = {f.name: f for f in text_string_to_metric_families(daemon.get("/metrics").text)}
    running = {s.labels["deployment"]: s.value for s in families["depctl:num_requests_running"].samples}
    waiting = {s.labels["deployment"]: s.value for s in families["depctl:num_requests_waiting"].samples}
    assert running["small"] == 0 and waiting["small"] == 0


def test_disconnect_stops_generation(daemon):
    stats = lambda: daemon.get("/depctl/v1/deployments/long").json()["stats"]  # noqa: E731
    before = stats()
    with httpx.stream(
        "POST",
        daemon.url + "/v1/completions",
        timeout=30,
        json={"model": "long", "prompt": "go", "max_tokens": LONG_ANSWER, "stream": True, "ignore_eos": True},
    ) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 3:
                break
    after = wait_until(lambda: (s := stats())["requests"] > before["requests"] and s, "the request to end")
    # without the cancel it would have run to its end
    assert after["generated_tokens"] - before["generated_tokens"] < LONG_ANSWER


def test_metrics(client, daemon):
    client.completions.create(model="ngram", prompt="abcabcabc", max_tokens=10, **GREEDY)
    families = {f.name: f for f in text_string_to_metric_families(daemon.get("/metrics").text)}
    for name in (
        "depctl:spec_decode_num_drafts",
        "depctl:spec_decode_num_draft_tokens",
        "depctl:spec_decode_num_accepted_tokens",
        "depctl:spec_decode_num_accepted_tokens_per_pos",
        "depctl:requests",
        "depctl:generation_tokens",
        "depctl:time_to_first_token_seconds",
        "depctl:inter_token_latency_seconds",
        "depctl:spec_decode_num_grammar_draft_tokens",
        "depctl:spec_decode_num_grammar_accepted_tokens",
        "depctl:grammar_seconds",
    ):
        assert name in families, name
    drafts = {s.labels["deployment"]: s.value for s in families["depctl:spec_decode_num_draft_tokens"].samples}
    assert drafts["ngram"] > 0
    ok = [
        s
        for s in families["depctl:requests"].samples
        if s.name.endswith("_total") and s.labels == {"deployment": "ngram", "endpoint": "completions", "status": "ok"}
    ]
    assert ok and ok[0].value >= 1


def test_cli_generate_and_bench(daemon, monkeypatch):

    from typer.testing import CliRunner

    from depctl.cli import app

    monkeypatch.setenv("DEPCTL_HOME", str(daemon.home))
    runner = CliRunner()
    result = runner.invoke(app, ["generate", "ngram", "hello", "--max-tokens", "8"])
    assert result.exit_code == 0, result.stderr
    assert "8 tokens in" in result.stderr and "acceptance" in result.stderr
    result = runner.invoke(app, ["deployment", "bench", "ngram", "--limit", "2", "--max-tokens", "16", "-o", "json"])
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["prompts"] == 2 and data["identical_output"] is True and data["tokens"] > 0
    result = runner.invoke(app, ["deployment", "bench", "ngram", "--workload", "nope"])
    assert result.exit_code == 2 and "no prompt set" in result.stderr


def test_cli_chat_answers_piped_stdin_once(daemon, monkeypatch):
    # as `echo hi | ollama run` does: all of stdin is one message (a conversation is tested in a terminal:
    # tests/depctl/test_terminal.py)
    from typer.testing import CliRunner

    from depctl.cli import app

    monkeypatch.setenv("DEPCTL_HOME", str(daemon.home))
    result = CliRunner().invoke(app, ["chat", "plain", "--max-tokens", "5"], input="hello\nand again\n\n")
    assert result.exit_code == 0, result.stderr
    assert result.stderr.count("5 tokens in") == 1


# ---- structured outputs, logprobs, penalties --------------------------------------------------------------------
class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=120)
    tags: list[Literal["a", "b"]] = pydantic.Field(max_length=2)


def test_parse_with_a_pydantic_model_under_every_method(client):
    # the SDK sends a strict json_schema response_format and parses the reply into the model
    messages = [{"role": "user", "content": "A person as JSON"}]
    contents = {}
    for dep in ("plain", "ngram", "suffix", "drafted"):
        r = client.chat.completions.parse(
            model=dep, messages=messages, response_format=Person, max_tokens=200, **GREEDY
        )
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        assert isinstance(r.choices[0].message.parsed, Person)
        contents[dep] = r.choices[0].message.content
    assert len(set(contents.values())) == 1, contents  # speculation never changes the output, grammar or not
    stream = client.chat.completions.create(
        model="ngram",
        messages=messages,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": {**Person.model_json_schema(), "additionalProperties": False}},
        },
        max_tokens=200,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    Person.model_validate_json("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    speculation = chunks[-1].usage.model_extra["speculation"]
    assert speculation["grammar_drafted_tokens"] >= speculation["grammar_accepted_tokens"] > 0


def test_structured_outputs_extension_on_completions(client):
    r = client.completions.create(
        model="ngram",
        prompt="id: ",
        max_tokens=20,
        extra_body={"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}},
        **GREEDY,
    )
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = client.completions.create(
        model="drafted",
        prompt="pick: ",
        max_tokens=20,
        extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe so"]}},
        **GREEDY,
    )
    assert r.choices[0].text in ("yes", "no", "maybe so")
    lark = 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,2}/'
    r = client.completions.create(
        model="suffix", prompt="t: ", max_tokens=40, extra_body={"structured_outputs": {"grammar": lark}}, **GREEDY
    )
    assert re.fullmatch(r"\(\d{1,2}(,\d{1,2})*\)", r.choices[0].text) or r.choices[0].finish_reason == "length"


def test_logprobs_are_the_targets_with_or_without_speculation(client):
    messages = [{"role": "user", "content": "abcabcabc"}]
    got = {}
    for dep in ("plain", "ngram", "drafted"):
        r = client.chat.completions.create(
            model=dep, messages=messages, max_tokens=20, logprobs=True, top_logprobs=3, **GREEDY
        )
        content = r.choices[0].logprobs.content
        assert len(content) == r.usage.completion_tokens == 20
        assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
        assert all(t.token == t.top_logprobs[0].token for t in content)  # greedy: the most likely token
        got[dep] = content
    for dep in ("ngram", "drafted"):
        assert [t.token for t in got[dep]] == [t.token for t in got["plain"]]
        assert [t.logprob for t in got[dep]] == pytest.approx([t.logprob for t in got["plain"]], abs=1e-4)
    stream = client.chat.completions.create(
        model="ngram", messages=messages, max_tokens=20, logprobs=True, top_logprobs=3, stream=True, **GREEDY
    )
    streamed = [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in got["ngram"]]
    r = client.completions.create(model="ngram", prompt="abcabc", max_tokens=10, logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 10
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0


def test_logit_bias_and_penalties_are_exact_under_speculation(client):
    r = client.completions.create(model="ngram", prompt="abc", max_tokens=6, logit_bias={"113": 100}, **GREEDY)
    assert r.choices[0].text == "q" * 6
    texts = {
        dep: client.completions.create(
            model=dep,
            prompt="abcabcabcabc",
            max_tokens=30,
            presence_penalty=0.8,
            frequency_penalty=0.5,
            extra_body={"repetition_penalty": 1.3},
            **GREEDY,
        )
        .choices[0]
        .text
        for dep in ("plain", "ngram", "drafted")
    }
    assert texts["ngram"] == texts["plain"] == texts["drafted"]


# ---- tool calls -------------------------------------------------------------------------------------------------
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_tool_choice_required_returns_calls_that_match_the_schemas(client):
    r = client.chat.completions.create(
        model="tools", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=300, **GREEDY
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    calls = choice.message.tool_calls
    assert calls and choice.message.content is None
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)
    assert r.usage.model_extra["speculation"]["grammar_drafted_tokens"] > 0


def test_a_named_function_is_called_once_and_streams_as_openai_does(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    full = client.chat.completions.create(
        model="tools", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=100, **GREEDY
    )
    [call] = full.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    chunks = list(
        client.chat.completions.create(
            model="tools",
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice=choice,
            max_tokens=100,
            stream=True,
            **GREEDY,
        )
    )
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert deltas[0].id and deltas[0].function.name == "get_time" and deltas[0].index == 0
    said = [c for c in chunks[1:] if c.choices]  # no empty chunk while a call's header is held back
    assert all(c.choices[0].delta.content or c.choices[0].delta.tool_calls or c.choices[0].finish_reason for c in said)
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_tool_choice_auto_runs_under_the_lazy_call_grammar(client, daemon):
    """Free text stays free (the grammar only starts at the call tag), but the request runs through the matcher."""

    def matcher_seconds() -> float:
        families = {f.name: f for f in text_string_to_metric_families(daemon.get("/metrics").text)}
        return {s.labels["deployment"]: s.value for s in families["depctl:grammar_seconds"].samples}.get("tools", 0)

    before = matcher_seconds()
    client.chat.completions.create(model="tools", messages=ASK, tools=[WEATHER], max_tokens=24, **GREEDY)
    assert matcher_seconds() > before


def test_a_call_cut_by_max_tokens_comes_back_as_text_not_as_a_call(client):
    r = client.chat.completions.create(
        model="tools", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=40, **GREEDY
    )
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content.startswith('<tool_call>\n{"name": "get_weather"')


def test_parallel_tool_calls_false_allows_one_call(client):
    r = client.chat.completions.create(
        model="tools",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=300,
        **GREEDY,
    )
    assert len(r.choices[0].message.tool_calls) == 1


def test_a_conversation_with_calls_and_results_renders(client):
    messages = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
    ]
    r = client.chat.completions.create(model="tools", messages=messages, tools=[WEATHER], max_tokens=10, **GREEDY)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    none = client.chat.completions.create(
        model="tools", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=10, **GREEDY
    )
    assert none.choices[0].message.tool_calls is None


def required_call_then_its_result(client, model: str, **kw):
    """A required get_weather call, valid against its schema, then the conversation with its result: (the call's
    response, the next one's)."""
    r = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=120, **GREEDY, **kw
    )
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    answered = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": "21 degrees"},
    ]
    after = client.chat.completions.create(model=model, messages=answered, tools=[WEATHER], max_tokens=8, **GREEDY)
    assert after.usage.prompt_tokens > r.usage.prompt_tokens  # the call and its result are rendered
    return r, after


def test_a_model_whose_template_has_no_tools_gets_them_in_its_prompt_and_calls_them(client, daemon):
    required, _ = required_call_then_its_result(client, "long")
    auto = client.chat.completions.create(model="long", messages=ASK, tools=[WEATHER], max_tokens=8, **GREEDY)
    assert auto.usage.prompt_tokens == required.usage.prompt_tokens > 300  # the tools' description is read
    counted = daemon.post("/tokenize", {"model": "long", "messages": ASK, "tools": [WEATHER]}).json()["count"]
    assert counted == auto.usage.prompt_tokens


def test_a_llama_template_gets_tools_its_way_and_its_bare_calls_back(client):
    """Llama 3.1's own template renders the tools and asks for {"name", "parameters"}: a required call is that
    object, held to its schema, and comes back as a call; its history renders."""
    required_call_then_its_result(client, "llama")


@pytest.mark.parametrize("model", ["mistral", "mistral-v11"])
def test_a_mistral_template_gets_its_tool_call_format_and_its_nine_letter_ids(client, daemon, model):
    """Mistral's own templates, Nemo's (v3: a list after [TOOL_CALLS]) and Small 3.2's (v11: [TOOL_CALLS]name[ARGS]
    {...}), on vocabularies where their tags are special tokens: a required call is written in the format, read
    back as a call, streamed as one; the history renders with the call ids the templates insist on."""
    one = {"parallel_tool_calls": False}  # a random model may go on listing calls; a real one ends its list
    required, _ = required_call_then_its_result(client, model, **one)
    stream = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=120,
        stream=True,
        **one,
        **GREEDY,
    )
    deltas = [d for chunk in stream for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices]
    assert deltas[0].function.name == "get_weather"
    assert sum(1 for d in deltas if d.function.arguments) > 1  # in pieces: read from the list as it comes
    streamed = "".join(d.function.arguments or "" for d in deltas)
    assert streamed == required.choices[0].message.tool_calls[0].function.arguments
    counted = daemon.post("/tokenize", {"model": model, "messages": ASK, "tools": [WEATHER]}).json()["count"]
    assert counted == required.usage.prompt_tokens


def test_bad_tools_are_400s(client):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}
    with pytest.raises(openai.BadRequestError, match=r"tools\[0\].function.parameters is not a valid JSON Schema"):
        client.chat.completions.create(model="tools", messages=ASK, tools=[bad], max_tokens=5)
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        client.chat.completions.create(
            model="tools",
            messages=ASK,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
            max_tokens=5,
        )


def test_a_repeated_prefix_is_read_from_the_cache_only_by_its_own_tenant_and_salt(client, daemon):
    """usage.prompt_tokens_details.cached_tokens in every response; the same answer with and without a hit; another
    API user or cache_salt finds nothing, as /metrics' counters (no timing) show."""
    system = "You answer in one word. " * 12  # ~290 byte tokens: two whole 128-token blocks
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "abcabc"}]
    # a salt of its own: earlier tests' prompts share the template's first tokens, which a prompt would find
    mine = {"extra_body": {"cache_salt": "repeated-prefix"}}
    first = client.chat.completions.create(model="plain", messages=messages, max_tokens=8, **GREEDY, **mine)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.chat.completions.create(model="plain", messages=messages, max_tokens=8, **GREEDY, **mine)
    # where prompts resume mid-block (the load-time check passed), all of it but the last token; else whole blocks
    mid_block = daemon.get("/depctl/v1/deployments/plain").json()["prefix_cache"]["mid_block"]
    assert again.usage.prompt_tokens_details.cached_tokens == (first.usage.prompt_tokens - 1 if mid_block else 256)
    assert again.choices[0].message.content == first.choices[0].message.content

    def hits() -> float:
        families = {f.name: f for f in text_string_to_metric_families(daemon.get("/metrics").text)}
        return next(s.value for s in families["depctl:prefix_cache_hits"].samples if s.labels["deployment"] == "plain")

    before = hits()
    for extra in ({"user": "someone-else", **mine}, {"extra_body": {"cache_salt": "my-own"}}):
        other = client.chat.completions.create(model="plain", messages=messages, max_tokens=8, **GREEDY, **extra)
        assert other.usage.prompt_tokens_details.cached_tokens == 0, extra
        assert other.choices[0].message.content == first.choices[0].message.content
    assert hits() == before


def test_a_conversations_next_turn_finds_the_answer_read_while_idle(client, daemon):
    """While no request runs, the daemon reads the last answer into the prefix cache: the next turn, which sends that
    answer back, reads only what follows it, and answers as without the cache."""
    messages = [{"role": "system", "content": "Say what comes next. " * 10}, {"role": "user", "content": "xyzxyz"}]
    read_before = daemon.get("/depctl/v1/deployments/plain").json()["prefix_cache"]["from_answers"]
    first = client.chat.completions.create(model="plain", messages=messages, max_tokens=150, **GREEDY)
    answer = first.choices[0].message.content
    # the byte-level tiny model's answer goes back as the same tokens when it is ASCII (its head prefers ASCII)
    assert first.usage.completion_tokens == 150 and answer.isascii()
    end = first.usage.prompt_tokens + 150
    mid_block = daemon.get("/depctl/v1/deployments/plain").json()["prefix_cache"]["mid_block"]
    whole = end if mid_block else end // 128 * 128  # what of the prompt and its answer the cache can hold
    # the blocks the answer completes (the prompt's own were kept as it was read), and its tail where kept
    added = end // 128 - first.usage.prompt_tokens // 128 + (1 if mid_block and end % 128 else 0)
    assert added >= 1
    wait_until(
        lambda: (
            daemon.get("/depctl/v1/deployments/plain").json()["prefix_cache"]["from_answers"] >= read_before + added
        ),
        "the answer's blocks read while idle",
    )
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "more"}]
    second = client.chat.completions.create(model="plain", messages=messages, max_tokens=8, **GREEDY)
    assert second.usage.prompt_tokens_details.cached_tokens == whole
    uncached = client.chat.completions.create(
        model="plain", messages=messages, max_tokens=8, **GREEDY, extra_body={"cache_salt": "elsewhere"}
    )
    assert uncached.usage.prompt_tokens_details.cached_tokens == 0
    assert second.choices[0].message.content == uncached.choices[0].message.content


def test_a_deployment_s_sampling_defaults_apply_where_a_request_sets_none(client, daemon):
    """`deployment update --temperature 0`: requests that set no temperature decode greedily, at once (no reload);
    one that sets its own keeps it."""
    from depctl.spec import SamplingDefaults

    store = SpecStore(daemon.home / "deployments")
    ask = {"model": "plain", "prompt": "once upon", "max_tokens": 12, "seed": 3}
    greedy = client.completions.create(**ask, temperature=0).choices[0].text
    sampled = client.completions.create(**ask, temperature=2.0).choices[0].text
    assert sampled != greedy  # (seeded: the same every run)
    store.update("plain", lambda s: s.model_copy(update={"sampling": SamplingDefaults(temperature=0.0)}))
    try:
        daemon.post("/depctl/v1/reconcile")
        assert daemon.wait_state("plain")["state"] == "READY"  # applied in place: nothing reloads
        assert client.completions.create(**ask).choices[0].text == greedy
        assert client.completions.create(**ask, temperature=2.0).choices[0].text == sampled
    finally:
        store.update("plain", lambda s: s.model_copy(update={"sampling": SamplingDefaults()}))
        daemon.post("/depctl/v1/reconcile")
    assert client.completions.create(**ask).choices[0].text != greedy  # back to OpenAI's default, 1.0
