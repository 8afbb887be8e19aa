"""Grammar engines for structured outputs, side by side: llguidance and xgrammar on the same tokenizers and schemas.

For each tokenizer (a model directory or a packaged alias) and each engine, one table row:
- tokenizer set-up (once per deployment) and schema compile (once per request schema; a cold compile);
- the token mask at each position of a valid document, filled then consumed token by token (median and p95 us);
- rollback of 8 tokens after consuming them (what rejected drafts cost), median us;
- forced continuation: how many of the document's positions had exactly one allowed continuation that the engine
  reports (tokens for llguidance's ``compute_ff_tokens``, a string for xgrammar's ``find_jump_forward_string``), and
  what asking costs;
- llguidance only: the masks of 8 draft positions at once (``fill_next_token_bitmask_par_with_draft_tokens``).

Neither library is a depctl dependency yet; install both where you run this:

    pip install llguidance xgrammar
    .venv/bin/python benchmarks/grammar_engines.py --model smollm2-135m-instruct --model qwen2.5-coder-0.5b-instruct
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from depctl import models  # noqa: E402

SCHEMA = {  # an extraction schema: nested objects, arrays, enums, bounded numbers, optional keys, anyOf
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "rating": {"type": "number", "minimum": 0, "maximum": 10},
        "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "science fiction", "documentary"]}},
        "director": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "born": {"type": "integer"}},
            "required": ["name"],
            "additionalProperties": False,
        },
        "awards": {"anyOf": [{"type": "null"}, {"type": "array", "items": {"type": "string"}}]},
    },
    "required": ["title", "year", "genres", "director"],
    "additionalProperties": False,
}
DOCUMENT = {
    "title": "The Long Way Round",
    "year": 1987,
    "rating": 7.5,
    "genres": ["drama", "science fiction"],
    "director": {"name": "Ana Ribeiro", "born": 1951},
    "awards": ["Best Screenplay", "Audience Award"],
}


def micros(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered) * 1e6, ordered[int(0.95 * (len(ordered) - 1))] * 1e6


def timed(fn, *args):
    """(fn's result, the seconds it took)."""
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def walk(tokens: list[int], fill, forced, consume) -> dict:
    """The document token by token, as decoding would meet it: the mask, the forced continuation, then the token."""
    out = {"masks": [], "ff": [], "forced": 0}
    for token in tokens:
        out["masks"].append(timed(fill)[1])
        found, seconds = timed(forced)
        out["forced"] += bool(found)
        out["ff"].append(seconds)
        assert consume(token), f"token {token} refused"
    return out


def rollbacks(tokens: list[int], matcher_at, after=None) -> tuple[list[float], list[float]]:
    """Seconds to roll back 8 consumed tokens at every third position (``matcher_at(n)``: a matcher that consumed the
    first n tokens), and what ``after(matcher, start)`` then took."""
    rolled, then = [], []
    for start in range(0, len(tokens) - 9, 3):
        m = matcher_at(start + 8)
        rolled.append(timed(m.rollback, 8)[1])
        if after is not None:
            then.append(after(m, start))
    return rolled, then


def run_llguidance(tokenizer, tokens: list[int]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matcher = llguidance.LLMatcher(lltok, grammar)
    lt.fill_next_token_bitmask(matcher, lt.allocate_token_bitmask(1, lltok.vocab_size), 0)  # compiles lazily
    compile_s = time.perf_counter() - t0
    matcher = llguidance.LLMatcher(lltok, grammar)
    bitmask = lt.allocate_token_bitmask(1, lltok.vocab_size)
    r = walk(
        tokens,
        lambda: lt.fill_next_token_bitmask(matcher, bitmask, 0),
        matcher.compute_ff_tokens,
        matcher.consume_token,
    )
    assert matcher.is_accepting(), "the document did not complete the grammar"
    executor = llguidance.LLExecutor()

    def matcher_at(n: int):
        m = llguidance.LLMatcher(lltok, grammar)
        assert m.consume_tokens(tokens[:n]) is not False
        return m

    def draft_masks(m, start: int) -> float:  # the position before 8 drafts, and after each
        mask = lt.allocate_token_bitmask(9, lltok.vocab_size)
        return timed(
            lt.fill_next_token_bitmask_par_with_draft_tokens, executor, [(m, 0, tokens[start : start + 8])], mask
        )[1]

    r["rollback"], r["drafts"] = rollbacks(tokens, matcher_at, draft_masks)
    return {"setup": setup, "compile": compile_s, **r}


def run_xgrammar(tokenizer, tokens: list[int], vocab_size: int) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - t0
    matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=16)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    r = walk(
        tokens, lambda: matcher.fill_next_token_bitmask(bitmask), matcher.find_jump_forward_string, matcher.accept_token
    )

    def matcher_at(n: int):
        m = xgr.GrammarMatcher(compiled, max_rollback_tokens=16)
        assert all(m.accept_token(t) for t in tokens[:n])
        return m

    r["rollback"], r["drafts"] = rollbacks(tokens, matcher_at)[0], []
    return {"setup": setup, "compile": compile_s, **r}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", default=[], help="a model whose tokenizer to use (repeatable)")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    rows = []
    for ref in args.model or [models.DEFAULT_MODEL]:
        source = models.materialize(models.resolve(ref))
        tokenizer = AutoTokenizer.from_pretrained(source)
        tokens = tokenizer(json.dumps(DOCUMENT), add_special_tokens=False)["input_ids"]
        vocab = len(tokenizer)
        for name, run in (
            ("llguidance", lambda: run_llguidance(tokenizer, tokens)),
            ("xgrammar", lambda: run_xgrammar(tokenizer, tokens, vocab)),
        ):
            r = run()
            mask_med, mask_p95 = micros(r["masks"])
            rows.append(
                f"| {ref} ({vocab}) | {name} | {r['setup'] * 1000:.0f} | {r['compile'] * 1000:.1f} | "
                f"{mask_med:.0f} / {mask_p95:.0f} | {micros(r['rollback'])[0]:.1f} | "
                f"{r['forced']} of {len(tokens)}, {micros(r['ff'])[0]:.0f} | "
                + (f"{micros(r['drafts'])[0]:.0f} |" if r["drafts"] else "- |")
            )
            print(rows[-1], file=sys.stderr, flush=True)
    print(
        "\n| tokenizer (vocabulary) | engine | tokenizer set-up ms | schema compile ms | mask us (median / p95) "
        "| rollback of 8 us | forced positions, us to ask | 8 draft masks at once us |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
