"""Attention over the cache's rows: a prompt chunk attended the same wherever the prompt was cut."""

from __future__ import annotations

import random

import pytest
import torch

from depctl_runtime.backends.precision import surgery_for
from depctl_runtime.model.attention import rows_attention
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


# a draft tree after a prompt, as the row's stream: token 0 the root (the last accepted token), then the drafts;
# ANCESTRY[j] is token j's parent among them:  0 -> 1 -> 2 -> 3,  0 -> 4 -> 5,  4 -> 6,  1 -> 7
TREE_TOKENS = [17, 40, 41, 42, 90, 91, 92, 43]
ANCESTRY = (-1, 0, 1, 2, 0, 4, 4, 1)


def _path(j: int) -> list[int]:
    out = []
    while j >= 0:
        out.append(j)
        j = ANCESTRY[j]
    return out[::-1]


def _steps(runner: ModelRunner, row: int, tokens: list[int]) -> list[torch.Tensor]:
    """One-token steps in ``row``: the logits after each token."""
    return [runner.score(row, [[t]]).logits()[0].clone() for t in tokens]


@pytest.mark.parametrize(
    "make,per_position",
    [(tiny_llama, True), (tiny_llama, False), (tiny_qwen2_sliding, True), (tiny_qwen2_sliding, False)],
    ids=["llama-per-position", "llama-masked", "sliding-per-position", "sliding-masked"],
)
def test_a_draft_tree_scores_each_token_as_its_own_branch_and_keeps_the_accepted_one(make, per_position):
    """Each token of a tree, verified in one pass beside a chain in another row, gets the logits one-token steps
    along its own branch give (bit for bit where the runner attends position by position, as on a CPU); after
    ``keep_path`` the row holds what those steps left, so decoding goes on as if only the branch had been read."""
    model = make(max_positions=1024) if make is tiny_llama else make()
    surgery_for(model, "float32", exact=True)
    runner = ModelRunner(model, max_rows=3, max_context=1024)
    runner.per_position = per_position
    prompt = PROMPT[:300]  # past the sliding model's window
    for row in range(3):
        runner.prefill(row, prompt)
    start = len(prompt)
    chain = [17, 5, 6]
    scores = runner.score(0, [TREE_TOKENS, chain], trees=[ANCESTRY, None]).logits()
    same = torch.equal if per_position else lambda a, b: torch.allclose(a, b, atol=1e-5)
    for j in range(len(TREE_TOKENS)):
        runner.set_length(2, start)
        alone = _steps(runner, 2, [TREE_TOKENS[i] for i in _path(j)])
        assert same(scores[j], alone[-1]), j
    runner.set_length(2, start)
    assert all(same(a, b) for a, b in zip(scores[len(TREE_TOKENS) :], _steps(runner, 2, chain)))  # the chain row

    accepted = [4, 6]  # 90, 92
    runner.keep_path(0, start, [0, *accepted])
    runner.set_length(0, start + 1 + len(accepted))
    runner.set_length(2, start)
    _steps(runner, 2, [TREE_TOKENS[i] for i in [0, *accepted]])
    for layer in runner.cache.layers:
        for name in ("keys", "values"):
            tensor = getattr(layer, name)
            assert same(tensor[0, :, : start + 3], tensor[2, :, : start + 3]), name
    assert same(_steps(runner, 0, [7])[0], _steps(runner, 2, [7])[0])


def test_a_tree_grown_a_depth_a_pass_is_attended_by_mask_as_its_branches():
    """A draft model grows its tree over passes: two candidates after the cache, then a token under each. Each token
    scores as its own branch, and the branch kept is what steps along it leave. Position by position (as a CPU's
    verify pass attends) a tree is read in one pass: the runner attends one grown over passes by mask."""
    model = tiny_llama(max_positions=1024)
    surgery_for(model, "float32", exact=True)
    runner = ModelRunner(model, max_rows=2, max_context=1024)
    runner.per_position = False
    for row in range(2):
        runner.prefill(row, PROMPT[:100])
    first = runner.score(0, [[30, 31]], trees=[(-1, -1)]).logits().clone()  # two candidates, each its own branch
    second = runner.score(0, [[50, 51]], trees=[(-1, -1, 0, 1)]).logits().clone()  # 50 under 30, 51 under 31
    close = lambda a, b: torch.allclose(a, b, atol=1e-5)  # noqa: E731
    for i, branch in enumerate(([30, 50], [31, 51])):
        runner.set_length(1, 100)
        alone = _steps(runner, 1, branch)
        assert close(first[i], alone[0]) and close(second[i], alone[1]), branch
    runner.keep_path(0, 100, [1, 3])  # 31, 51
    runner.set_length(0, 102)
    assert close(_steps(runner, 0, [9])[0], _steps(runner, 1, [9])[0])  # row 1 ran [31, 51] last
    runner.per_position = True
    runner.set_length(0, 100)
    runner.score(0, [[30, 31]], trees=[(-1, -1)])
    assert close(runner.score(0, [[50, 51]], trees=[(-1, -1, 0, 1)]).logits(), second)
    layout = runner.cache.begin(0, [2], runner.device, per_position=True, ancestry=[(-1, -1, 0, 1)])
    with pytest.raises(ValueError, match="read in one pass"):  # the attention refuses what the runner never asks
        cache = runner.cache.layers[0]
        rows_attention(None, torch.zeros(1, 4, 2, 16), cache.keys, cache.values, None, depctl_rows=layout)
