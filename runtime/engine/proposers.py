"""Proposers: cheap guesses of the next tokens.

Two kinds, told apart by ``cost_per_token``:

- a **free** proposer (n-gram lookup; a request's predicted output, see ``PredictionTracker``) looks at a row's
  tokens and returns up to ``k`` guesses: ``propose(tokens, k) -> list[int]``. Computing its guess costs nothing
  next to a forward pass, so the engine asks before it decides how long this step's drafts are.
- a **draft model** costs a forward per drafted token, batched over the running rows:
  ``propose(batch, width) -> (drafts, draft_probs)``; it owns a KV cache with the same rows as the target's
  (``prefill``, ``set_length`` and ``move_row`` keep them in step).

Draft probabilities are ``None`` for a deterministic (one-hot) guess.
"""

from __future__ import annotations

from typing import Protocol, Sequence, Union

import numpy as np
import torch

from runtime.engine.runner import ModelRunner
from runtime.engine.sampling import probs_from_logits


CONTEXT_LOOKBACK = 64  # how far back a candidate match's agreement with the current suffix is measured


def ngram_propose(tokens: Sequence[int], n: int, k: int) -> list[int]:
    """Prompt-lookup decoding (Saxena 2023): find an earlier occurrence of the last ``n`` tokens and propose the
    (up to ``k``) tokens that followed it; with no occurrence, nothing (the engine then runs a plain step).

    Among the occurrences, the one whose preceding tokens agree longest with the text before the suffix wins (up
    to ``CONTEXT_LOOKBACK`` tokens; the most recent on a tie). When the output copies a block of the prompt, that
    is the aligned place in the block rather than the latest line that happens to end the same way (a newline and
    an indent match everywhere in code). ``n`` is a minimum: shorter matches (a single common token) mostly
    propose junk; on the benchmark prompts n=3 drafts were accepted 64% of the time against 35% when falling back
    to shorter suffixes, for the same number of tokens per verify. The continuation may run into the suffix itself
    (a repeating pattern keeps proposing itself), but never past the end of ``tokens``.
    """
    length = len(tokens)
    if k <= 0 or length < 2:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    ends = np.flatnonzero(arr[:-1] == arr[-1])  # candidate matches end before the last token
    if ends.size == 0:
        return []
    # agreement of every candidate with the suffix, counting back from its end, in one [candidates, lookback] pass
    # (this runs for every row of every step, drafting or not: a Python loop over the lookback cost ~2 ms a row)
    back = np.arange(min(CONTEXT_LOOKBACK, length - 1))  # [L]
    positions = ends[:, None] - back[None, :]  # [C, L]
    same = (positions >= 0) & (arr[np.maximum(positions, 0)] == arr[length - 1 - back][None, :])
    agree = np.cumprod(same, axis=1).sum(axis=1)  # [C]: leading run of agreement
    if agree.max() < n:  # no earlier occurrence of the last n tokens
        return []
    best = int(np.flatnonzero(agree == agree.max())[-1])
    end = int(ends[best])
    return list(tokens[end + 1 : end + 1 + k])


def lookup_in_reference(generated: Sequence[int], reference: Sequence[int], n: int, after: int = 0) -> int:
    """Where the output continues in ``reference``: the index just past a match of the last ``n`` (or fewer, down
    to 1) generated tokens, preferring the first match ending at or after ``after``; -1 when nothing matches."""
    length = len(generated)
    for size in range(min(n, length), 0, -1):
        suffix = list(generated[length - size :])
        ends = [i + size for i in range(len(reference) - size) if list(reference[i : i + size]) == suffix]
        if ends:
            later = [e for e in ends if e >= after]
            return later[0] if later else ends[-1]
    return -1


class PredictionTracker:
    """Predicted outputs: draft from text the client expects the answer to contain (an edited file, say).

    ``expected`` is the index in the prediction of the next token while the output follows it; the first step
    proposes the prediction's start. After a divergence the last ``NGRAM`` generated tokens are looked up in the
    prediction to find where the output rejoins it (edits move forward, so later matches are preferred).
    """

    NGRAM = 4

    def __init__(self, prediction: Sequence[int]):
        self.prediction = list(prediction)
        self.expected = 0
        self.last = 0  # furthest position reached, for re-syncing
        self._start = -1
        self.matched = 0  # output tokens that followed the prediction: accepted drafts and agreeing target tokens

    def propose(self, generated: Sequence[int], k: int) -> list[int]:
        start = self.expected
        if start < 0 or start >= len(self.prediction):
            start = lookup_in_reference(generated, self.prediction, self.NGRAM, self.last) if generated else -1
        self._start = start
        return self.prediction[start : start + k] if k > 0 and start >= 0 else []

    def observe_first(self, token: int) -> int:
        """The prefill's token (no drafts): 1 when it is the prediction's start."""
        self._start = self.expected
        return self.observe(0, token)

    def observe(self, accepted: int, next_token: int) -> int:
        """After verification: follow the prediction while the target's own token agrees with it.

        Returns how many of the step's output tokens came from the prediction."""
        pos = self._start + accepted if self._start >= 0 else -1
        if 0 <= pos < len(self.prediction) and self.prediction[pos] == next_token:
            self.expected = pos + 1
            self.last = max(self.last, self.expected)
            self.matched += accepted + 1
            return accepted + 1
        self.expected = -1
        self.matched += accepted
        return accepted


class FreeProposer(Protocol):
    name: str
    cost_per_token: bool  # False

    def propose(self, tokens: Sequence[int], k: int) -> list[int]: ...


class NgramProposer:
    name = "ngram"
    cost_per_token = False

    def __init__(self, ngram_length: int):
        self.ngram_length = ngram_length

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        return ngram_propose(tokens, self.ngram_length, k)


class DraftModelProposer:
    """A small model with the target's tokenizer drafts autoregressively, for every running row at once."""

    name = "draft_model"
    cost_per_token = True

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def prefill(self, row: int, tokens: list[int]) -> None:
        self.runner.forward(row, [tokens], last_only=True)

    def set_length(self, row: int, length: int) -> None:
        self.runner.set_length(row, min(length, self.runner.length(row)))

    def move_row(self, src: int, dst: int) -> None:
        self.runner.move_row(src, dst)

    @torch.inference_mode()
    def propose(self, batch, width: int) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """``width`` drafts for each of rows 0..B-1 (``batch[b]`` has ``tokens``, ``sampling``, ``generator``).

        Returns drafts [B][width] and, per row, draft_probs [width, vocab] (None for greedy rows: one-hot)."""
        runner = self.runner
        # Catch up: a row holds a prefix of its tokens; feed the rest. Normally that is the last accepted token;
        # after a full accept also d_k, which was never fed; more after steps that did not draft.
        pending = [list(seq.tokens[runner.length(b):]) for b, seq in enumerate(batch)]
        logits = runner.forward(0, pending, last_only=True)  # [B, vocab]
        drafted: list[torch.Tensor] = []  # width tensors of shape [B]; on the device until the end
        probs: list[list[torch.Tensor]] = [[] for _ in batch]  # per row, width tensors of [vocab]
        for i in range(width):
            token = logits.argmax(-1)  # [B]
            for b, seq in enumerate(batch):
                if not seq.sampling.greedy:
                    q = probs_from_logits(logits[b : b + 1], seq.sampling)  # [1, vocab]
                    token[b] = torch.multinomial(q[0], 1, generator=seq.generator)[0]
                    probs[b].append(q[0])
            drafted.append(token)
            if i + 1 < width:  # d_k is never fed: the target checks it, and catch-up feeds it if accepted
                logits = runner.forward(0, token[:, None])  # [B, vocab]
        tokens = torch.stack(drafted, 1).tolist() if drafted else [[] for _ in batch]  # one host sync
        return tokens, [torch.stack(p) if p else None for p in probs]


Proposer = Union[NgramProposer, DraftModelProposer, FreeProposer]
