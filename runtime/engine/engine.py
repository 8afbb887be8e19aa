"""SpeculativeEngine: propose -> verify -> accept -> roll back, one step at a time, yielding accepted tokens.

It takes token ids and yields token ids. It knows nothing of tokenizers, text, HTTP or batching: one sequence at a
time (the caller serialises requests). Without a proposer every step is a plain decode step through the same
loop, so "speculation off" is measured with the same code.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from runtime.engine.metrics import SpecDecodeStats
from runtime.engine.policy import DraftLengthPolicy, RequestAcceptance
from runtime.engine.proposers import PredictionTracker, Proposer
from runtime.engine.runner import ModelRunner
from runtime.engine.sampling import SamplingParams, probs_from_logits
from runtime.engine.verify import verify_greedy, verify_sampled


@dataclass
class EngineConfig:
    num_draft_tokens: int = 0  # K, the most tokens drafted per step
    max_context: int = 2048  # prompt + output may not exceed this
    eos_token_ids: tuple[int, ...] = ()
    adaptive: bool = True  # let DraftLengthPolicy pick k <= K each step
    prediction_draft_tokens: int = 8  # K for a request's predicted output (drafting from it is free)


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int = 16
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    prediction: tuple[int, ...] = ()  # predicted output tokens (OpenAI "prediction"): drafted before the proposer
    speculate: bool = True  # False: this request decodes plainly (benchmarks compare on the same engine)


@dataclass(frozen=True)
class StepOutput:
    token_ids: list[int]  # accepted this step (may be empty on the final output)
    finish_reason: str | None = None  # "stop" | "length" | "cancelled"; set on the last output only
    drafted: int = 0
    accepted: int = 0
    prediction_drafted: int = 0  # of ``drafted``, tokens drafted from the request's prediction
    prediction_accepted: int = 0  # of ``token_ids``, tokens that followed the prediction


class SpeculativeEngine:
    def __init__(
        self,
        target: ModelRunner,
        proposer: Proposer | None = None,
        config: EngineConfig | None = None,
    ):
        self.target = target
        self.proposer = proposer
        self.config = config or EngineConfig()
        self.stats = SpecDecodeStats()  # the deployment's totals
        self.last_request_stats: SpecDecodeStats | None = None
        self._shadow: int | None = None  # this step's free n-gram guess while not drafting (see policy.py)
        self._draft_seconds = 0.0
        self.policy = DraftLengthPolicy(
            max_k=self.config.num_draft_tokens if proposer else 0,
            draft_costs_per_token=bool(proposer and proposer.cost_per_token),
            adaptive=self.config.adaptive,
        )

    def set_num_draft_tokens(self, k: int) -> None:
        """Change K in place (``depctl deployment update --draft-token-count``): no model is reloaded."""
        self.config.num_draft_tokens = k
        self.policy.max_k = k if self.proposer else 0

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: GenerationParams,
        cancel: threading.Event | None = None,
    ) -> Iterator[StepOutput]:
        if not prompt_ids:
            raise ValueError("the prompt must contain at least one token")
        if len(prompt_ids) >= self.config.max_context:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens; the context holds {self.config.max_context}"
            )
        sampling = params.sampling
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.config.eos_token_ids))
        generator = None
        if not sampling.greedy:
            generator = torch.Generator(device=self.target.device)
            generator.manual_seed(sampling.seed if sampling.seed is not None else torch.seed())
        limit = min(params.max_tokens, self.config.max_context - len(prompt_ids))
        stats = SpecDecodeStats(num_requests=1)
        acceptance = self.policy.new_request()
        tracker = PredictionTracker(params.prediction) if params.prediction else None
        pred_acceptance = self.policy.new_request(prior=0.8) if tracker else None
        tokens = list(prompt_ids)
        produced = 0
        try:
            with torch.inference_mode():
                t0 = time.perf_counter()
                self.target.reset()
                if self.proposer:
                    self.proposer.start(tokens)
                if len(tokens) > 1:  # prefill all but the last token, which is the first step's input
                    self.target.forward(tokens[:-1], last_only=True)
                stats.prefill_seconds = time.perf_counter() - t0
                while produced < limit:
                    if cancel is not None and cancel.is_set():
                        yield StepOutput([], "cancelled")
                        return
                    # every step emits at least one target token, so k <= limit - produced - 1 never overshoots
                    room = limit - produced - 1
                    drafts, draft_probs, from_prediction = self._propose(
                        tokens, len(prompt_ids), room, sampling, generator, acceptance, tracker, pred_acceptance,
                        params.speculate,
                    )
                    emitted, n = self._verify(
                        tokens, drafts, draft_probs, sampling, generator, stats,
                        pred_acceptance if from_prediction else acceptance,
                    )
                    drafted = len(drafts)
                    pd, pa = 0, 0  # prediction tokens drafted / output tokens that followed the prediction
                    if tracker is not None:
                        pa = tracker.observe(n if from_prediction else 0, emitted[-1])
                        pd = drafted if from_prediction else 0
                    for i, token in enumerate(emitted):
                        if token in stop_ids:
                            produced += i
                            yield StepOutput(emitted[:i], "stop", drafted, n, pd, pa)
                            return
                    produced += len(emitted)
                    finish = "length" if produced >= limit else None
                    yield StepOutput(emitted, finish, drafted, n, pd, pa)
                    if finish:
                        return
                yield StepOutput([], "length")
        finally:
            stats.num_generated_tokens = produced
            self.policy.end_request(acceptance)
            self.stats.merge(stats)
            self.last_request_stats = stats

    def _propose(self, tokens, prompt_len, room, sampling, generator, acceptance, tracker, pred_acceptance, speculate):
        """Drafts for one step: from the request's prediction first, else from the deployment's proposer.

        Returns (draft_tokens, draft_probs [k, vocab] or None for one-hot, whether they came from the prediction).
        Also measures drafting: a draft model's per-token cost feeds the policy.
        """
        t0 = time.perf_counter()
        self._shadow = None
        if tracker is not None:
            k = min(self.config.prediction_draft_tokens, room)
            if sampling.greedy or sampling.seed is None:
                k = self.policy.choose(pred_acceptance, room, max_k=self.config.prediction_draft_tokens, free=True)
            drafts = tracker.propose(tokens[prompt_len:], k)
            if drafts:
                self._draft_seconds = time.perf_counter() - t0
                return drafts, None, True
        proposer = self.proposer if speculate else None
        drafts, probs = [], None
        if proposer is not None:
            if sampling.seed is not None and not sampling.greedy:
                # a seeded sample must depend on the seed alone, and the draft length changes which random
                # draws land where; measured costs vary run to run, so seeded requests draft a fixed K
                k = min(self.policy.max_k, room)
            else:
                k = self.policy.choose(acceptance, room)
            if k > 0:
                drafts, probs = proposer.propose(tokens, k, sampling, generator)
                if proposer.cost_per_token and drafts:
                    self.policy.observe_draft(len(drafts), time.perf_counter() - t0)
            elif not proposer.cost_per_token:
                # not drafting: still compute the free proposer's guess, so the acceptance estimate keeps moving
                guess, _ = proposer.propose(tokens, 1, sampling, generator)
                self._shadow = guess[0] if guess else None
        self._draft_seconds = time.perf_counter() - t0
        return drafts, probs, False

    def _verify(
        self,
        tokens: list[int],
        draft_tokens: list[int],
        draft_probs: torch.Tensor | None,  # [k, vocab], or None for a one-hot (n-gram, prediction) draft
        sampling: SamplingParams,
        generator: torch.Generator | None,
        stats: SpecDecodeStats,
        acceptance: RequestAcceptance,
    ) -> tuple[list[int], int]:
        """Verify the drafts in ONE target forward, extend ``tokens``, roll back. Returns (emitted, accepted)."""
        t1 = time.perf_counter()
        logits = self.target.forward([tokens[-1]] + draft_tokens)  # [k + 1, vocab]
        if sampling.greedy:
            n, next_token = verify_greedy(draft_tokens, logits)
        else:
            target_probs = probs_from_logits(logits, sampling)  # [k + 1, vocab]
            n, next_token = verify_sampled(draft_tokens, draft_probs, target_probs, generator)
        emitted = draft_tokens[:n] + [next_token]
        tokens.extend(emitted)

        # roll back: both caches keep exactly the accepted sequence minus its last token
        self.target.crop_to(len(tokens) - 1)
        if self.proposer is not None:
            self.proposer.rollback(len(tokens) - 1)
        t2 = time.perf_counter()

        drafted = len(draft_tokens)
        self.policy.observe_verify(drafted, t2 - t1)
        if drafted:
            acceptance.observe(n, n + (1 if n < drafted else 0))
        elif self._shadow is not None:
            acceptance.observe(int(self._shadow == next_token), 1)
        stats.record_step(drafted, n, len(emitted), self._draft_seconds, t2 - t1)
        return emitted, n

    @torch.inference_mode()
    def calibrate(self, lengths: Sequence[int] | None = None, context: int = 64, repeats: int = 2) -> dict:
        """Measure verify(k) (and the draft's per-token cost) once, so the policy starts from real numbers.

        Also warms up the kernels, so the first request does not pay for lazy initialisation.
        """
        max_k = self.config.num_draft_tokens if self.proposer else 0
        if lengths is None:
            lengths = sorted({0, max_k, *(k for k in (1, 2, 4, 8, 16, 32) if k <= max_k)})
        vocab = self.target.vocab_size or 256
        prompt = [(i * 7919) % min(vocab, 1000) for i in range(context)]
        self.target.reset()
        self.target.forward(prompt, last_only=True)
        for k in lengths:
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                logits = self.target.forward(prompt[: k + 1])
                logits.argmax(-1).tolist()  # sync, as a real step does
                best = min(best, time.perf_counter() - t0)
                self.target.crop_to(context)
            self.policy.verify_cost[k] = best
        if self.proposer is not None and self.proposer.cost_per_token:
            runner = self.proposer.runner
            runner.reset()
            runner.forward(prompt, last_only=True)
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                runner.forward(prompt[:1])[-1].argmax().item()
                best = min(best, time.perf_counter() - t0)
                runner.crop_to(context)
            self.policy.draft_cost = best
        self.target.reset()
        return self.policy.snapshot()
