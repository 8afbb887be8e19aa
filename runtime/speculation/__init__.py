"""The speculative engine: batched steps over token ids. It knows nothing of HTTP, text or tokenizers."""

from depctl_runtime.speculation.engine import EngineConfig, SpeculativeEngine
from depctl_runtime.speculation.proposers import (
    DraftModelProposer,
    NgramProposer,
    Proposer,
    SuffixProposer,
    ngram_propose,
)
from depctl_runtime.speculation.sampling import SamplingParams
from depctl_runtime.speculation.scheduler import Scheduler, generate
from depctl_runtime.speculation.sequence import GenerationParams, Sequence, StepOutput, Tenant
from depctl_runtime.speculation.stats import SpecDecodeStats

__all__ = [
    "DraftModelProposer",
    "EngineConfig",
    "GenerationParams",
    "NgramProposer",
    "Proposer",
    "SamplingParams",
    "Scheduler",
    "Sequence",
    "SpecDecodeStats",
    "SpeculativeEngine",
    "StepOutput",
    "Tenant",
    "SuffixProposer",
    "generate",
    "ngram_propose",
]
