"""Sampling's shared pieces: the greedy choice every pass and draft takes."""

from __future__ import annotations

import pytest
import torch

from depctl_runtime.model.runner import greedy
from depctl_runtime.speculation.sampling import token_logprobs


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_logprobs_list_the_greedy_token_first_among_equals(dtype):
    # bf16 logits tie often; the alternatives must order equals as greedy does (first id first), or a greedy token
    # is reported as the second most likely
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 4, (40, 4099), generator=g).to(dtype)
    chosen = greedy(logits).tolist()
    for top in (1, 3, 5):
        got = token_logprobs(logits, chosen, top)
        for row, lp in zip(logits.float().log_softmax(-1), got):
            expected = sorted(range(row.numel()), key=lambda i: (-row[i].item(), i))[:top]
            assert [t for t, _ in lp.top] == expected
            assert lp.top[0][0] == lp.token
    # a tie across the cut: the set is the first ids too, not topk's pick among equals
    got = token_logprobs(torch.tensor([[0.0, 1.0, 1.0, 1.0, 1.0, 2.0]]), [5], 3)
    assert [t for t, _ in got[0].top] == [5, 1, 2]
