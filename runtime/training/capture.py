"""The target's layer features, kept as depctl's engine answers the training prompts: no second pass over them.

The engine hands every running sequence's features to its model proposer (``prefilled`` for each prompt chunk,
``accepted`` after each step: ``proposers.ModelProposer``). ``FeatureRecorder`` takes that place and never drafts (the
answers are generated with speculation off), so a head learns from exactly the features a deployment of the same
target, at the same precision, will give it.
"""

from __future__ import annotations

import torch


class FeatureRecorder:
    name = "features"
    steady_catch_up = 0

    def __init__(self, dtype: torch.dtype = torch.bfloat16):
        self.dtype = dtype  # kept at half size: an answer's features are [tokens, 3 * hidden]
        self._parts: dict[int, list[torch.Tensor]] = {}  # sequence id -> its positions' features, in order

    def prefilled(self, seq, start: int, features: torch.Tensor | None) -> None:
        self._keep(seq, features)

    def accepted(self, seq, before: int, emitted, drafted, features: torch.Tensor | None) -> None:
        self._keep(seq, features)

    def _keep(self, seq, features: torch.Tensor | None) -> None:
        if features is None:
            raise ValueError("the target runner takes no layer features: load it with the head's layers")
        self._parts.setdefault(seq.id, []).append(features.to(device="cpu", dtype=self.dtype))

    def take(self, seq_id: int) -> torch.Tensor:
        """A finished sequence's features [positions read, F]: every token but its last."""
        return torch.cat(self._parts.pop(seq_id))

    def drop(self, seq_id: int) -> None:
        self._parts.pop(seq_id, None)

    def propose(self, batch, width: int):
        raise RuntimeError("the feature recorder never drafts: generate with speculation off")

    def set_length(self, row: int, length: int) -> None:
        pass

    def move_row(self, src: int, dst: int) -> None:
        pass

    def calibrate(self, cost, rows: int, prompt: list[int]) -> None:
        pass

    def release(self) -> None:
        self._parts.clear()
