"""OpenAI response pieces built from a run's deltas: logprobs in the chat and the completions shapes."""

from __future__ import annotations

from depctl_runtime.backends import Logprob


def chat_logprobs(logprobs: list[Logprob] | tuple[Logprob, ...]) -> dict:
    """``choices[].logprobs`` of a chat completion (or of one chunk: the tokens it carries)."""

    def entry(token: str, raw: bytes, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(raw)}

    return {
        "content": [
            {**entry(lp.token, lp.bytes, lp.logprob), "top_logprobs": [entry(*t) for t in lp.top]} for lp in logprobs
        ],
        "refusal": None,
    }


def completion_logprobs(logprobs: list[Logprob] | tuple[Logprob, ...], offset: int = 0) -> dict:
    """``choices[].logprobs`` of a text completion; ``offset``: where this chunk's text starts in the whole text."""
    offsets = []
    for lp in logprobs:
        offsets.append(offset)
        offset += len(lp.token)
    return {
        "tokens": [lp.token for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{t: v for t, _, v in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }
