"""Our own Llama-family forward (depctl_runtime.model.decoder): fused projections, the same model."""

from __future__ import annotations

import copy

import pytest
import torch

from depctl_runtime.model.decoder import FusedAttention, FusedMLP, fuse_projections, is_fused, supports
from depctl_runtime.model.runner import ModelRunner
from depctl_runtime.speculation import (
    EngineConfig,
    GenerationParams,
    NgramProposer,
    Scheduler,
    SpeculativeEngine,
    generate,
)
from tests.tiny import tiny_gemma3, tiny_llama, tiny_qwen2, tiny_qwen2_sliding


def _passes(runner: ModelRunner) -> list[torch.Tensor]:
    """Prefills of two rows, a uniform two-row verify, a ragged pass, a last-token-only pass."""
    out = [runner.forward(0, [[1, 2, 3, 4, 5, 6, 7]]), runner.forward(1, [[9, 8, 7]])]
    out.append(runner.forward(0, [[3, 4], [5, 6]]))
    out.append(runner.forward(0, [[7], [8, 9, 10]]))
    out.append(runner.forward(0, [[11, 12], [13]], last_only=True))
    return out


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
def test_fused_model_computes_what_transformers_computes(make):
    model = make()
    fused = copy.deepcopy(model)
    assert supports(model) and fuse_projections(fused) == 2 and is_fused(fused)
    assert all(
        isinstance(layer.self_attn, FusedAttention) and isinstance(layer.mlp, FusedMLP) for layer in fused.model.layers
    )
    plain, ours = ModelRunner(model, max_rows=2), ModelRunner(fused, max_rows=2)
    assert ours.fused and not plain.fused
    for a, b in zip(_passes(plain), _passes(ours)):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    # transformers' own forward still runs on the fused object (model.generate: a benchmark's reference)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    assert torch.equal(
        model.generate(ids, max_new_tokens=8, do_sample=False), fused.generate(ids, max_new_tokens=8, do_sample=False)
    )


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_fused_attention_takes_the_cache_under_either_name(name):
    """transformers 5.24 passes a layer's cache as ``cache``, earlier 5.x as ``past_key_values``: both must reach it
    (a cache the layer does not see makes model.generate on a fused model decode without context)."""
    from transformers import DynamicCache

    model = tiny_llama()
    fuse_projections(model)
    attn, inner = model.model.layers[0].self_attn, model.model
    x = torch.randn(1, 3, model.config.hidden_size)
    position_embeddings = inner.rotary_emb(x, torch.arange(3)[None])
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        attn(x, position_embeddings, None, **{name: cache})
    assert cache.get_seq_length(0) == 3


def test_fusion_drops_the_separate_projections():
    model = tiny_llama()
    before = sum(p.numel() for p in model.parameters())
    fuse_projections(model)
    assert sum(p.numel() for p in model.parameters()) == before  # concatenated, not duplicated
    attn = model.model.layers[0].self_attn
    assert not hasattr(attn, "q_proj") and attn.qkv_proj.out_features == (4 + 2 * 2) * 16
    assert fuse_projections(model) == 0  # already fused


@pytest.mark.parametrize("make", [tiny_qwen2_sliding, tiny_gemma3], ids=["qwen2-sliding", "gemma3"])
def test_other_architectures_keep_transformers_forward(make):
    model = make()
    assert not supports(model) and fuse_projections(model) == 0 and not ModelRunner(model).fused


def test_speculation_over_the_fused_forward_is_exact_alone_and_batched():
    model = tiny_llama()
    fuse_projections(model)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 8, 5, 6, 7], [40, 41, 42, 43, 44]]

    def engine(proposer, k=0):
        return SpeculativeEngine(
            ModelRunner(model, max_rows=3), proposer, EngineConfig(num_draft_tokens=k, adaptive=False)
        )

    params = GenerationParams(max_tokens=24)
    plain = [[t for o in generate(engine(None), p, params) for t in o.token_ids] for p in prompts]
    spec = engine(NgramProposer(2), 4)
    assert [[t for o in generate(spec, p, params) for t in o.token_ids] for p in prompts] == plain
    assert spec.stats.num_draft_tokens > 0
    assert Scheduler(engine(NgramProposer(2), 4), max_batch_size=3).run_all(prompts, params) == plain


def test_the_loader_fuses_before_the_precision_surgery(tiny_model_dir):
    from depctl.spec import DeploymentSpec
    from depctl_runtime.backends.loader import load_deployment
    from depctl_runtime.kernels.quantized import QuantizedLinear

    loaded = load_deployment(
        DeploymentSpec(id="f", model=str(tiny_model_dir), device="cpu", quantization="int8"), calibrate=False
    )
    layer = loaded.target.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantizedLinear) and isinstance(layer.mlp.gate_up_proj, QuantizedLinear)
    assert loaded.engine.target.fused


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_pass_stopped_within_layers_has_the_bits_of_one_pass(dtype):
    model = tiny_llama(3, layers=3).to(dtype)
    fuse_projections(model)
    whole, split = ModelRunner(model, max_rows=2), ModelRunner(copy.deepcopy(model), max_rows=2)
    for runner in (whole, split):
        runner.prefill(0, list(range(10, 30)))
        runner.forward(1, [[5, 6, 7]])
    logits, _ = whole.prefill(0, list(range(40, 72)))
    chunk = split.begin_prefill(0, list(range(40, 72)))
    runs = 0
    while not chunk.run(more=lambda: False):  # half a layer a call, other rows' passes in between
        split.forward(1, [[8 + runs]])
        runs += 1
    assert runs == 2 * len(model.model.layers) - 1
    assert torch.equal(chunk.result()[0], logits)
    assert whole.length(0) == split.length(0) == 52
    for a, b in zip(whole.cache.layers, split.cache.layers):
        assert torch.equal(a.keys[0, :, :52], b.keys[0, :, :52]) and torch.equal(
            a.values[0, :, :52], b.values[0, :, :52]
        )
