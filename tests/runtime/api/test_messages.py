"""Anthropic's Messages API through the official ``anthropic`` SDK, in process (an ASGI transport, tiny models),
beside the same conversation through chat completions: the same text under every speculation method."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest

from depctl_runtime.api.errors import APIError
from depctl_runtime.api.messages import MessagesRequest, to_chat
from tests.runtime.api.sdks import METHODS
from tests.runtime.api.sdks import run as _run

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


# ---- the request's translation, no model -------------------------------------------------------------------------


def _chat(**body):
    return to_chat(MessagesRequest.model_validate({"model": "m", "max_tokens": 8, **body}))


def test_a_conversation_with_tools_becomes_the_chat_messages_it_stands_for():
    chat = _chat(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools.", "cache_control": {}}],
        messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "a call", "signature": "x"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "rain"}]},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no such city", "is_error": True},
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["END"],
        metadata={"user_id": '{"device_id": "d"}'},
        thinking={"type": "adaptive"},
        context_management={"edits": []},
    )
    roles = [(m.role, m.text()) for m in chat.messages]
    assert roles == [
        ("system", "Be brief.\nUse tools."),
        ("user", "Weather in Oslo?"),
        ("assistant", "Checking."),
        ("tool", "rain"),
        ("tool", "Error: no such city"),
        ("user", "And tomorrow?"),
    ]
    call = chat.messages[2].tool_calls[0]
    assert call.id == "toolu_1" and json.loads(call.function.arguments) == {"city": "Oslo"}
    assert [m.tool_call_id for m in chat.messages[3:5]] == ["toolu_1", "toolu_2"]
    assert chat.tools[0].function.parameters == WEATHER["input_schema"]
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.stop == ["END"] and chat.user == '{"device_id": "d"}' and chat.max_tokens == 8


def test_claude_codes_billing_header_is_not_part_of_the_prompt():
    """Its hash changes with every request: at the front of the system prompt it left the prefix cache nothing to
    find (22 of 37,515 prompt tokens in two Claude Code runs)."""
    system = [
        {
            "type": "text",
            "text": "x-anthropic-billing-header: cc_version=2.1.197.84c; cc_entrypoint=sdk-cli; cch=1f2e;",
        },
        {"type": "text", "text": "You are a coding agent."},
    ]
    chat = _chat(system=system, messages=[{"role": "user", "content": "hi"}])
    assert chat.messages[0].text() == "You are a coding agent."
    assert _chat(system=system[:1], messages=[{"role": "user", "content": "hi"}]).messages[0].role == "user"


def test_a_system_message_inside_the_conversation_stays_where_it_was_sent():
    """Claude Code 2.1 sends one after the first user turn (the agent types it offers); a 400 stopped it there."""
    chat = _chat(
        system="Be brief.",
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is 2+2?", "cache_control": {}}]},
            {"role": "system", "content": "Available agent types: none."},
        ],
        output_config={"effort": "high"},
    )
    assert [(m.role, m.text()) for m in chat.messages] == [
        ("system", "Be brief."),
        ("user", "What is 2+2?"),
        ("system", "Available agent types: none."),
    ]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0.type"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "web_search_20250305"}]}, "tools.0.type"),
        ({"messages": [{"role": "user", "content": "hi"}], "system": [{"type": "image"}]}, "system.0.type"),
    ],
    ids=["image", "server-tool", "system-image"],
)
def test_what_depctl_cannot_do_is_refused_by_name(body, param):
    with pytest.raises(APIError) as refused:
        _chat(**body)
    assert refused.value.status == 400 and refused.value.param == param


# ---- over HTTP, through the SDKs (the app: tests/runtime/api/conftest.py) ---------------------------------------


QUESTION = [{"role": "user", "content": "abcabcabc"}]


@pytest.mark.parametrize("method", METHODS)
def test_a_message_whole_and_streamed_has_the_chat_completions_text(app, method):
    async def scenario(claude, oai, http):
        chat = await oai.chat.completions.create(model=method, messages=QUESTION, max_tokens=24, temperature=0)
        whole = await claude.messages.create(model=method, messages=QUESTION, max_tokens=24, temperature=0)
        async with claude.messages.stream(model=method, messages=QUESTION, max_tokens=24, temperature=0) as stream:
            streamed = "".join([text async for text in stream.text_stream])
            final = await stream.get_final_message()
        return chat, whole, streamed, final

    chat, whole, streamed, final = _run(app, scenario)
    text = chat.choices[0].message.content
    assert whole.content[0].type == "text" and whole.content[0].text == text == streamed == final.content[0].text
    assert whole.role == "assistant" and whole.id.startswith("msg_")
    assert (
        whole.stop_reason
        == final.stop_reason
        == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    )
    usage = whole.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == final.usage.output_tokens == chat.usage.completion_tokens


def test_a_streamed_message_counts_the_prompt_tokens_read_from_the_cache(app):
    """Claude Code reads a streamed answer's usage: its cache reads were 0 although the prefix cache had them."""
    long = [{"role": "user", "content": "The prefix cache keeps blocks of 128 tokens. " * 8}]

    async def scenario(claude, oai, http):
        await claude.messages.create(model="plain", messages=long, max_tokens=4, temperature=0)  # read once
        async with claude.messages.stream(model="plain", messages=long, max_tokens=4, temperature=0) as stream:
            return await stream.get_final_message()

    usage = _run(app, scenario).usage
    assert usage.cache_read_input_tokens >= 256 and usage.input_tokens < 128


def test_max_tokens_beyond_the_context_is_cut_to_it_and_stop_sequences_are_named(app):
    async def scenario(claude, oai, http):
        long = await claude.messages.create(model="plain", messages=QUESTION, max_tokens=32000, temperature=0)
        plain = await oai.chat.completions.create(model="plain", messages=QUESTION, max_tokens=40, temperature=0)
        stop = plain.choices[0].message.content[10:13]  # three characters the answer holds: it stops there
        stopped = await claude.messages.create(
            model="plain", messages=QUESTION, max_tokens=40, temperature=0, stop_sequences=["zzzz", stop]
        )
        return long, plain, stop, stopped

    long, plain, stop, stopped = _run(app, scenario)
    assert long.stop_reason in ("max_tokens", "end_turn") and long.usage.output_tokens > 0
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == plain.choices[0].message.content.split(stop)[0]


def test_count_tokens_counts_what_a_request_reads(app):
    async def scenario(claude, oai, http):
        counted = await claude.messages.count_tokens(
            model="tools", messages=QUESTION, system="Be brief.", tools=[WEATHER]
        )
        sent = await claude.messages.create(
            model="tools", messages=QUESTION, system="Be brief.", tools=[WEATHER], max_tokens=2, temperature=0
        )
        return counted, sent

    counted, sent = _run(app, scenario)
    assert counted.input_tokens == sent.usage.input_tokens + sent.usage.cache_read_input_tokens > 20


def test_a_tool_use_and_its_result_make_a_round_trip(app):
    async def scenario(claude, oai, http):
        first = await claude.messages.create(
            model="tools",
            messages=[{"role": "user", "content": "Weather in Oslo?"}],
            tools=[WEATHER],
            tool_choice={"type": "any"},
            max_tokens=200,
            temperature=0,
        )
        call = next(b for b in first.content if b.type == "tool_use")
        follow = [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "rain"}]},
        ]
        second = await claude.messages.create(
            model="tools", messages=follow, tools=[WEATHER], tool_choice={"type": "none"}, max_tokens=8, temperature=0
        )
        async with claude.messages.stream(
            model="tools",
            messages=[{"role": "user", "content": "Weather in Oslo?"}],
            tools=[WEATHER],
            tool_choice={"type": "tool", "name": "get_weather"},
            max_tokens=200,
            temperature=0,
        ) as stream:
            streamed = await stream.get_final_message()
        return first, call, second, streamed

    first, call, second, streamed = _run(app, scenario)
    assert first.stop_reason == "tool_use" and call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER["input_schema"])
    assert second.content[0].type == "text" and second.stop_reason in ("end_turn", "max_tokens")
    streamed_call = next(b for b in streamed.content if b.type == "tool_use")
    assert streamed.stop_reason == "tool_use" and streamed_call.input == call.input


def test_errors_come_in_anthropics_envelope_as_the_sdk_expects(app):
    async def scenario(claude, oai, http):
        errors = []
        for kwargs in (
            {"model": "ghost", "messages": QUESTION, "max_tokens": 4},
            {
                "model": "plain",
                "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
                "max_tokens": 4,
            },
            {"model": "plain", "messages": QUESTION, "max_tokens": 0},
        ):
            try:
                await claude.messages.create(**kwargs)
            except anthropic.APIStatusError as exc:
                errors.append(exc)
        raw = await http.post("/v1/messages", json={"model": "plain", "messages": QUESTION})
        return errors, raw

    errors, raw = _run(app, scenario)
    assert [type(e) for e in errors] == [anthropic.NotFoundError, anthropic.BadRequestError, anthropic.BadRequestError]
    assert "image" in errors[1].message
    body = raw.json()
    assert raw.status_code == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]


def test_x_api_key_is_a_key_as_a_bearer_token_is():
    from depctl_runtime.api.guard import key_digest

    assert key_digest({"x-api-key": "secret"}) == key_digest({"authorization": "Bearer secret"}) != ""
    assert key_digest({}) == ""
