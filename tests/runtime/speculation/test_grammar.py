"""Structured outputs in the engine: a grammar constrains every speculation method without changing the output.

Tiny random models and the byte-level test tokenizer (token id == byte), so a grammar's tokens are its bytes.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from depctl_runtime.speculation import GenerationParams, SamplingParams, Scheduler, generate
from depctl_runtime.speculation.grammar import GrammarCompiler, GrammarError
from depctl_runtime.speculation.params import Penalties
from depctl_runtime.speculation.sampling import apply_penalties
from tests.driving import drive, engine_for
from tests.tiny import VOCAB, byte_tokenizer

EOS = 258

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 6},
                    "zip": {"type": "integer", "minimum": 0, "maximum": 99999},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "array of enums": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    "bounded numbers": {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}, "ok": {"type": "boolean"}},
        "required": ["age", "ok"],
        "additionalProperties": False,
    },
    "optional key": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "note": {"type": "string", "maxLength": 5},
        },
        "required": ["id"],
        "additionalProperties": False,
    },
    "anyOf": {
        "type": "object",
        "properties": {
            "value": {"anyOf": [{"type": "integer", "maximum": 99, "minimum": 0}, {"enum": ["none", "all"]}]}
        },
        "required": ["value"],
        "additionalProperties": False,
    },
}

# prompts that hold JSON, so that n-gram and suffix drafts have something to copy
PROMPTS = [
    list(b'{"name": "Ada", "address": {"city": "Paris", "zip": 75}} {"name": "'),
    list(b'tags: {"tags": ["red", "blue"]} again {"tags": ['),
    list(b"say hi"),
    list(b'{"age": 36, "ok": true}{"age": 3'),
    [77],
]


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(byte_tokenizer(), VOCAB, [EOS])


def grammar_for(compiler, schema):
    return compiler.compile(compiler.from_json_schema(schema))


def params(grammar=None, speculate=True, max_tokens=60, **kw):
    return GenerationParams(max_tokens=max_tokens, grammar=grammar, speculate=speculate, stop_token_ids=(EOS,), **kw)


def text(tokens):
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


def run(engine, prompt, p):
    tokens, finish = [], None
    for out in generate(engine, prompt, p):
        tokens += out.token_ids
        finish = out.finish_reason or finish
    return tokens, finish


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_constrained_output_matches_its_schema(target, compiler, name):
    schema = SCHEMAS[name]
    tokens, finish = run(
        engine_for(target, "plain", 1), PROMPTS[0], params(grammar_for(compiler, schema), max_tokens=200)
    )
    assert finish == "stop", text(tokens)
    jsonschema.validate(json.loads(text(tokens)), schema)


@pytest.mark.parametrize("method", ["plain", "ngram", "suffix", "draft"])
def test_greedy_constrained_speculation_equals_constrained_plain_decoding(target, draft, compiler, method):
    # "plain" still drafts: the tokens the grammar forces
    for name, schema in SCHEMAS.items():
        grammar = grammar_for(compiler, schema)
        for prompt in PROMPTS[:2]:
            want = run(engine_for(target, "plain", 1), prompt, params(grammar, speculate=False))
            got = run(engine_for(target, method, 1, draft), prompt, params(grammar))
            assert got == want, (name, method)


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("method", ["plain", "ngram", "suffix", "draft"])
def test_constrained_and_free_rows_share_a_batch_exactly(target, draft, compiler, method, batch):
    grammars = [grammar_for(compiler, s) for s in SCHEMAS.values()]
    arrivals = []
    for i in range(batch):
        grammar = grammars[i % len(grammars)] if i % 3 != 2 else None  # every third row is free
        arrivals.append((i % 3, PROMPTS[i % len(PROMPTS)], params(grammar, max_tokens=25 + 5 * i)))
    got, _ = drive(Scheduler(engine_for(target, method, batch, draft), batch, prefill_chunk=8), arrivals)
    for i, (_, prompt, p) in enumerate(arrivals):
        plain = GenerationParams(**{**p.__dict__, "speculate": False})
        assert got[i] == run(engine_for(target, "plain", 1), prompt, plain)[0], (method, i)


def test_forced_tokens_are_drafted_accepted_and_counted(target, compiler):
    engine = engine_for(target, "plain", 1)
    grammar = grammar_for(compiler, SCHEMAS["nested"])
    tokens, _ = run(engine, [77], params(grammar))
    stats = engine.stats
    assert stats.num_grammar_draft_tokens >= len('{"name": "')  # the key and its quotes, at least
    assert stats.num_grammar_accepted_tokens == stats.num_accepted_tokens > 0
    assert stats.num_steps < len(tokens)  # fewer passes than tokens: the forced ones came in batches
    assert stats.grammar_seconds > 0
    assert tokens == run(engine_for(target, "plain", 1), [77], params(grammar, speculate=False))[0]


def test_a_grammar_that_cannot_finish_ends_with_length(target, compiler):
    grammar = compiler.compile(compiler.from_regex("a[a-z]{0,50}z"))
    tokens, finish = run(engine_for(target, "ngram", 1), [5, 6], params(grammar, max_tokens=5))
    assert finish == "length" and len(tokens) == 5 and tokens[0] == ord("a")


def test_a_grammar_that_does_not_compile_says_where(compiler):
    with pytest.raises(GrammarError, match="regex"):
        compiler.compile(compiler.from_regex("[a-"))
    with pytest.raises(GrammarError, match="foo"):
        compiler.compile(compiler.from_json_schema({"type": "foo"}))


# ---- matcher state: one per row, back where it belongs after every step ----
def _same_state(row, reference):
    assert torch.equal(row.allowed(), reference.allowed())


@pytest.mark.parametrize(
    "drafts, argmax, accepted, token",
    [
        (b"aab", b"aabb", 3, b"b"),  # all accepted, then the bonus token
        (b"aab", b"bbbb", 0, b"b"),  # the first rejected
        (b"aab", b"axxx", 2, b"a"),  # the target's choice is forbidden: the best allowed token ("a") instead
        (b"", b"x", 0, b"a"),  # no drafts
    ],
)
def test_greedy_verification_leaves_the_matcher_where_it_started(compiler, drafts, argmax, accepted, token):
    from depctl_runtime.speculation.engine import SpeculativeEngine

    grammar = compiler.compile(compiler.from_regex("[ab]{1,8}"))
    row, reference = grammar.start(), grammar.start()
    logits = torch.zeros(len(drafts) + 1, VOCAB)
    logits[torch.arange(len(argmax)), torch.tensor(list(argmax))] = 5.0
    logits[:, ord("a")] += 1.0  # the best allowed token where the target's choice is forbidden
    got = SpeculativeEngine._greedy_in_grammar(row, list(drafts), list(argmax), lambda j: logits[j])
    assert got == (accepted, token[0])
    _same_state(row, reference)
    masks = row.masks(list(drafts))
    assert masks.shape == (len(drafts) + 1, VOCAB)
    assert masks[:, [ord("a"), ord("b")]].all() and masks[0].sum() == 2
    assert masks[1:, EOS].all() and (masks[1:].sum(-1) == 3).all()  # the end is allowed after one letter
    _same_state(row, reference)


def test_the_row_matcher_follows_the_output_step_by_step(target, draft, compiler):
    for method in ("ngram", "draft"):
        engine = engine_for(target, method, 1, draft)
        grammar = grammar_for(compiler, SCHEMAS["nested"])
        seq = engine.new_sequence(PROMPTS[0], params(grammar))
        scheduler = Scheduler(engine, 1)
        scheduler.add(seq)
        while scheduler.has_work():
            scheduler.step()
            if seq.finish_reason is None and seq.produced:
                reference = grammar.start()
                reference.advance(seq.tokens[seq.prompt_len :])
                _same_state(seq.grammar, reference)


# ---- sampling: the masked target's distribution ----
def test_masked_sampling_follows_the_masked_target(target, compiler):
    trials = 20_000
    engine = engine_for(target, "plain", 1)
    grammar = compiler.compile(compiler.from_regex("[abc]x"))
    a, b, c = ord("a"), ord("b"), ord("c")
    logits = torch.full((2, VOCAB), -30.0)
    logits[:, [a, b, c, ord("z")]] = torch.tensor([0.1, 0.5, 0.2, 0.2]).log()  # 'z' takes mass, but is forbidden
    want = torch.zeros(VOCAB)
    want[[a, b, c]] = torch.tensor([0.1, 0.5, 0.2]) / 0.8
    q = torch.zeros(VOCAB)
    q[[a, b, c]] = torch.tensor([0.6, 0.2, 0.2])  # a draft model's (masked) proposal
    seq = engine.new_sequence([1, 2], params(grammar, sampling=SamplingParams(temperature=1.0)))
    seq.generator.manual_seed(7)
    counts = {"draft model": torch.zeros(VOCAB), "one-hot": torch.zeros(VOCAB)}
    allowed = seq.grammar.masks([b])  # [2, vocab]: {a, b, c}, then {x} after any of them (as a step computes them)
    assert allowed[0].nonzero().flatten().tolist() == [a, b, c]
    for _ in range(trials):
        d = int(torch.multinomial(q, 1, generator=seq.generator))
        n, token = engine._accept(seq, [d], q[None], lambda rows: logits[rows], slice(0, 2), [], allowed)
        counts["draft model"][d if n else token] += 1
        n, token = engine._accept(seq, [b], None, lambda rows: logits[rows], slice(0, 2), [], allowed)
        counts["one-hot"][b if n else token] += 1
    for kind, got in counts.items():
        tv = 0.5 * float((got / trials - want).abs().sum())
        assert tv < 0.02, kind


# ---- penalties and logit bias: per position, so speculation stays exact ----
def test_penalties_count_the_drafts_before_each_position():
    logits = torch.zeros(3, 6)
    out = apply_penalties(Penalties(presence=1.0, frequency=0.5), logits, prompt=[5], output=[1, 1], drafts=[2, 1])
    assert out[0].tolist() == [0, -2.0, 0, 0, 0, 0]  # token 1 twice in the output
    assert out[1].tolist() == [0, -2.0, -1.5, 0, 0, 0]  # ... and draft 2 before position 1
    assert out[2].tolist() == [0, -2.5, -1.5, 0, 0, 0]  # ... and draft 1 again before position 2
    rep = apply_penalties(
        Penalties(repetition=2.0), torch.tensor([[2.0, -2.0, 2.0]]), prompt=[0], output=[1], drafts=[]
    )
    assert rep[0].tolist() == [1.0, -4.0, 2.0]
    bias = apply_penalties(Penalties(logit_bias=((3, 4.0),)), torch.zeros(2, 6), [], [], [0])
    assert bias[:, 3].tolist() == [4.0, 4.0] and bias.sum() == 8.0


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_penalised_speculation_equals_penalised_plain_decoding(target, draft, method, temperature):
    penalties = Penalties(logit_bias=((ord("e"), 2.0),), presence=0.5, frequency=0.3, repetition=1.2)
    sampling = SamplingParams(temperature=temperature, seed=11 if temperature else None)
    p = GenerationParams(max_tokens=40, ignore_eos=True, penalties=penalties, sampling=sampling)
    for prompt in PROMPTS[:3]:
        want = run(engine_for(target, "plain", 1), prompt, GenerationParams(**{**p.__dict__, "speculate": False}))
        assert run(engine_for(target, method, 1, draft), prompt, p) == want


def test_a_large_logit_bias_picks_the_token(target):
    p = GenerationParams(max_tokens=5, ignore_eos=True, penalties=Penalties(logit_bias=((ord("q"), 100.0),)))
    assert run(engine_for(target, "ngram", 1), [1, 2, 3], p)[0] == [ord("q")] * 5


# ---- logprobs: the target's own numbers, with or without speculation ----
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_logprobs_are_the_same_with_and_without_speculation(target, draft, compiler, method):
    grammar = grammar_for(compiler, SCHEMAS["nested"])
    for g in (None, grammar):
        p = params(g, logprobs=3, max_tokens=30)

        def collect(engine, p):
            return [lp for out in generate(engine, PROMPTS[0], p) for lp in out.logprobs]

        plain = collect(engine_for(target, "plain", 1), GenerationParams(**{**p.__dict__, "speculate": False}))
        spec = collect(engine_for(target, method, 1, draft), p)
        assert [x.token for x in spec] == [x.token for x in plain]
        for s, q in zip(spec, plain):
            assert s.logprob == pytest.approx(q.logprob, abs=1e-4)
            assert [t for t, _ in s.top] == [t for t, _ in q.top] and len(s.top) == 3
            assert s.logprob <= 0 and all(lp <= 0 for _, lp in s.top)


def test_a_special_token_the_matcher_refuses_is_never_drafted_or_chosen(target, compiler):
    # A literal that is also a special token's text ("<|im_start|>" is token 257): llguidance forces token 257 and
    # sets it in the mask, but its matcher refuses to take it. Such a token is neither drafted nor chosen, and a
    # grammar left with no token ends the row instead of failing the engine.
    grammar = compiler.compile(compiler.from_lark('start: "<|im_start|>" /[a-z]{2,4}/'))
    row = grammar.start()
    assert row.forced(8) == [257] and row.valid_prefix([257]) == 0
    assert not row.allowed()[257]
    want = run(engine_for(target, "plain", 1), [5, 6], params(grammar, speculate=False))
    got = run(engine_for(target, "ngram", 1), [5, 6], params(grammar))
    assert got == want == ([], "stop")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests need one")
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_constrained_speculation_on_cuda_equals_constrained_plain_decoding(target, compiler, temperature):
    # masks are built on the host and moved to the logits' device; the output is the same with or without drafts
    import copy

    from depctl_runtime.model.runner import ModelRunner
    from depctl_runtime.speculation import EngineConfig, NgramProposer, SpeculativeEngine

    model = copy.deepcopy(target).cuda()
    grammar = grammar_for(compiler, SCHEMAS["nested"])
    sampling = SamplingParams(temperature=temperature, seed=5 if temperature else None)

    def engine(proposer, k):
        return SpeculativeEngine(ModelRunner(model), proposer, EngineConfig(num_draft_tokens=k, max_context=512))

    want = run(engine(None, 0), PROMPTS[0], params(grammar, speculate=False, sampling=sampling))
    assert run(engine(NgramProposer(2), 4), PROMPTS[0], params(grammar, sampling=sampling)) == want


@pytest.mark.parametrize("method", ["plain", "ngram", "draft"])
def test_seeded_constrained_sampling_is_the_same_with_or_without_drafts(target, draft, compiler, method):
    # a seeded request's draws depend on (seed, position) alone, masked or not: drafts change nothing
    grammar = grammar_for(compiler, SCHEMAS["nested"])
    p = params(grammar, sampling=SamplingParams(temperature=0.8, seed=3), max_tokens=80)
    want = run(engine_for(target, "plain", 1), PROMPTS[0], GenerationParams(**{**p.__dict__, "speculate": False}))
    assert run(engine_for(target, method, 1, draft), PROMPTS[0], p) == want
    assert want[1] == "stop"
    jsonschema.validate(json.loads(text(want[0])), SCHEMAS["nested"])


# ---- numbers that end: a default cap on their digits ----
def _takes(compiler, schema, text: str) -> bool:
    row = compiler.compile(compiler.from_json_schema(schema)).start()
    return row.valid_prefix(list(text.encode())) == len(text)


@pytest.mark.parametrize("schema", [{"type": "number"}, {"type": ["number", "null"]}, {"type": "integer"}])
def test_a_number_has_at_most_16_integer_digits(compiler, schema):
    assert _takes(compiler, schema, "-" + "9" * 16)
    assert not _takes(compiler, schema, "1" * 17)
    assert not _takes(compiler, schema, "1e400")


def test_a_number_has_at_most_10_fraction_digits(compiler):
    assert _takes(compiler, {"type": "number"}, "3.1415926535")
    assert not _takes(compiler, {"type": "number"}, "3.14159265358")
    assert _takes(compiler, {"type": "number"}, "0.5")


def test_a_schema_s_own_bounds_and_multiple_replace_the_cap(compiler):
    assert _takes(compiler, {"type": "integer", "maximum": 10**18}, "1" * 18)
    assert _takes(compiler, {"type": "number", "minimum": 0, "multipleOf": 0.25}, "12345678901234.75")
    assert not _takes(compiler, {"type": "number", "minimum": 0}, "-1")


def test_numbers_are_capped_wherever_they_nest(compiler):
    nested = {
        "type": "object",
        "properties": {"xs": {"type": "array", "items": {"anyOf": [{"type": "number"}, {"type": "string"}]}}},
        "required": ["xs"],
        "$defs": {"unused": {"type": "number"}},
    }
    assert _takes(compiler, nested, '{"xs": [1.5, "a", ')
    assert not _takes(compiler, nested, '{"xs": [' + "1" * 17)
    assert not _takes(compiler, None, '{"a": ' + "1" * 17)  # json_object: any JSON object, its numbers capped too
    assert _takes(compiler, None, '{"a": [1.5, {"b": null}], "c": "d"}')


def test_a_model_that_repeats_a_digit_still_ends(target, compiler):
    """Under a bare number schema, a model that would write '1' forever is held to 16 digits and 10 after the
    point; then it must end."""
    schema = {
        "type": "object",
        "properties": {"n": {"type": "number"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    grammar = grammar_for(compiler, schema)
    p = params(grammar, max_tokens=80, penalties=Penalties(logit_bias=((ord("1"), 100.0),)))
    tokens, finish = run(engine_for(target, "ngram", 1), [1, 2, 3], p)
    assert finish == "stop" and text(tokens) == '{"n": ' + "1" * 16 + "." + "1" * 10 + "}"
