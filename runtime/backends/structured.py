"""A request's constraint (a JSON schema, a regex, a Lark grammar, a choice) compiled for depctl's engine.

JSON schemas are checked with ``jsonschema`` first, so a malformed one is answered with the place and the problem
rather than with a grammar compiler's message. Errors are 400s that name the request field.
"""

from __future__ import annotations

import json

import jsonschema

from depctl_runtime.backends.base import BackendError, Constraint
from depctl_runtime.speculation.grammar import Grammar, GrammarCompiler, GrammarError


def _refuse(constraint: Constraint, message: str) -> BackendError:
    return BackendError(400, f"{constraint.param}: {message}", code="invalid_grammar", param=constraint.param)


def schema_problem(schema) -> str | None:
    """What makes ``schema`` invalid JSON Schema (of the draft it names; 2020-12 if none), or None."""
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path) or "the top level"
        return f"not a valid JSON Schema at {where}: {exc.message}"
    return None


def check_schema(constraint: Constraint) -> None:
    if constraint.kind == "json" and constraint.value is not None:
        problem = schema_problem(constraint.value)
        if problem:
            raise _refuse(constraint, problem)


def vllm_structured_outputs(constraint: Constraint) -> dict:
    """The constraint as vLLM's ``structured_outputs`` request field."""
    check_schema(constraint)
    if constraint.kind == "json" and constraint.value is None:
        return {"json_object": True}
    return {constraint.kind: constraint.value}


def grammar_text(constraint: Constraint) -> str:
    """The constraint as an llguidance grammar (not yet checked against a tokenizer)."""
    kind, value = constraint.kind, constraint.value
    if kind == "json":
        check_schema(constraint)
        return GrammarCompiler.from_json_schema(value)
    if kind == "regex":
        return GrammarCompiler.from_regex(value)
    if kind == "grammar":
        return GrammarCompiler.from_lark(value)
    if kind == "choice":  # a Lark alternation of the strings, each quoted as a JSON string (Lark reads them alike)
        return GrammarCompiler.from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    raise _refuse(constraint, f"unknown constraint kind {kind!r}")


def compile_constraint(compiler: GrammarCompiler | None, constraint: Constraint) -> Grammar:
    if compiler is None:
        raise _refuse(constraint, "this deployment's tokenizer is not a fast tokenizer, which structured outputs need")
    text = grammar_text(constraint)
    try:
        return compiler.compile(text)
    except GrammarError as exc:
        problem = str(exc).strip().splitlines()
        raise _refuse(constraint, f"cannot be compiled: {' '.join(problem[:6])}") from None
