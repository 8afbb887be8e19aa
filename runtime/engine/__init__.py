"""The speculative engine: a generator over token ids. It knows nothing of HTTP, text or tokenizers."""

from runtime.engine.engine import EngineConfig, GenerationParams, SpeculativeEngine, StepOutput
from runtime.engine.metrics import SpecDecodeStats
from runtime.engine.proposers import DraftModelProposer, NgramProposer, Proposer, ngram_propose
from runtime.engine.sampling import SamplingParams

__all__ = [
    "DraftModelProposer",
    "EngineConfig",
    "GenerationParams",
    "NgramProposer",
    "Proposer",
    "SamplingParams",
    "SpecDecodeStats",
    "SpeculativeEngine",
    "StepOutput",
    "ngram_propose",
]
