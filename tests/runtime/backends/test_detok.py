"""Incremental detokenization and stop strings."""

from __future__ import annotations

from depctl_runtime.backends.detok import IncrementalDetokenizer, StopMatcher
from tests.tiny import byte_tokenizer


def test_multibyte_characters_split_across_runs():
    tok = byte_tokenizer()
    text = "naïve café ☕ ok"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add(ids[i : i + 1]) for i in range(len(ids))] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)  # a half character is held back, never emitted


def test_special_tokens_are_skipped():
    tok = byte_tokenizer()
    ids = tok("hi", add_special_tokens=False)["input_ids"] + [258]
    detok = IncrementalDetokenizer(tok)
    assert detok.add(ids) + detok.flush() == "hi"


def test_a_shown_special_token_keeps_its_text_and_the_rest_still_decode():
    """Mistral's [TOOL_CALLS] is a special token: the tool-call reader needs it in the text, the end token not."""
    tok = byte_tokenizer(specials=("[TOOL_CALLS]",))
    mark = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    text = 'é[{"a": 1}]'
    ids = [
        258,
        *tok("ok ", add_special_tokens=False)["input_ids"],
        mark,
        *tok(text, add_special_tokens=False)["input_ids"],
    ]
    for shown, want in (((mark,), "ok [TOOL_CALLS]" + text), ((), "ok " + text)):
        detok = IncrementalDetokenizer(tok, shown)
        pieces = [detok.add(ids[i : i + 2]) for i in range(0, len(ids), 2)] + [detok.flush()]
        assert "".join(pieces) == want


def test_stop_string_split_across_feeds():
    stop = StopMatcher(["END"])
    out = stop.feed("abc E") + stop.feed("N") + stop.feed("D tail")
    assert out == "abc " and stop.stopped
    assert stop.feed("more") == "" and stop.flush() == ""


def test_earliest_stop_wins_and_flush_returns_the_rest():
    stop = StopMatcher(["xyz", "b"])
    assert stop.feed("aab xyz") == "aa"
    plain = StopMatcher(["zzz"])
    assert plain.feed("hello") + plain.flush() == "hello"


def test_tokenizers_decode_stream_and_the_prefix_path_agree():
    # fast tokenizers decode through tokenizers' DecodeStream; slow ones through prefix decoding: the same text
    tok = byte_tokenizer()
    text = "naïve café ☕ ok, 日本語 🤖 and   spaces\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    outputs = []
    for stream in (True, False):
        detok = IncrementalDetokenizer(tok)
        if not stream:
            detok._stream = None
        pieces = [detok.add(ids[i : i + 3]) for i in range(0, len(ids), 3)] + [detok.flush()]
        outputs.append("".join(pieces))
    assert outputs[0] == outputs[1] == text
