"""Tool calls: the parser that splits output into content and OpenAI tool calls, the grammar for tool_choice
"required" and named functions, and the history as templates read it."""

from __future__ import annotations

import json

import pytest

from depctl_runtime.api.tools import HERMES, MISTRAL, MISTRAL_V11, ToolCallParser, call_schema, gather, split_calls

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>'
TWO = CALL + "\n" + CALL.replace("Paris", "Rome").replace("get_weather", "get_time")


WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def parse(text: str, pieces: int, names=frozenset({"get_weather", "get_time"}), fmt=HERMES):
    """Feed ``text`` in ``pieces``-character runs; (content, tool_calls)."""
    parser, content, deltas = ToolCallParser(names, fmt), "", []
    for i in range(0, len(text), pieces):
        c, d = parser.feed(text[i : i + pieces])
        content += c
        deltas += d
    c, d = parser.finish()
    return content + c, gather(deltas + d), deltas + d


@pytest.mark.parametrize("pieces", [1, 3, 7, 1000])
def test_calls_come_out_whole_however_the_text_arrives(pieces):
    content, calls, deltas = parse("Let me check.\n" + TWO, pieces)
    assert content == "Let me check.\n"
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"city": "Paris", "days": [1, 2]},
        {"city": "Rome", "days": [1, 2]},
    ]
    assert calls[0]["id"].startswith("call_") and calls[0]["id"] != calls[1]["id"]
    # OpenAI's stream shape: the first delta of a call has its id and name, the rest only argument fragments
    firsts = [d for d in deltas if d.id is not None]
    assert [d.index for d in firsts] == [0, 1] and all(d.arguments == "" for d in firsts)
    if pieces == 1:
        assert sum(1 for d in deltas if d.index == 0 and d.id is None) > 1  # arguments stream in fragments


def test_text_without_calls_is_content_even_when_it_looks_like_a_tag():
    assert parse("a <tool and <tool_ca", 2)[:2] == ("a <tool and <tool_ca", [])
    assert parse("", 1)[:2] == ("", [])


def test_a_call_cut_by_max_tokens_is_never_returned_as_a_call():
    """A client parses every call's arguments: a cut call's text is returned as content, the calls before it stay."""
    names = frozenset({"get_weather", "get_time"})
    content, calls = split_calls(CALL + "\n" + CALL[:64], names)
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris"]
    assert content == CALL[:64]
    assert split_calls(CALL[:64], names) == (CALL[:64], [])
    # streamed, its id, name and argument fragments have gone out as they were written (finish_reason says length)
    _, streamed, _ = parse(CALL[:64], 4)
    assert streamed[0]["function"]["arguments"].startswith('{"city": "Par')


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        '```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Paris"}\n}\n```',
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    ],
)
def test_a_call_written_without_tags_is_still_a_call(text):
    # small models (Qwen2.5-Coder-0.5B) often answer with the call's JSON alone
    content, calls, _ = parse(text, 5)
    assert content == "" and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}


@pytest.mark.parametrize(
    "text", ['{"name": "unknown", "arguments": {}}', '{"city": "Paris"}', "```python\nprint(1)\n```", "{not json"]
)
def test_json_that_is_not_a_call_stays_content(text):
    assert parse(text, 3)[:2] == (text, [])


def test_call_schema_pins_the_name_and_takes_the_parameters_with_their_numbers_capped():
    fn = {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}
    schema = call_schema([fn])
    assert schema["properties"]["name"] == {"const": "f"}
    assert schema["properties"]["arguments"]["properties"]["x"] == {
        "type": "integer",
        "minimum": -(10**16 - 1),
        "maximum": 10**16 - 1,
    }
    assert fn["parameters"]["properties"]["x"] == {"type": "integer"}  # the request's own schema is left alone
    assert "anyOf" in call_schema([fn, {**fn, "name": "g"}])


def tool_grammar(functions, parallel=True, lazy=False, fmt=None, tokenizer=None):
    """The tool grammar compiled for the byte-level test tokenizer, and a check that it takes a whole text."""
    from depctl_runtime.api.tools import HERMES, tool_constraint
    from depctl_runtime.backends.structured import compile_constraint
    from depctl_runtime.speculation.grammar import GrammarCompiler
    from tests.tiny import byte_tokenizer

    tokenizer = tokenizer or byte_tokenizer()
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    constraint = tool_constraint(tokenizer, functions, parallel, "tools", lazy=lazy, fmt=fmt or HERMES)
    grammar = compile_constraint(compiler, constraint)

    def valid(text: str) -> bool:
        ids = tokenizer.encode(text, add_special_tokens=False)
        return grammar.start().valid_prefix(ids) == len(ids)

    return grammar, valid


def test_a_template_without_tools_gets_them_in_the_system_prompt_and_calls_as_text():
    """As llama.cpp's generic format and vLLM's "required" path give a model whose template never renders tools: the
    tools described in a system message, earlier calls written as the blocks the model is asked to write, results as
    a user turn (such templates know no tool role)."""
    from depctl_runtime.api.tools import prompted

    weather = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    turns = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "21 C"},
        {"role": "tool", "tool_call_id": "b", "content": "25 C"},
    ]
    system, user, assistant, results = prompted(turns, [weather])
    assert system["role"] == "system" and system["content"].endswith("\n\nBe brief.")
    assert json.dumps(weather) in system["content"] and "<tool_call>" in system["content"]
    assert user == turns[1]
    assert assistant == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
    }
    assert results == {
        "role": "user",
        "content": "<tool_response>\n21 C\n</tool_response>\n<tool_response>\n25 C\n</tool_response>",
    }
    [system, _] = prompted(turns[1:2], [weather])  # no system message: one is added
    assert system["role"] == "system" and system["content"].startswith("You can call")


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "get_weather", "arguments": {"city": "Paris", "note": "a } and a \\" inside"}}',
        '```json\n{"name": "get_weather", "arguments": {"city": "Paris", "note": "a } and a \\" inside"}}\n```',
    ],
)
def test_a_call_written_without_tags_streams_its_arguments_as_they_come(text):
    """Held to the end, a small model's bare call reached the client as one chunk after the whole answer."""
    content, calls, deltas = parse(text, 3)
    assert content == "" and [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "note": 'a } and a " inside'}
    assert sum(1 for d in deltas if d.id is None and d.arguments) > 5  # fragments, not one piece at the end


def test_text_after_a_bare_call_is_content_and_a_bare_call_cut_short_is_no_call():
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    content, calls, _ = parse(call + "\nDone.", 2)
    assert content.strip() == "Done." and json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert split_calls(call[:40], frozenset({"get_weather"})) == (call[:40], [])


def test_auto_constrains_only_what_follows_the_call_tag():
    """tool_choice auto: free text, and once the model writes <tool_call> a call to an offered function whose
    arguments match their schema."""
    weather = {**WEATHER, "parameters": {**WEATHER["parameters"], "required": ["city"]}}
    grammar, valid = tool_grammar([weather], lazy=True)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert valid("Sure: {not a call} <tool and text")
    assert valid("Let me check.\n" + call) and valid(call + "\n" + call)
    assert not valid('<tool_call>\n{"name": "get_time"')
    assert not valid('<tool_call>\n{"name": "get_weather", "arguments": {"town": ')
    row = grammar.start()
    row.advance(list(call.encode()))
    assert row.allows(grammar.end_ids[0])  # the answer may end after a whole call


def test_under_auto_a_reply_that_opens_like_json_is_a_valid_call_and_nothing_else():
    """Small models skip the tags and write the call's JSON, bare or fenced, often naming a tool they were not
    offered (Qwen2.5-Coder-1.5B under Codex CLI: ```json {"name": "update_file", ...}): under auto such a reply is
    held to a call of an offered function, and ends there."""
    _, valid = tool_grammar([WEATHER], lazy=True)
    bare = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert valid(bare) and valid("```json\n" + bare + "\n```") and valid("\n" + bare)
    assert not valid('{"name": "update_file"') and not valid('```json\n{"name": "update_file"')
    assert not valid(bare + " and then some text") and not valid('{"city": "Paris"}')
    assert valid("```python\nprint(1)\n```") and valid("Sure. {not a call}") and valid("")


@pytest.mark.parametrize("parallel", [True, False])
def test_a_required_call_may_end_after_its_newline(parallel):
    """Models end their last call with a newline as often as with their end token; a grammar that then forced
    another call made them write calls until max_tokens."""
    grammar, _ = tool_grammar([WEATHER], parallel)
    row = grammar.start()
    row.advance(list(b'<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'))
    assert row.complete or row.allows(grammar.end_ids[0])  # complete: the engine ends the answer there
    assert row.allows(ord("<")) == parallel


@pytest.mark.parametrize("lazy", [True, False])
def test_a_tool_schema_with_keywords_the_grammar_cannot_enforce_still_compiles(lazy):
    """Claude Code's tools use propertyNames, which llguidance does not implement: a 400 stopped every request."""
    tags = {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}, "additionalProperties": {"type": "string"}}
    agent = {"name": "agent", "parameters": {"type": "object", "properties": {"tags": tags}, "required": ["tags"]}}
    _, valid = tool_grammar([agent], lazy=lazy)
    assert valid('<tool_call>\n{"name": "agent", "arguments": {"tags": {"x": "y"}}}\n</tool_call>')


def test_a_tool_s_numbers_end():
    """A number argument written digit after digit is held to 16 digits (and 10 after the point)."""
    fn = {"name": "pay", "parameters": {"type": "object", "properties": {"amount": {"type": "number"}}}}
    _, valid = tool_grammar([fn])
    head = '<tool_call>\n{"name": "pay", "arguments": {"amount": '
    assert valid(head + "9" * 16 + ".25}}") and not valid(head + "9" * 17)


@pytest.mark.parametrize("pieces", [2, 1000])
def test_a_call_whose_arguments_are_named_parameters_is_a_call(pieces):
    """Llama 3.1's template asks for {"name": ..., "parameters": ...}, and small models write that shape too."""
    bare = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    for text in (bare, "<tool_call>\n" + bare + "\n</tool_call>", "[" + bare + "]"):
        content, calls, _ = parse(text, pieces)
        assert content == "" and json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}, text


def test_each_template_family_gets_its_own_call_format():
    from depctl_runtime.api.errors import APIError
    from depctl_runtime.api.tools import LLAMA3, tool_format
    from tests.tiny import (
        CHAT_TEMPLATE,
        LLAMA31_TEMPLATE,
        MISTRAL_TEMPLATE,
        MISTRAL_V11_TEMPLATE,
        TOOLS_TEMPLATE,
        byte_tokenizer,
    )

    assert tool_format(byte_tokenizer(chat_template=TOOLS_TEMPLATE), "d") is HERMES
    assert tool_format(byte_tokenizer(chat_template=CHAT_TEMPLATE), "d") is HERMES  # described in a system message
    assert tool_format(byte_tokenizer(chat_template=LLAMA31_TEMPLATE), "d") is LLAMA3
    assert tool_format(byte_tokenizer(chat_template=MISTRAL_TEMPLATE), "d") is MISTRAL
    assert tool_format(byte_tokenizer(chat_template=MISTRAL_V11_TEMPLATE), "d") is MISTRAL_V11
    devstral = "{{ tools | tojson }}{% for c in calls %}[TOOL_CALLS]{{ c.name }}[ARGS]{{ c.arguments }}{% endfor %}"
    assert tool_format(byte_tokenizer(chat_template=devstral), "d") is MISTRAL_V11
    other = "{{ tools | tojson }}{% for c in calls %}<function={{ c.name }}>{% endfor %}"
    with pytest.raises(APIError, match="format depctl does not parse"):
        tool_format(byte_tokenizer(chat_template=other), "d")


def test_a_llama_call_is_its_bare_json_object():
    from depctl_runtime.api.tools import LLAMA3

    _, valid = tool_grammar([WEATHER], fmt=LLAMA3)
    assert valid('{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert not valid("<tool_call>") and not valid('{"name": "get_weather", "arguments"')
    _, auto = tool_grammar([WEATHER], lazy=True, fmt=LLAMA3)
    assert auto("It is sunny.") and auto('{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert not auto('{"name": "get_time"') and not auto('{"name": "get_weather", "arguments"')


MISTRAL_CALLS = (
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}, '
    '{"name": "get_time", "arguments": {"city": "Rome", "note": "{not a brace}"}}]'
)
# Mistral Small 3.1/3.2, Devstral, Ministral 3: each call after its own [TOOL_CALLS], its name, then [ARGS] and the
# arguments' object (Small 3.2 writes [CALL_ID] and an id between them in its history)
V11_CALLS = (
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": [1, 2]}'
    '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"city": "Rome", "note": "{not a brace}"}'
)


@pytest.mark.parametrize("fmt, text", [(MISTRAL, MISTRAL_CALLS), (MISTRAL_V11, V11_CALLS)], ids=["v3", "v11"])
@pytest.mark.parametrize("pieces", [1, 3, 1000])
def test_mistral_calls_stream_out_one_by_one(fmt, text, pieces):
    """v3's list and v11's calls, each after its own marker, alike; text around them is content."""
    content, calls, deltas = parse("Checking. " + text + " Done.", pieces, fmt=fmt)
    assert content == "Checking.  Done."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": [1, 2]}),
        ("get_time", {"city": "Rome", "note": "{not a brace}"}),
    ]
    assert all(c["id"].startswith("call_") for c in calls)
    if pieces == 1:
        assert sum(1 for d in deltas if d.index == 0 and d.id is None and d.arguments) > 5  # fragments


def test_a_cut_mistral_call_is_content():
    names = frozenset({"get_weather", "get_time"})
    content, calls = split_calls(MISTRAL_CALLS[:-20], names, MISTRAL)
    assert len(calls) == 1 and content.startswith('{"name": "get_time"')  # the cut call is content, not a call
    assert parse("[TOOL_CALLS] is how I call tools.", 3, fmt=MISTRAL)[:2] == (" is how I call tools.", [])
    cut = V11_CALLS[:-12]
    content, calls = split_calls(cut, names, MISTRAL_V11)
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert content == cut[cut.rindex("[TOOL_CALLS]") :]  # the cut call's text, its marker shown
    assert split_calls("[TOOL_CALLS]get_weath", names, MISTRAL_V11) == ("[TOOL_CALLS]get_weath", [])


@pytest.mark.parametrize("parallel", [True, False])
def test_mistral_calls_are_held_to_their_list(parallel):
    from depctl_runtime.api.tools import MISTRAL
    from tests.tiny import byte_tokenizer

    tokenizer = byte_tokenizer(specials=("[TOOL_CALLS]",))  # the model's own token, as in Mistral's vocabularies
    mark = tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    time = {**WEATHER, "name": "get_time"}
    for lazy in (False, True):
        grammar, _ = tool_grammar([WEATHER, time], parallel, lazy, MISTRAL, tokenizer)

        def valid(text: str, grammar=grammar) -> bool:
            ids = [mark] + list(text.encode())
            return grammar.start().valid_prefix(ids) == len(ids)

        one = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
        assert valid(one) and valid(MISTRAL_CALLS.removeprefix("[TOOL_CALLS]")) == parallel
        assert not valid('[{"name": "get_date"')
        row = grammar.start()
        row.advance([mark] + list(one.encode()))
        assert row.complete or row.allows(grammar.end_ids[0])
    assert grammar.start().valid_prefix(list(b"Free text first ")) == 16  # auto: text until the marker


@pytest.mark.parametrize("version", ["v3", "v11"])
def test_mistral_history_gets_the_nine_letter_ids_its_templates_insist_on(version):
    """Through the models' own templates: Mistral Nemo's (v3) and Mistral Small 3.2's (v11)."""
    from depctl_runtime.api.protocol import ChatMessage
    from depctl_runtime.api.tools import history
    from tests.tiny import MISTRAL_TEMPLATE, MISTRAL_V11_TEMPLATE, byte_tokenizer

    fmt, template = (MISTRAL, MISTRAL_TEMPLATE) if version == "v3" else (MISTRAL_V11, MISTRAL_V11_TEMPLATE)
    call = {"id": "call_0123456789abcdef", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    messages = [
        ChatMessage(role="user", content="go"),
        ChatMessage(role="assistant", content=None, tool_calls=[call]),
        ChatMessage(role="tool", tool_call_id=call["id"], content="done"),
    ]
    turns = history(messages, fmt)
    nine = turns[1]["tool_calls"][0]["id"]
    assert len(nine) == 9 and nine.isalnum() and turns[2]["tool_call_id"] == nine
    assert history(messages)[1]["tool_calls"][0]["id"] == call["id"]  # other families keep the client's ids
    text = byte_tokenizer(chat_template=template).apply_chat_template(turns, tokenize=False)
    if version == "v3":
        assert f'[TOOL_CALLS][{{"name": "f", "arguments": {{"x": 1}}, "id": "{nine}"}}]' in text
        assert f'[TOOL_RESULTS]{{"content": done, "call_id": "{nine}"}}[/TOOL_RESULTS]' in text
    else:
        assert f'[TOOL_CALLS]f[CALL_ID]{nine}[ARGS]{{"x": 1}}' in text
        assert f"[TOOL_RESULTS]{nine}[TOOL_CONTENT]done[/TOOL_RESULTS]" in text


@pytest.mark.parametrize("parallel", [True, False])
def test_mistral_v11_calls_are_held_to_their_functions(parallel):
    from tests.tiny import byte_tokenizer

    tokenizer = byte_tokenizer(specials=("[TOOL_CALLS]", "[ARGS]"))  # the model's own tokens, as in tekken
    time = {**WEATHER, "name": "get_time"}
    for lazy in (False, True):
        grammar, valid = tool_grammar([WEATHER, time], parallel, lazy, MISTRAL_V11, tokenizer)
        one = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
        two = one + '[TOOL_CALLS]get_time[ARGS]{"city": "Rome"}'
        assert valid(one) and valid(two) == parallel
        assert not valid("[TOOL_CALLS]get_date") and not valid('[TOOL_CALLS]get_time[ARGS]{"city": 3')
        assert not valid("[TOOL_CALLS]get_weather[ARGS][")
        row = grammar.start()
        row.advance(tokenizer.encode(one, add_special_tokens=False))
        assert row.complete or row.allows(grammar.end_ids[0])  # it may end after any whole call
        assert valid('Free text first [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}') == lazy
