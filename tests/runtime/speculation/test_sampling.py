"""Sampling's shared pieces: the greedy choice every pass and draft takes."""

from __future__ import annotations

import pytest
import torch

from depctl_runtime.model.runner import greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax_with_its_ties_and_nans(dtype):
    # speculation's exactness needs one choice everywhere; max(-1) stands in for argmax(-1) because it is faster, so
    # it must pick the same token, the first of equal maxima and a NaN over any number
    g = torch.Generator().manual_seed(0)
    for rows in (1, 3, 8, 40):
        logits = torch.randint(-3, 4, (rows, 4099), generator=g).to(dtype)  # many ties
        logits[rows // 2, 17] = float("nan")
        assert torch.equal(greedy(logits), logits.argmax(-1))
        assert greedy(logits)[rows // 2] == 17
    assert greedy(torch.tensor([2.0, 5.0, 5.0, 1.0])).item() == 1
