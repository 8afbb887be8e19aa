"""A float32 target's output layer screened in bf16 (runtime/model/screened_head.py, depctl_native::screened_argmax):
it finds the float32 winner where bf16 alone picks another, chooses a token alike whatever else is in the pass, keeps
speculation exact, and spares greedy steps the full product."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from depctl_runtime.backends.precision import cpu_has_bf16, surgery_for
from depctl_runtime.kernels import native
from depctl_runtime.model.runner import ModelRunner
from depctl_runtime.model.screened_head import ScreenedHead, screen_output_layer
from depctl_runtime.speculation import EngineConfig, GenerationParams, NgramProposer, SpeculativeEngine
from depctl_runtime.speculation.params import SamplingParams
from tests.driving import assert_speculation_is_exact
from tests.tiny import tiny_llama, tiny_qwen2

# The loader screens wherever the CPU has bf16 instructions, so these run there. (They asked for a row-invariant oneDNN
# bf16 linear too, and so skipped on a Xeon with AMX where the loader does screen: the choice never depended on it. The
# bf16 logits only pick the candidates; the bound holds for any float32 accumulation of bf16 products, so the float32
# winner is always among them, and it is recomputed by one routine for every token.)
pytestmark = pytest.mark.skipif(not cpu_has_bf16(), reason="the screen is for CPUs with bf16 dot products")


@pytest.fixture(scope="module", autouse=True)
def ops():
    try:
        native.load()
    except native.NativeUnavailable as e:  # the loader then keeps the full product (no compiled passes either)
        pytest.skip(f"depctl's C++ ops cannot be built here: {e}")


def near_ties(tokens=64, vocab=3000, dim=128, contenders=10, seed=0):
    """Hidden states and an output layer where, for every token, ``contenders`` rows have logits near zero and within
    ~1e-2 of each other, from weights of norm ~3 orthogonal to the hidden states (norm 30): rounding either to bf16
    moves such a logit by ~1e-2, float32 rounding by ~1e-6. Every other row's logit is near -9."""
    g = torch.Generator().manual_seed(seed)
    direction = torch.randn(dim, generator=g)
    direction /= direction.norm()
    hidden = direction * 30 + torch.randn(tokens, dim, generator=g) * 0.003
    weight = -0.3 * direction + torch.randn(vocab, dim, generator=g) * 0.02
    big = torch.randn(contenders, dim, generator=g) * 0.3
    big -= (big @ direction)[:, None] * direction
    weight[torch.randperm(vocab, generator=g)[:contenders]] = big + torch.randn(contenders, dim, generator=g) * 3e-4
    return hidden, weight


def screened(weight: torch.Tensor) -> ScreenedHead:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    head = ScreenedHead(linear, weight)
    head.screen()
    return head


def test_the_screen_finds_the_float32_winner_where_bf16_picks_another():
    hidden, weight = near_ties()
    head = screened(weight)
    choice, candidates = head.argmax(hidden)
    exact = hidden.double() @ weight.double().T  # [T, vocab] float64
    top2 = exact.topk(2, dim=-1)
    # tokens whose top two are further apart than float32 dot products can err (2 K u sum |h w|, K = 128)
    clear = (top2.values[:, 0] - top2.values[:, 1]) > 2 * 128 * 2**-24 * (hidden.abs() @ weight.abs().T).max(-1).values
    assert clear.sum() > 40
    assert torch.equal(choice[clear], top2.indices[clear, 0])
    # the data is hard: bf16's own argmax is wrong for most tokens (62%), and the screen kept the contenders
    bf16 = (hidden.to(torch.bfloat16) @ weight.to(torch.bfloat16).T).argmax(-1)
    assert (bf16 != top2.indices[:, 0]).float().mean() > 0.5
    assert candidates.min() > 1 and candidates.max() < 50


def test_a_token_chooses_alike_alone_and_beside_others():
    hidden, weight = near_ties(tokens=24)
    head = screened(weight)
    together = head.argmax(hidden)[0]
    assert torch.equal(torch.cat([head.argmax(hidden[i : i + 1])[0] for i in range(24)]), together)
    assert torch.equal(head.argmax(hidden[5:17])[0], together[5:17])


def test_a_random_layer_keeps_a_handful_of_candidates_and_agrees_with_float64():
    g = torch.Generator().manual_seed(1)
    weight, hidden = torch.randn(4000, 64, generator=g) * 0.3, torch.randn(50, 64, generator=g) * 5
    choice, candidates = screened(weight).argmax(hidden)
    assert torch.equal(choice, (hidden.double() @ weight.double().T).argmax(-1))
    assert candidates.float().median() <= 3


def test_a_non_finite_hidden_state_skips_the_screen():
    hidden, weight = near_ties(tokens=3)
    hidden[1, 0] = float("nan")
    choice, candidates = screened(weight).argmax(hidden)
    assert candidates[1] == weight.shape[0]  # every token computed in float32 (all NaN: the first wins)
    assert choice[1] == 0
    assert candidates[0] < weight.shape[0] and candidates[2] < weight.shape[0]


def test_the_loader_screens_a_tied_float32_target_only():
    assert isinstance(surgery_for(tiny_qwen2(), "float32", exact=True).lm_head, ScreenedHead)
    assert not isinstance(surgery_for(tiny_qwen2(), "float32", exact=False).lm_head, ScreenedHead)  # a draft
    untied = tiny_llama()
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    assert not screen_output_layer(untied)


def screened_runner(rows: int = 3) -> tuple[ModelRunner, ScreenedHead]:
    model = surgery_for(tiny_qwen2(), "float32", exact=True)
    runner = ModelRunner(model, max_rows=rows)
    model.lm_head.screen()
    return runner, model.lm_head


def test_speculation_through_the_screen_is_exact_against_plain_decoding():
    runner, head = screened_runner()
    assert_speculation_is_exact(runner)


def test_a_greedy_step_never_computes_the_full_layer_and_a_sampling_row_computes_its_own(monkeypatch):
    runner, head = screened_runner()
    engine = SpeculativeEngine(runner, NgramProposer(2), EngineConfig(num_draft_tokens=3, adaptive=False))
    rows_computed = []
    full = head.full.forward
    monkeypatch.setattr(head.full, "forward", lambda x: rows_computed.append(x.shape[0]) or full(x))
    greedy = engine.new_sequence([1, 2, 3, 1, 2, 3, 1, 2], GenerationParams(max_tokens=8))
    sampled = engine.new_sequence(
        [5, 6, 7, 5, 6, 7, 5], GenerationParams(max_tokens=8, sampling=SamplingParams(temperature=0.8, seed=7))
    )
    batch = []
    for row, seq in enumerate((greedy, sampled)):
        seq.row = row
        while engine.prefill(seq, 64) is None:
            pass
        batch.append(seq)
    rows_computed.clear()  # a prompt's first token comes from the full product, as before
    engine.step(batch[:1])
    assert rows_computed == []  # greedy alone: the screen only
    engine.step(batch)
    assert len(rows_computed) == 1 and rows_computed[0] <= 1 + 3  # the sampling row's k + 1 tokens, no more
