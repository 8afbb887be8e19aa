"""What a request asks of the engine, as plain values: sampling, penalties, who sent it and how much to generate.

These are the words the API, the backends and the engine share, so this module imports no torch: a process that only
builds or checks requests (the CLI, the API models, a test of the Backend protocol) never pays for loading it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from depctl_runtime.speculation.grammar import Grammar


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means off
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class Penalties:
    """OpenAI's ``logit_bias``, ``presence_penalty`` and ``frequency_penalty``, and vLLM's ``repetition_penalty``:
    changes to the target's logits that depend on the output so far. At verified position ``j`` the output so far
    includes the drafts before ``j``, so a step's positions see what plain decoding would have seen."""

    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    presence: float = 0.0  # subtracted once from every token already in the output
    frequency: float = 0.0  # subtracted per occurrence in the output
    repetition: float = 1.0  # divides positive logits and multiplies negative ones of tokens in the prompt or output

    @property
    def active(self) -> bool:
        return bool(self.logit_bias) or self.presence != 0.0 or self.frequency != 0.0 or self.repetition != 1.0


@dataclass(frozen=True)
class Tenant:
    """Who sent a request, as far as sharing state across requests goes (suffix speculation's index): a digest of
    the API key it presented and its ``user`` field."""

    key: str = ""
    user: str = ""


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int = 16
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    prediction: tuple[int, ...] = ()  # predicted output tokens (OpenAI "prediction"): drafted before the proposer
    speculate: bool = True  # False: no drafts at all for this request (a prediction included)
    max_draft_tokens: int | None = (
        None  # this request drafts at most this many tokens per step (None: the deployment's K)
    )
    grammar: Grammar | None = None  # the output must match it (structured outputs)
    penalties: Penalties = field(default_factory=Penalties)
    logprobs: int | None = None  # None: none; n: each token's log-probability and the n most likely (0-20)
    tenant: Tenant = Tenant()
    cache_salt: str = ""  # requests with different salts never share cached prompt blocks (vLLM's field)
    cache_shared: bool = False  # the deployment shares cached prompt blocks across tenants (its owner's opt-in)


def cache_scope(params: GenerationParams) -> str:
    """Who may share cached prompt blocks with this request: a digest of its tenant (the API key's digest and the
    user) and its cache salt. Our prefix cache names blocks under it, and a vLLM deployment gets it as the request's
    ``cache_salt``, so neither lets one tenant's time to first token tell another what was sent before. A deployment
    whose owner chose to share them across tenants (``cache_shared``) keeps only the salt apart."""
    tenant = Tenant() if params.cache_shared else params.tenant
    return hashlib.sha256(f"{tenant.key}\0{tenant.user}\0{params.cache_salt}".encode()).hexdigest()
