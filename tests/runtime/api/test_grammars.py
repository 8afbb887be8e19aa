"""The grammar pool: limits checked before compiling, a time limit, a bounded queue, and a panic answered as a 400."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from depctl_runtime.api.errors import APIError
from depctl_runtime.api.grammars import GrammarPool
from depctl_runtime.backends import GenerateRequest
from depctl_runtime.backends.base import BackendError, Constraint
from depctl_runtime.backends.structured import GrammarLimits, check_limits, compile_constraint, schema_problem
from depctl_runtime.speculation import GenerationParams
from depctl_runtime.speculation.grammar import GrammarCompiler
from tests.tiny import VOCAB, byte_tokenizer


class SlowBackend:
    """Compiles by waiting on ``release``: a stand-in for a grammar that takes the compiler a long time."""

    def __init__(self):
        self.release, self.started = threading.Event(), 0

    def prepare(self, request):
        if request.constraint is not None:
            self.started += 1
            self.release.wait(30)
        return request


def _request(kind="regex", value="a+") -> GenerateRequest:
    return GenerateRequest([1, 2], GenerationParams(), (), Constraint(kind, value, f"structured_outputs.{kind}"))


def test_a_compile_past_its_time_is_a_400_and_keeps_its_slot_until_it_ends():
    backend = SlowBackend()

    async def scenario():
        pool = GrammarPool(timeout=0.3, workers=1, queue=1)
        with pytest.raises(APIError) as slow:
            await pool.prepare(backend, _request())
        assert (slow.value.status, slow.value.code) == (400, "grammar_too_complex")
        assert pool.under_way == 1  # the compiler cannot be interrupted: its slot stays taken
        queued = asyncio.ensure_future(pool.prepare(backend, _request()))
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as busy:  # one running, one queued: full
            await pool.prepare(backend, _request())
        assert (busy.value.status, busy.value.code) == (503, "grammar_compiler_busy")
        plain = GenerateRequest([1], GenerationParams())
        assert await asyncio.wait_for(pool.prepare(backend, plain), 1) is plain  # no grammar: never queued
        backend.release.set()
        assert (await queued).constraint is not None
        deadline = time.monotonic() + 10
        while pool.under_way:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "kind, value, needle",
    [
        ("regex", "x" * 1_000_000, "bytes"),
        ("grammar", "start: " + " | ".join(f'"{i}"' for i in range(60_000)), "bytes"),
        ("choice", [str(i) for i in range(100_000)], "100000 choices"),
        ("json", {"type": "object", "properties": {"a": {"type": "string", "enum": ["x" * 300_000]}}}, "bytes"),
    ],
)
def test_limits_are_checked_before_anything_compiles(kind, value, needle):
    with pytest.raises(BackendError) as err:
        check_limits(Constraint(kind, value, f"structured_outputs.{kind}"), GrammarLimits())
    assert err.value.code == "grammar_too_large" and needle in err.value.message


def test_a_schema_nested_deeper_than_the_limit_is_refused_without_recursion():
    schema: dict = {"type": "string"}
    for _ in range(5000):  # deeper than Python's recursion limit
        schema = {"type": "array", "items": schema}
    with pytest.raises(BackendError) as err:
        check_limits(Constraint("json", schema, "response_format.json_schema.schema"), GrammarLimits())
    assert err.value.code == "grammar_too_large" and "nests deeper" in err.value.message
    assert schema_problem(schema) == "nests too deeply to be checked"


@pytest.mark.parametrize(
    "kind, value, needle",
    [
        ("json", False, "cannot be compiled"),  # once a 500: "Expecting object schema"
        ("regex", "(a{1000}){1000}", "too many expressions"),  # compiles, then the lexer gives up at its first token
        ("grammar", 'start: a\na: a "x"', "empty"),  # a language with no string in it
    ],
)
def test_grammars_that_cannot_run_are_refused_when_compiled(kind, value, needle):
    compiler = GrammarCompiler(byte_tokenizer(), VOCAB, [258])
    with pytest.raises(BackendError) as err:
        compile_constraint(compiler, Constraint(kind, value, f"structured_outputs.{kind}"))
    assert err.value.status == 400 and err.value.code == "invalid_grammar" and needle in err.value.message
    assert "<state>" not in err.value.message and "\n" not in err.value.message


def test_a_grammar_the_client_did_not_ask_for_is_dropped_where_it_does_not_compile():
    """tool_choice auto's call grammar is depctl's own addition: a tool schema it cannot compile runs the request
    unconstrained; a grammar the client sent is a 400 naming its field."""

    class Refusing:
        def prepare(self, request):
            if request.constraint is not None:
                raise BackendError(400, f"{request.constraint.param}: cannot be compiled", param="x")
            return request

    pool = GrammarPool()
    optional = GenerateRequest([1, 2], GenerationParams(), (), Constraint("grammar", "start: x", "tools", True))
    assert asyncio.run(pool.prepare(Refusing(), optional)).constraint is None
    with pytest.raises(APIError, match="structured_outputs.grammar: cannot be compiled"):
        asyncio.run(pool.prepare(Refusing(), _request("grammar", "start: x")))
