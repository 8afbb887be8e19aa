"""The speculative engine: batched steps over token ids. It knows nothing of HTTP, text or tokenizers.

Names resolve on first use (PEP 562), so ``from depctl_runtime.speculation import GenerationParams`` loads the plain
request types of ``params`` and not the engine with torch behind it.
"""

from __future__ import annotations

import importlib

_HOMES = {
    "DraftModelProposer": "proposers",
    "EngineConfig": "engine",
    "GenerationParams": "params",
    "NgramProposer": "proposers",
    "Proposer": "proposers",
    "SamplingParams": "params",
    "Scheduler": "scheduler",
    "Sequence": "sequence",
    "SpecDecodeStats": "stats",
    "SpeculativeEngine": "engine",
    "StepOutput": "sequence",
    "SuffixProposer": "proposers",
    "Tenant": "params",
    "generate": "scheduler",
    "ngram_propose": "proposers",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
