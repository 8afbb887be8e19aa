"""Token ids -> text, incrementally, and stop strings.

Decoding one token at a time is wrong for byte-level and SentencePiece vocabularies: a character can span
tokens (a partial UTF-8 sequence decodes to U+FFFD) and a fragment can lose its leading space. So each new run
of tokens is decoded together with a few tokens before it, and only the text past that prefix is emitted; text
ending in an incomplete character waits for the next run.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Fast (Rust) tokenizers decode through ``tokenizers``' own ``DecodeStream``, which does the above per token
    (its output matched ours on byte-level and SentencePiece vocabularies, 3-40x faster); slow ones take the
    prefix-decoding path here."""

    def __init__(self, tokenizer, shown: tuple[int, ...] = ()):
        """shown: special tokens whose text is kept (every other special token is dropped from the text)."""
        self.tokenizer = tokenizer
        self.shown = {t: tokenizer.convert_ids_to_tokens(t) for t in shown}
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids[prefix_offset:read_offset] is context already emitted
        self.read_offset = 0
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=True) if backend is not None else None
        self._emitted = 0  # characters emitted through the stream

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly completed text (possibly empty)."""
        if not token_ids:
            return ""
        if self.shown and any(t in self.shown for t in token_ids):
            # a shown token stands alone (special tokens are never merged into text): decode the runs around it
            out, run = "", []
            for t in token_ids:
                if t in self.shown:
                    out += self.add(run) + self.shown[t]
                    run = []
                else:
                    run.append(t)
            return out + self.add(run)
        self.ids.extend(token_ids)
        if self._stream is not None:
            pieces = [self._stream.step(self._backend, t) for t in token_ids]
            text = "".join(p for p in pieces if p)
            self._emitted += len(text)  # (``flush`` counts on it: the text of ``ids`` without shown tokens)
            return text
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        if self._stream is not None:
            rest = self._decode(self.ids)[self._emitted :]
            self._emitted += len(rest)
            return rest
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]


class StopMatcher:
    """Holds back just enough text that a stop string split across runs is still caught, and cuts at the first."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.buffer = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> str:
        """Returns the text that is safe to emit; sets ``stopped`` when a stop string appeared (it is not emitted)."""
        if self.stopped:
            return ""
        self.buffer += text
        if not self.stops:
            out, self.buffer = self.buffer, ""
            return out
        hits = [(i, s) for i, s in ((self.buffer.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])
            self.stopped = True
            out, self.buffer = self.buffer[:at], ""
            return out
        cut = max(len(self.buffer) - self.hold, 0)
        out, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return out

    def flush(self) -> str:
        out, self.buffer = ("" if self.stopped else self.buffer), ""
        return out
