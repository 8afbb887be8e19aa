"""The speculative engine: batched steps over token ids. It knows nothing of HTTP, text or tokenizers."""

from runtime.engine.engine import EngineConfig, SpeculativeEngine
from runtime.engine.metrics import SpecDecodeStats
from runtime.engine.proposers import DraftModelProposer, NgramProposer, Proposer, SuffixProposer, ngram_propose
from runtime.engine.sampling import SamplingParams
from runtime.engine.scheduler import Scheduler
from runtime.engine.sequence import GenerationParams, Sequence, StepOutput

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
    "SuffixProposer",
    "ngram_propose",
]
