"""What the target computed while depctl's engine answered the training prompts: no second pass over them.

The engine hands every running sequence's layer features to its model proposer (``prefilled`` for each prompt chunk,
``accepted`` after each step: ``proposers.ModelProposer``), with the logits of the same positions on request.
``FeatureRecorder`` takes that place and never drafts (the answers are generated with speculation off). It keeps the
features, at the precision a deployment of the same target runs (so a head learns exactly what it will be given),
and the target's ``TOP_K`` most likely tokens with their log-probabilities from the last prompt position on: the
distribution each answer position is drawn from, which a head learns more from than from the one token drawn.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

TOP_K = 16


@dataclass
class Recorded:
    """One sequence's: features [positions read, F], and from its last prompt position on (row r: position
    ``prompt_len - 1 + r``) the target's top tokens [rows, TOP_K] and their log-probabilities."""

    features: list[torch.Tensor] = field(default_factory=list)
    top_ids: list[torch.Tensor] = field(default_factory=list)
    top_logp: list[torch.Tensor] = field(default_factory=list)


def keep_top(kept: Recorded, logits: torch.Tensor) -> None:
    """The target's ``TOP_K`` most likely tokens and their log-probabilities at each row of ``logits`` [rows, vocab]."""
    logits = logits.float()
    top = logits.topk(TOP_K, dim=-1)  # (the log-probabilities' order: no [rows, vocab] log-softmax is written)
    kept.top_ids.append(top.indices.to(device="cpu", dtype=torch.int32))
    logp = top.values - torch.logsumexp(logits, dim=-1, keepdim=True)
    kept.top_logp.append(logp.to(device="cpu", dtype=torch.float16))


class FeatureRecorder:
    name = "features"
    steady_catch_up = 0
    needs_prompt_features = True  # every prompt position's: no prompt from the prefix cache

    def __init__(self, dtype: torch.dtype = torch.bfloat16):
        self.dtype = dtype  # kept at half size: an answer's features are [tokens, 3 * hidden]
        self._seqs: dict[int, Recorded] = {}

    def prefilled(self, seq, start: int, features: torch.Tensor | None, logits=None) -> None:
        kept = self._keep(seq, features)
        if start + features.shape[0] == seq.prompt_len and logits is not None:  # the prompt's last position
            keep_top(kept, logits())

    def accepted(self, seq, before: int, emitted, drafted, features: torch.Tensor | None, logits=None) -> None:
        kept = self._keep(seq, features)
        if logits is not None:
            keep_top(kept, logits())

    def _keep(self, seq, features: torch.Tensor | None) -> Recorded:
        if features is None:
            raise ValueError("the target runner takes no layer features: load it with the head's layers")
        kept = self._seqs.setdefault(seq.id, Recorded())
        kept.features.append(features.to(device="cpu", dtype=self.dtype))
        return kept

    def take(self, seq_id: int) -> dict:
        """A finished sequence's ``features`` (every token but its last), ``top_ids`` and ``top_logp``."""
        kept = self._seqs.pop(seq_id)
        return {
            "features": torch.cat(kept.features),
            "top_ids": torch.cat(kept.top_ids),
            "top_logp": torch.cat(kept.top_logp),
        }

    def drop(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    def propose(self, batch, width: int, min_confidence: float = 0.0):
        raise RuntimeError("the feature recorder never drafts: generate with speculation off")

    def set_length(self, row: int, length: int) -> None:
        pass

    def move_row(self, src: int, dst: int) -> None:
        pass

    def behind(self, seq) -> int:
        return 0

    def calibrate(self, cost, rows: int, prompt: list[int], repeats: int = 2, catch_up=None) -> None:
        pass

    def release(self) -> None:
        self._seqs.clear()
