"""OpenAI's Responses API through the official ``openai`` SDK, in process (tiny models), beside the same
conversation through chat completions: the same text under every speculation method."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from depctl_runtime.api.errors import APIError
from depctl_runtime.api.responses import ResponsesRequest, to_chat
from tests.runtime.api.sdks import METHODS, run

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
QUESTION = [{"role": "user", "content": "abcabcabc"}]


def _chat(**body):
    return to_chat(ResponsesRequest.model_validate({"model": "m", **body}))


def test_input_items_become_the_chat_messages_they_stand_for():
    chat = _chat(
        instructions="Be brief.",
        input=[
            {"role": "user", "content": "Weather in Oslo and Bergen?"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
            {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Bergen"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "rain"},
            {"type": "function_call_output", "call_id": "c2", "output": "sun"},
            {"role": "user", "content": [{"type": "input_text", "text": "Thanks."}]},
        ],
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=9,
        text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
        store=False,
        reasoning={"effort": "low"},
    )
    assert [(m.role, m.text()) for m in chat.messages] == [
        ("system", "Be brief."),
        ("user", "Weather in Oslo and Bergen?"),
        ("assistant", "Checking."),
        ("tool", "rain"),
        ("tool", "sun"),
        ("user", "Thanks."),
    ]
    assert [c.id for c in chat.messages[2].tool_calls] == ["c1", "c2"], "parallel calls: one assistant turn"
    assert chat.tools[0].function.parameters == WEATHER["parameters"] and chat.tool_choice == "required"
    assert chat.max_tokens == 9 and chat.response_format.json_schema.schema_ == {"type": "object"}


def test_what_codex_cli_sends_becomes_a_chat_request():
    """Codex CLI 0.x: developer messages, a namespace of function tools, and web_search with every request (which a
    400 turned into a client that could not start)."""
    close = {"type": "function", "name": "close_agent", "parameters": {"type": "object", "properties": {}}}
    chat = _chat(
        input=[
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox: none."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is 2+2?"}]},
        ],
        tools=[
            WEATHER,
            {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [close]},
            {"type": "web_search", "external_web_access": False},
        ],
        tool_choice="auto",
        store=False,
        include=["reasoning.encrypted_content"],
        prompt_cache_key="01a2",
        client_metadata={"session_id": "01a2"},
    )
    assert [t.function.name for t in chat.tools] == ["get_weather", "close_agent"]
    assert [(m.role, m.text()) for m in chat.messages] == [("developer", "Sandbox: none."), ("user", "What is 2+2?")]
    with pytest.raises(APIError) as refused:  # a built-in tool the model is made to call cannot be served
        _chat(input="hi", tools=[{"type": "web_search"}], tool_choice={"type": "web_search"})
    assert refused.value.param == "tool_choice"


def test_a_developer_message_reaches_the_template_as_a_system_message():
    """Chat templates know system, not developer: Qwen2.5's dropped a developer turn without a word."""
    from depctl_runtime.api.tools import history

    chat = _chat(input=[{"type": "message", "role": "developer", "content": "Be brief."}])
    assert history(chat.messages) == [{"role": "system", "content": "Be brief."}]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0.type",
        ),
        ({"input": [{"type": "computer_call", "call_id": "x"}]}, "input.0.type"),
    ],
    ids=["previous-response", "image", "computer-call"],
)
def test_what_depctl_cannot_do_is_refused_by_name(body, param):
    with pytest.raises(APIError) as refused:
        _chat(**body)
    assert refused.value.status == 400 and refused.value.param == param


@pytest.mark.parametrize("method", METHODS)
def test_a_response_whole_and_streamed_has_the_chat_completions_text(app, method):
    async def scenario(claude, oai, http):
        chat = await oai.chat.completions.create(model=method, messages=QUESTION, max_tokens=24, temperature=0)
        whole = await oai.responses.create(model=method, input=QUESTION, max_output_tokens=24, temperature=0)
        events = [
            e
            async for e in await oai.responses.create(
                model=method, input="abcabcabc", max_output_tokens=24, temperature=0, stream=True
            )
        ]
        return chat, whole, events

    chat, whole, events = run(app, scenario)
    text = chat.choices[0].message.content
    assert whole.output_text == text and whole.id.startswith("resp_")
    assert whole.status == ("completed" if chat.choices[0].finish_reason == "stop" else "incomplete")
    assert (
        whole.usage.input_tokens == chat.usage.prompt_tokens
        and whole.usage.output_tokens == chat.usage.completion_tokens
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in (
        "response.completed",
        "response.incomplete",
    )
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert events[-1].response.output_text == text
    assert events[-1].response.usage.output_tokens == chat.usage.completion_tokens  # counted before the job's usage
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_function_call_streams_its_arguments_and_its_output_makes_a_round_trip(app):
    async def scenario(claude, oai, http):
        ask = [{"role": "user", "content": "Weather in Oslo?"}]
        first = await oai.responses.create(
            model="tools", input=ask, tools=[WEATHER], tool_choice="required", max_output_tokens=200, temperature=0
        )
        call = next(item for item in first.output if item.type == "function_call")
        follow = ask + [
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "rain"},
        ]
        second = await oai.responses.create(
            model="tools", input=follow, tools=[WEATHER], tool_choice="none", max_output_tokens=8, temperature=0
        )
        stream = await oai.responses.create(
            model="tools",
            input=ask,
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=200,
            temperature=0,
            stream=True,
        )
        events = [e async for e in stream]
        return first, call, second, events

    first, call, second, events = run(app, scenario)
    assert first.status == "completed" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert second.output[0].type == "message"
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert len(pieces) > 1 and "".join(pieces) == done.arguments == call.arguments, "arguments stream in pieces"


def test_errors_are_openais_and_a_json_schema_holds(app):
    async def scenario(claude, oai, http):
        try:
            await oai.responses.create(model="plain", input="hi", previous_response_id="resp_x")
        except openai.BadRequestError as exc:
            refused = exc
        schema = {
            "type": "object",
            "properties": {"n": {"type": "integer"}},
            "required": ["n"],
            "additionalProperties": False,
        }
        shaped = await oai.responses.create(
            model="plain",
            input="a number",
            max_output_tokens=40,
            text={"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}},
        )
        return refused, schema, shaped

    refused, schema, shaped = run(app, scenario)
    assert refused.code == "unsupported_parameter" and "input" in refused.message
    jsonschema.validate(json.loads(shaped.output_text), schema)
