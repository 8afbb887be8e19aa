"""A request's constraint (a JSON schema, a regex, a Lark grammar, a choice) compiled for depctl's engine.

A JSON schema the grammar compiler refuses is checked with ``jsonschema``, so a malformed one is answered with the
place and the problem rather than with the compiler's message (one it takes is not checked: the check is slow pure
Python). Errors are 400s that name the request field.

``check_limits`` runs before anything is compiled: a constraint's size in bytes, a choice list's length and a
schema's nesting are bounded (``GrammarLimits``), so a request under the body limit cannot hold a compiler for
minutes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from depctl_runtime.backends.base import BackendError, Constraint

if TYPE_CHECKING:  # the compiler (llguidance, torch) loads with the engine, not with the API's request models
    from depctl_runtime.speculation.grammar import Grammar, GrammarCompiler


def _refuse(constraint: Constraint, message: str) -> BackendError:
    return BackendError(400, f"{constraint.param}: {message}", code="invalid_grammar", param=constraint.param)


@dataclass(frozen=True)
class GrammarLimits:
    max_bytes: int = 256 * 1024  # a regex's or a Lark grammar's text, a schema or a choice list as JSON
    max_choices: int = 1000  # as OpenAI bounds an enum
    max_depth: int = 64  # a schema's nesting (objects and arrays)


def _depth(value, limit: int) -> int:
    """How deeply ``value`` nests, counted without recursion, up to ``limit + 1``."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def check_limits(constraint: Constraint, limits: GrammarLimits) -> None:
    """Refuse a constraint too large to compile promptly, before any compiler sees it."""
    value = constraint.value
    if constraint.kind == "choice" and len(value) > limits.max_choices:
        raise _too_large(constraint, f"has {len(value)} choices; at most {limits.max_choices} are taken")
    if constraint.kind == "json" and _depth(value, limits.max_depth) > limits.max_depth:
        raise _too_large(constraint, f"nests deeper than {limits.max_depth} levels")
    size = len(value.encode("utf-8", "surrogatepass")) if isinstance(value, str) else len(json.dumps(value))
    if size > limits.max_bytes:
        limit = f"at most {limits.max_bytes} are compiled (DEPCTL_MAX_GRAMMAR_BYTES)"
        raise _too_large(constraint, f"is {size} bytes; {limit}")


def _too_large(constraint: Constraint, message: str) -> BackendError:
    return BackendError(400, f"{constraint.param}: {message}", code="grammar_too_large", param=constraint.param)


def schema_problem(schema) -> str | None:
    """What makes ``schema`` invalid JSON Schema (of the draft it names; 2020-12 if none), or None."""
    if not isinstance(schema, (dict, bool)):
        return f"a JSON Schema is an object or a boolean, not {type(schema).__name__}"
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path) or "the top level"
        return f"not a valid JSON Schema at {where}: {exc.message}"
    except RecursionError:
        return "nests too deeply to be checked"
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
    from depctl_runtime.speculation.grammar import GrammarCompiler

    kind, value = constraint.kind, constraint.value
    if kind == "json":  # (checked against JSON Schema only where llguidance refuses it: see compile_constraint)
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
    from depctl_runtime.speculation.grammar import GrammarError

    try:
        return compiler.compile(grammar_text(constraint))
    except (GrammarError, ValueError, TypeError, RecursionError) as exc:  # llguidance's reading of it, or compiling
        # a schema is checked against JSON Schema only now: the check is pure Python holding the GIL (0.9 s for 2000
        # properties), and a schema llguidance takes needs none; one it refuses gets the check's clearer message
        check_schema(constraint)
        problem = str(exc).strip().splitlines() or [type(exc).__name__]
        raise _refuse(constraint, f"cannot be compiled: {' '.join(problem[:6])[:500]}") from None
