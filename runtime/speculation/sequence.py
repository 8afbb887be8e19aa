"""A request inside the engine: its tokens, its row in the batch, and what it has learned about its drafts."""

from __future__ import annotations

import array
import hashlib
import itertools
from dataclasses import dataclass

import torch

from depctl_runtime.speculation.faults import RowFault
from depctl_runtime.speculation.grammar import RowGrammar
from depctl_runtime.speculation.params import GenerationParams, SamplingParams, cache_scope
from depctl_runtime.speculation.policy import RequestAcceptance
from depctl_runtime.speculation.proposers import PredictionTracker
from depctl_runtime.speculation.sampling import TokenLogprob


@dataclass(frozen=True)
class StepOutput:
    token_ids: list[int]  # accepted this step (may be empty on the final output)
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"; set on the last output only
    drafted: int = 0
    accepted: int = 0
    prediction_drafted: int = 0  # of ``drafted``, tokens drafted from the request's prediction
    prediction_accepted: int = 0  # of ``token_ids``, tokens that followed the prediction
    grammar_drafted: int = 0  # of ``drafted``, tokens the grammar forced
    grammar_accepted: int = 0  # of ``accepted``, forced tokens the target agreed with
    logprobs: list[TokenLogprob] | None = None  # one per token of ``token_ids``, when the request asked
    error: RowFault | None = None  # why the request ended, with finish_reason "error"
    cached_tokens: int = 0  # on a request's first output: its prompt tokens read from the prefix cache


_ids = itertools.count()


class Sequence:
    """One request's state. ``tokens`` is prompt + accepted output; ``row`` its row in every cache (-1: none)."""

    def __init__(
        self,
        prompt: list[int],
        params: GenerationParams,
        limit: int,
        stop_ids: frozenset[int],
        acceptance: RequestAcceptance,
        prediction: PredictionTracker | None,
        prediction_acceptance: RequestAcceptance | None,
        device: torch.device,
        grammar_acceptance: RequestAcceptance | None = None,
        model_acceptance: RequestAcceptance | None = None,
    ):
        self.id = next(_ids)
        self.prompt_len = len(prompt)
        self.tokens = list(prompt)
        self.params = params
        self.limit = limit  # most output tokens (max_tokens, clamped to the context)
        self.stop_ids = stop_ids
        self.row = -1
        self.prefilled = 0  # prompt tokens already in the caches
        self.cached_tokens = 0  # of those, tokens copied from the prefix cache rather than read
        self._prefix_keys: list[bytes] = []
        self.acceptance = acceptance
        self.prediction = prediction
        self.prediction_acceptance = prediction_acceptance
        self.finish_reason: str | None = None
        self.fault: RowFault | None = None  # set when a part of a step failed for this row alone: it ends there
        # the row's place in its grammar: the one matcher state of this request (None: unconstrained)
        self.grammar: RowGrammar | None = params.grammar.start() if params.grammar is not None else None
        self.grammar_acceptance = grammar_acceptance  # how often the target takes the tokens the grammar forces
        # where a model proposer drafts beside a free one (a learned head beside the n-gram index), its own rate: a
        # copy found is accepted far more often than a head's guess, and one rate for both would misjudge each
        self.model_acceptance = model_acceptance
        sampling = params.sampling
        self.generator = None
        if not sampling.greedy:
            # seeded: the seed decides the target's draws (position by position, see verify.py); this generator
            # only draws a draft model's guesses, which never change the output
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(sampling.seed if sampling.seed is not None else torch.seed())

    def prefix_keys(self, n: int, block: int) -> list[bytes]:
        """The names of the prompt's first ``n`` blocks of ``block`` tokens: each a digest of the tenant, the cache
        salt and every token up to the block's end, so a block is found only after the same whole prefix, and only
        by the same tenant."""
        keys = self._prefix_keys
        while len(keys) < n:
            i = len(keys)
            digest = hashlib.sha256(keys[-1] if keys else self.root_key())
            digest.update(array.array("q", self.tokens[i * block : (i + 1) * block]).tobytes())
            keys.append(digest.digest())
        return keys[:n]

    def root_key(self) -> bytes:
        """What every cached block of this tenant's prompts descends from: its scope (``cache_scope``)."""
        return cache_scope(self.params).encode()

    @property
    def answered(self) -> int:
        """Tokens of the prompt and the answer as the client got it, its stop token included: a step may have
        accepted drafts past a stop, which are not part of it."""
        for i in range(self.prompt_len, len(self.tokens)):
            if self.tokens[i] in self.stop_ids:
                return i + 1
        return len(self.tokens)

    @property
    def produced(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def room(self) -> int:
        """Most drafts this sequence may verify next step: every step emits at least one target token, so
        ``k <= limit - produced - 1`` never overshoots."""
        return self.limit - self.produced - 1

    @property
    def sampling(self) -> SamplingParams:
        return self.params.sampling
