"""The speculative engine: batched steps over token ids. It knows nothing of HTTP, text or tokenizers."""

from runtime.speculation.engine import EngineConfig, SpeculativeEngine
from runtime.speculation.proposers import DraftModelProposer, NgramProposer, Proposer, SuffixProposer, ngram_propose
from runtime.speculation.sampling import SamplingParams
from runtime.speculation.scheduler import Scheduler, generate
from runtime.speculation.sequence import GenerationParams, Sequence, StepOutput
from runtime.speculation.stats import SpecDecodeStats

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
    "generate",
    "ngram_propose",
]
