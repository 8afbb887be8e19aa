"""A learning head's first data: the target's own answers to the prompts depctl ships (``depctl draft train``'s set),
generated in idle time a piece at a time.

A deployment that learns from its traffic has nothing to learn from until it has served, and its training waits
whenever it has caught up with what it served. That idle time answers the shipped prompts instead: greedily, through
a one-row runner of its own over the target's weights (its own small KV cache; the engine's rows, cache and passes
are never touched, so a request arriving mid-answer is served exactly as it would have been, and the answer goes on
in the next idle slice). Each answer is recorded as a served one is: tokens, the target's layer features at every
position, one in eight held out. Real traffic joins them, and the disk budget evicts the oldest first.
"""

from __future__ import annotations

import random
from typing import Callable

import torch

from depctl_runtime.model.runner import ModelRunner, greedy
from depctl_runtime.training.traffic import MIN_ANSWER, Answer

MAX_TOKENS = 192  # tokens an answer may run to, as ``depctl draft train`` generates them
PROMPT_CHUNK = 32  # prompt tokens a piece reads


class ShippedAnswers:
    """The target's greedy answers to ``prompts`` (token ids, chat template applied), in a fixed shuffled order.

    ``piece`` runs one pass: a chunk of a prompt or one decode step; it returns an ``Answer`` when one ends."""

    def __init__(
        self,
        make_runner: Callable[[int], ModelRunner],
        prompts: list[list[int]],
        stop_ids: set[int],
        dtype: torch.dtype = torch.bfloat16,
        max_tokens: int = MAX_TOKENS,
        done: int = 0,
        seed: int = 0,
    ):
        self.prompts = list(prompts)
        random.Random(seed).shuffle(self.prompts)  # a mix of kinds early on, the same order after a restart
        self.stop_ids, self.dtype, self.max_tokens = stop_ids, dtype, max_tokens
        self.done = done  # prompts answered (or skipped): the next is ``prompts[done]``
        self._make_runner = make_runner
        self.runner: ModelRunner | None = None  # made at the first piece: its cache costs memory
        self._tokens: list[int] = []  # the answer under way: prompt and tokens so far
        self._features: list[torch.Tensor] = []
        self._prompt_len = 0

    @property
    def remaining(self) -> int:
        return len(self.prompts) - self.done

    @torch.inference_mode()
    def piece(self) -> Answer | None:
        """One pass of the next answer; the answer once it ends (None while it runs, or where it was too short)."""
        if self.runner is None:
            longest = max(map(len, self.prompts), default=0)
            self.runner = self._make_runner(longest + self.max_tokens)
        runner = self.runner
        if not self._tokens:
            runner.set_length(0, 0)
            self._tokens = list(self.prompts[self.done])
            self._prompt_len, self._features = len(self._tokens), []
        read = runner.length(0)
        if read < self._prompt_len:  # the prompt, a chunk a piece: a request arriving waits for one chunk at most
            logits, features = runner.prefill(0, self._tokens[read : read + PROMPT_CHUNK])
            self._features.append(features.to(device="cpu", dtype=self.dtype))
            if runner.length(0) < self._prompt_len:
                return None
            token = int(greedy(logits[0]))
        else:
            scores = runner.score(0, [[self._tokens[-1]]])
            self._features.append(scores.features.to(device="cpu", dtype=self.dtype))
            token = scores.argmax()[0]
        self._tokens.append(token)
        produced = len(self._tokens) - self._prompt_len
        if token not in self.stop_ids and produced < self.max_tokens:
            return None
        tokens, features = self._tokens, torch.cat(self._features)
        self._tokens, self._features = [], []
        self.done += 1
        if produced < MIN_ANSWER:
            return None
        return Answer(torch.tensor(tokens, dtype=torch.int32), features[: len(tokens) - 1], self._prompt_len)
