"""SlotCache: rows indexed by position, ragged forwards, rollback by bookkeeping, sliding-window models."""

from __future__ import annotations

import pytest
import torch

from depctl_runtime.model.runner import ModelRunner
from depctl_runtime.speculation import (
    EngineConfig,
    GenerationParams,
    NgramProposer,
    Scheduler,
    SpeculativeEngine,
    generate,
)
from tests.tiny import tiny_gemma3, tiny_llama, tiny_qwen2_sliding


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def test_a_ragged_forward_equals_each_row_alone():
    model = tiny_llama(0)
    rows = ModelRunner(model, max_rows=3, max_context=128)
    alone = ModelRunner(model, max_rows=1, max_context=128)
    prompts, news = [[1, 2, 3, 4, 5], [9, 8], [7] * 11], [[6, 7, 8], [7], [1, 2]]
    for b, p in enumerate(prompts):
        rows.forward(b, [p])
    batched = rows.forward(0, news)  # [6, vocab]: one flat stream, 3 + 1 + 2 tokens, no padding
    assert batched.shape[0] == 6
    at = 0
    for b, (p, new) in enumerate(zip(prompts, news)):
        alone.set_length(0, 0)
        alone.forward(0, [p])
        solo = alone.forward(0, [new])
        torch.testing.assert_close(batched[at : at + len(new)], solo, rtol=1e-5, atol=1e-5)
        at += len(new)
    assert rows.cache.lengths[:3] == [8, 3, 13]


def test_rollback_is_bookkeeping_and_rejected_positions_are_overwritten():
    model = tiny_llama(0)
    runner = ModelRunner(model, max_rows=1, max_context=128)
    runner.forward(0, [[1, 2, 3, 4]])
    runner.forward(0, [[50, 60, 70]])  # three drafts...
    runner.set_length(0, 5)  # ...of which the first was accepted: 60, 70 stay in memory, unseen
    after = runner.forward(0, [[99]])[-1]
    reference = ModelRunner(model, max_rows=1, max_context=128)
    expected = reference.forward(0, [[1, 2, 3, 4, 50, 99]])[-1]
    torch.testing.assert_close(after, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="cannot extend"):
        runner.set_length(0, 100)


def test_rows_grow_on_demand_and_move():
    model = tiny_llama(0)
    runner = ModelRunner(model, max_rows=2, max_context=1000)
    assert runner.cache.capacity == 256  # not max_context x rows up front
    runner.forward(0, [list(range(200))])
    runner.forward(1, [[5, 6, 7]])
    runner.forward(0, [list(range(100))])  # row 0 needs 300 positions: every row doubles, contents kept
    assert runner.cache.capacity == 512
    runner.move_row(0, 1)
    assert runner.cache.lengths[:2] == [0, 300]
    moved = runner.forward(1, [[3]])[-1]
    fresh = ModelRunner(model, max_rows=1, max_context=1000)
    fresh.forward(0, [list(range(200)) + list(range(100))])
    torch.testing.assert_close(moved, fresh.forward(0, [[3]])[-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_sliding_window_models_decode_past_the_window_exactly(family):
    # DynamicCache.crop raises on a full sliding-window layer; a position-indexed row never crops, only its mask
    # changes, so speculation (and its rollbacks) works on these models too
    model = tiny_qwen2_sliding() if family == "qwen2" else tiny_gemma3()
    prompt = [5, 17, 42, 99, 3, 17, 42, 99, 3, 8, 17, 42]  # longer than the window, with repeats for the n-gram
    expected = hf_greedy(model, prompt, 24)
    # logits, not just argmax: a long sequence fed in three ragged pieces sees only the window on sliding layers
    long = list(range(40, 70))
    with torch.no_grad():
        reference = model(torch.tensor([long])).logits[0]  # [30, vocab], transformers' own sliding mask
    runner = ModelRunner(model, max_context=128)
    ours = torch.cat([runner.forward(0, [long[:11]]), runner.forward(0, [long[11:12]]), runner.forward(0, [long[12:]])])
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)
    params = GenerationParams(max_tokens=24, ignore_eos=True)
    plain = SpeculativeEngine(ModelRunner(model, max_context=128), None, EngineConfig(max_context=128))
    assert [t for o in generate(plain, prompt, params) for t in o.token_ids] == expected
    engine = SpeculativeEngine(
        ModelRunner(model, max_rows=3, max_context=128),
        NgramProposer(2),
        EngineConfig(num_draft_tokens=4, max_context=128, adaptive=False),
    )
    got = Scheduler(engine, 3, prefill_chunk=5).run_all([prompt, prompt[:3], prompt[2:]], params)
    assert got[0] == expected
    assert got[1] == hf_greedy(model, prompt[:3], 24)
    assert engine.stats.num_draft_tokens > 0
