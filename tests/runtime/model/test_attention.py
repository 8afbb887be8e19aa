"""Attention over the cache's rows: a prompt chunk attended the same wherever the prompt was cut."""

from __future__ import annotations

import random

import pytest
import torch

from depctl_runtime.backends.precision import surgery_for
from depctl_runtime.model.runner import ModelRunner
from tests.tiny import tiny_gemma3, tiny_llama, tiny_qwen2_sliding

PROMPT = [(i * 37) % 250 + 1 for i in range(700)]  # past one multiple of the key padding (512)


def _read(runner: ModelRunner, row: int, cuts: list[int]) -> torch.Tensor:
    runner.set_length(row, 0)
    start, logits = 0, None
    for end in [*cuts, len(PROMPT)]:
        logits, _ = runner.prefill(row, PROMPT[start:end])
        start = end
    return logits.clone()


def _cuts(seed: int) -> list[int]:
    """Cuts anywhere within 128-token blocks (as the scheduler cuts a prompt resumed mid-block): one-token chunks,
    chunks of every size."""
    rng = random.Random(seed)
    cuts, at = set(range(128, len(PROMPT), 128)), 0
    while True:
        at += rng.choice([1, 2, 3, 5, 17, 33, 64, 100, 127])
        if at >= len(PROMPT):
            return sorted(cuts)
        cuts.add(at)


@pytest.mark.parametrize(
    "make,precision,fused",
    [
        (tiny_llama, "float32", True),
        (tiny_llama, "bfloat16", True),
        (tiny_llama, "float32", False),  # transformers' own forward with our attention
        (tiny_qwen2_sliding, "float32", True),
        (tiny_gemma3, "float32", False),
    ],
    ids=["llama-f32", "llama-bf16", "llama-transformers", "qwen2-sliding", "gemma3"],
)
def test_a_prompt_cut_anywhere_leaves_the_bits_of_whole_chunks(make, precision, fused):
    """What a prefix cache resuming mid-block rests on: every position's keys and values, and the last logits, are
    the same whatever chunks the prompt was read in, with the loader's (row-invariant) products."""
    model = make(max_positions=1024) if make is tiny_llama else make()
    surgery_for(model.to(getattr(torch, precision)), precision, exact=True, fuse=fused)
    runner = ModelRunner(model, max_rows=2, max_context=1024)
    assert runner.prompt_cuts_exact()
    whole = _read(runner, 0, list(range(128, len(PROMPT), 128)))
    for seed in range(4):
        cuts = _cuts(seed)
        assert torch.equal(_read(runner, 1, cuts), whole), cuts
        for layer in runner.cache.layers:
            for name in ("keys", "values"):
                tensor = getattr(layer, name)
                assert torch.equal(tensor[1, :, : len(PROMPT)], tensor[0, :, : len(PROMPT)]), (cuts, name)


class _WidthDependent(torch.nn.Module):
    """A linear that rounds a row differently when few rows share the pass, as some libraries' kernels do."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        y = self.linear(x)
        return y + 1e-3 if x.reshape(-1, x.shape[-1]).shape[0] < 12 else y


def test_the_runner_finds_products_that_round_by_the_chunks_width():
    model = tiny_llama(max_positions=1024)
    surgery_for(model, "float32", exact=True)
    layer = model.model.layers[0]
    layer.mlp.down_proj = _WidthDependent(layer.mlp.down_proj)
    assert not ModelRunner(model, max_rows=1, max_context=1024).prompt_cuts_exact()
