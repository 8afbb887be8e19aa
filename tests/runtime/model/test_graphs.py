"""Fixed-shape passes and their CUDA graphs (depctl_runtime.model.graphs).

The padded pass is device-independent, so its bookkeeping (the grid, the scratch row, the mask, what falls back to
the eager pass) is tested on any machine with ``capture=False``; recording and replaying need a GPU and skip, with the
reason, without one."""

from __future__ import annotations

import pytest
import torch

from depctl_runtime.model import compiled
from depctl_runtime.model.decoder import fuse_projections
from depctl_runtime.model.graphs import FixedShapePass
from depctl_runtime.model.runner import ModelRunner
from depctl_runtime.speculation import (
    DraftModelProposer,
    EngineConfig,
    GenerationParams,
    NgramProposer,
    Scheduler,
    SpeculativeEngine,
    generate,
)
from tests.tiny import tiny_llama

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: recording CUDA graphs needs one")
PROMPTS = [[5, 17, 42, 99, 3, 17, 42, 99, 3, 8], [1, 2, 3], [200, 201, 200, 201, 200], list(range(30, 70))]


def fused(seed: int = 0, layers: int = 2, device: str = "cpu", dtype=torch.float32):
    model = tiny_llama(seed, layers=layers).to(device, dtype)
    fuse_projections(model)
    return model


def runner(model, rows: int = 4, width: int | None = 5, capture: bool = False) -> ModelRunner:
    """A runner as the loader leaves it: the cache allocated, and (with ``width``) every decode and verify pass at
    ``rows x width`` tokens."""
    r = ModelRunner(model, max_rows=rows)
    r.forward(0, [[0]], prefill=True)
    r.set_length(0, 0)
    if width:
        r.fast_pass = FixedShapePass(model, r.cache, rows, (width,), capture=capture)
    return r


def test_the_fixed_shape_pass_computes_what_the_eager_pass_computes():
    model = fused()
    eager, fixed = runner(model, width=None), runner(model)
    for r in (eager, fixed):
        r.forward(0, [PROMPTS[0]], prefill=True)
        r.forward(1, [PROMPTS[1]], prefill=True)
        r.forward(2, [PROMPTS[3]], prefill=True)
    ragged = [[4, 8, 15], [6], [7, 7, 7, 7, 7]]  # 3 of 4 grid rows, widths 3, 1, 5 of 5
    a, b = eager.forward(0, ragged), fixed.forward(0, ragged)
    assert b.shape == a.shape == (9, model.config.vocab_size)
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)  # the padded grid's SDPA rounds its own way
    last = fixed.forward(0, [[1], [2, 3], [4]], last_only=True)  # each row's last token only
    torch.testing.assert_close(last, eager.forward(0, [[1], [2, 3], [4]], last_only=True), rtol=1e-4, atol=1e-4)
    assert [fixed.length(r) for r in range(3)] == [eager.length(r) for r in range(3)] == [14, 6, 46]


def test_the_fixed_shape_pass_takes_attention_output_of_any_layout(monkeypatch):
    """CUDA's memory-efficient kernel (float32) returns its output with the heads and tokens swapped in memory; the
    pass must not assume the contiguous layout the CPU's kernel gives."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def strided(*args, **kwargs):
        out = sdpa(*args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, [b, t, h, d] in memory

    model = fused()
    eager, fixed = runner(model, width=None), runner(model)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", strided)
    for r in (eager, fixed):
        r.forward(0, [PROMPTS[0]], prefill=True)
    torch.testing.assert_close(fixed.forward(0, [[4, 8, 15]]), eager.forward(0, [[4, 8, 15]]), rtol=1e-4, atol=1e-4)


def test_the_fixed_shape_pass_returns_the_layer_features_of_the_real_tokens():
    # an EAGLE head drafts from them: the padded grid's features are dropped, the stream's kept in order
    model = fused()
    eager = ModelRunner(model, max_rows=4, features=(0, 1, 1))
    eager.forward(0, [[0]], prefill=True)
    eager.set_length(0, 0)
    fixed = eager.with_pass(FixedShapePass(model, eager.cache, 4, (5,), capture=False, features=(0, 1, 1)))
    for row, prompt in enumerate(PROMPTS[:3]):
        fixed.forward(row, [prompt], prefill=True)
    ragged = [[4, 8, 15], [6], [7, 7, 7, 7, 7]]
    got = fixed.score(0, ragged).features  # [9, 3 * hidden]
    for row, prompt in enumerate(PROMPTS[:3]):
        fixed.set_length(row, len(prompt))
    expected = eager.score(0, ragged).features
    assert got.shape == expected.shape == (9, 3 * model.config.hidden_size)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_padding_writes_only_to_the_scratch_row():
    model = fused()
    fixed = runner(model)
    cache = fixed.cache
    assert cache.scratch == 4 and cache.layers[0].keys.shape[0] == 5  # one row past the four sequences' rows
    fixed.forward(3, [PROMPTS[3]], prefill=True)  # a row this step leaves out
    before = [(layer.keys[:4].clone(), layer.values[:4].clone()) for layer in cache.layers]
    fixed.set_length(0, 0)
    fixed.forward(0, [[9, 9]])  # row 0: 2 real tokens; 18 padding tokens, 3 padding grid rows
    for layer, (keys, values) in zip(cache.layers, before):
        assert torch.equal(layer.keys[1:4], keys[1:4]) and torch.equal(layer.values[1:4], values[1:4])
        assert torch.equal(layer.keys[0, :, 2:], keys[0, :, 2:])  # row 0 changed where its tokens went, only
        assert not torch.equal(layer.keys[0, :, :2], keys[0, :, :2])


def test_passes_that_do_not_fit_run_eagerly():
    model = fused()
    eager, fixed = runner(model, width=None), runner(model, width=3)
    assert fixed.fast_pass.fits(0, [3, 1]) and not fixed.fast_pass.fits(0, [4]) and not fixed.fast_pass.fits(1, [1])
    for r in (eager, fixed):
        r.forward(0, [PROMPTS[0]], prefill=True)
    # wider than the grid: the eager pass, bit for bit
    assert torch.equal(fixed.forward(0, [[1, 2, 3, 4]]), eager.forward(0, [[1, 2, 3, 4]]))


def test_a_verify_pass_equals_one_token_steps_through_the_fixed_shape():
    fixed = runner(fused())
    assert compiled.check(fixed)  # what the loader requires before a GPU deployment uses its graphs


def assert_speculation_equals_plain_decoding(method: str, device: str, dtype, capture: bool) -> None:
    """Four prompts batched with 4 drafts a row equal each prompt decoded plainly, alone, through the same shape."""
    target, draft = fused(0, device=device, dtype=dtype), fused(1, layers=1, device=device, dtype=dtype)
    params = GenerationParams(max_tokens=40, ignore_eos=True)

    def engine(k: int):
        proposer = None
        if k and method == "ngram":
            proposer = NgramProposer(2)
        elif k:
            proposer = DraftModelProposer(runner(draft, 4, width=2, capture=capture))
        return SpeculativeEngine(
            runner(target, 4, width=5, capture=capture), proposer, EngineConfig(num_draft_tokens=k, adaptive=False)
        )

    plain = [[t for o in generate(engine(0), p, params) for t in o.token_ids] for p in PROMPTS]
    assert Scheduler(engine(4), 4, prefill_chunk=8).run_all(PROMPTS, params) == plain


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_through_fixed_shapes_equals_plain_decoding_through_them(method):
    assert_speculation_equals_plain_decoding(method, "cpu", torch.float32, capture=False)


def test_a_new_draft_width_resizes_the_grid():
    engine = SpeculativeEngine(runner(fused(), width=5), NgramProposer(2), EngineConfig(num_draft_tokens=4))
    engine.set_num_draft_tokens(8)
    assert engine.target.fast_pass.widths == (9,)


@pytest.mark.gpu
@cuda
def test_a_replayed_graph_computes_what_the_pass_computes():
    model = fused(device="cuda", dtype=torch.bfloat16)
    eager, graphed = runner(model, capture=False), runner(model, capture=True)
    for r in (eager, graphed):
        r.forward(0, [PROMPTS[0]], prefill=True)
        r.forward(1, [PROMPTS[1]], prefill=True)
    for inputs in ([[4, 8, 15], [6]], [[1], [2]], [[3, 3, 3, 3, 3], [9]]):
        assert torch.equal(graphed.forward(0, inputs), eager.forward(0, inputs))
    assert graphed.fast_pass.recordings == 1  # one shape: recorded once, replayed since


def grow_the_cache(device: str, dtype, capture: bool) -> ModelRunner:
    """A prompt longer than the cache (it doubles: new tensors) through a fixed-shape pass, then a pass after it: the
    logits a pass that was never recorded gives (bit for bit: the same padded pass, unrecorded), or the eager pass's
    (which rounds its own way), not a stale cache's."""
    model = fused(device=device, dtype=dtype)
    fixed = runner(model, capture=capture)
    reference = runner(model, capture=False) if capture else runner(model, width=None)
    longer = [i % model.config.vocab_size for i in range(fixed.cache.capacity + 10)]
    for r in (fixed, reference):
        r.forward(0, [[1]])
        r.forward(0, [longer], prefill=True)
    got, want = fixed.forward(0, [[7, 8]]), reference.forward(0, [[7, 8]])
    if capture:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    return fixed


# the padded pass anywhere, and its CUDA graphs, recorded again each time the cache's tensors are new
PASSES = [
    pytest.param("cpu", torch.float32, False, id="cpu"),
    pytest.param("cuda", torch.bfloat16, True, id="cuda-graphs", marks=[pytest.mark.gpu, cuda]),
]


@pytest.mark.parametrize("device, dtype, capture", PASSES)
def test_a_fixed_shape_pass_follows_the_cache_when_it_grows(device, dtype, capture):
    assert grow_the_cache(device, dtype, capture).fast_pass.recordings == (2 if capture else 0)


def decode_past_two_growths(device: str, dtype, capture: bool) -> ModelRunner:
    """Five-token steps across 256 and 512 positions, where the cache doubles (256 -> 512 -> 1024), a prompt's worth
    of positions between: each step's logits those of the same pass never recorded, bit for bit."""
    model = tiny_llama(0, max_positions=1024).to(device, dtype)
    fuse_projections(model)
    fixed, reference = runner(model, capture=capture), runner(model, capture=False)
    for filled in (250, 245):  # to 250, then from 260 to 505
        for r in (fixed, reference):
            r.forward(0, [[i % 200 for i in range(filled)]], prefill=True)
        for _ in range(2):
            step = [[7, 8, 9, 10, 11]]
            assert torch.equal(fixed.forward(0, step), reference.forward(0, step))
    assert fixed.cache.capacity == reference.cache.capacity == 1024
    return fixed


@pytest.mark.parametrize("device, dtype, capture", PASSES)
def test_a_fixed_shape_pass_follows_the_cache_as_it_grows_twice_while_decoding(device, dtype, capture):
    # with graphs, the third recording went into the pool of graphs already dropped, which PyTorch's allocator
    # refuses while the pool still caches their blocks (an INTERNAL ASSERT in create_or_incref_pool)
    assert decode_past_two_growths(device, dtype, capture).fast_pass.recordings == (3 if capture else 0)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_through_cuda_graphs_equals_plain_decoding_through_them(method):
    assert_speculation_equals_plain_decoding(method, "cuda", torch.bfloat16, capture=True)
