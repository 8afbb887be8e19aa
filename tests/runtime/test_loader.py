"""The loader's checks that run before any weights are loaded."""

from __future__ import annotations

import pytest
import torch

from depctl.spec import DeploymentSpec
from runtime import loader
from runtime.loader import LoadError, check_memory, estimate_bytes, load_deployment


def test_estimate_counts_weights_and_kv_cache(tiny_model_dir):
    weights = sum(p.stat().st_size for p in tiny_model_dir.glob("*.safetensors"))
    small = estimate_bytes(str(tiny_model_dir), torch.float32, context=1)
    large = estimate_bytes(str(tiny_model_dir), torch.float32, context=1001)
    # tiny llama: 2 layers x 2 kv heads x head_dim 16 x (k and v) x 4 bytes = 512 bytes per position
    assert large - small == 1000 * 2 * 2 * 2 * 16 * 4
    assert small >= weights
    assert estimate_bytes(str(tiny_model_dir), torch.bfloat16, context=1) < small  # rescaled to the dtype


def test_too_big_fails_with_the_numbers(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(loader, "free_bytes", lambda device: 1000)
    with pytest.raises(LoadError, match=r"not enough memory on cpu: need about .* GiB .* but 0.00 GiB is free"):
        check_memory([("target", 5 * 2**30)], torch.device("cpu"))
    spec = DeploymentSpec(id="big", model=str(tiny_model_dir))
    with pytest.raises(LoadError, match="not enough memory"):
        load_deployment(spec)


def test_unknown_free_memory_does_not_block(monkeypatch):
    monkeypatch.setattr(loader, "free_bytes", lambda device: None)
    check_memory([("target", 10**15)], torch.device("cpu"))


def test_draft_precision_resolution():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # a device object only: nothing is allocated
    assert loader.pick_draft_precision("auto", cpu, torch.float32) == "int8"
    assert loader.pick_draft_precision("auto", cuda, torch.bfloat16) == "bfloat16"
    assert loader.pick_draft_precision("float32", cpu, torch.float32) == "float32"
    with pytest.raises(LoadError, match="--draft-precision int8 runs on a CPU only.*--draft-precision auto"):
        loader.pick_draft_precision("int8", cuda, torch.bfloat16)


def test_int8_draft_loads_quantized(tiny_model_dir, tiny_draft_dir):
    from depctl.spec import DraftModelSpeculation

    spec = DeploymentSpec(id="q", model=str(tiny_model_dir), device="cpu",
                          speculation=DraftModelSpeculation(draft_model=str(tiny_draft_dir), num_draft_tokens=3))
    loaded = load_deployment(spec, calibrate=False)
    assert loaded.draft.precision == "int8"
    linears = [type(m).__module__ for m in loaded.draft.model.modules() if "Linear" in type(m).__name__]
    assert linears and all("quantized" in m for m in linears), linears
    assert loaded.target.precision == str(loader.pick_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    assert not any("quantized" in type(m).__module__ for m in loaded.target.model.modules())


def test_int8_target_loads_weight_only_int8_in_bf16(tiny_model_dir):
    from runtime.engine.surgery import Int8WeightLinear

    spec = DeploymentSpec(id="w8", model=str(tiny_model_dir), device="cpu", quantization="int8")
    loaded = load_deployment(spec, calibrate=False)
    assert loaded.target.precision == loader.INT8_WEIGHTS and loaded.target.dtype == torch.bfloat16
    linears = [m for m in loaded.target.model.modules() if isinstance(m, (torch.nn.Linear, Int8WeightLinear))]
    assert linears and all(isinstance(m, Int8WeightLinear) for m in linears)  # the output layer included
    assert loaded.engine.target.per_position  # bf16 activations: verify passes attend position by position


def test_int8_target_is_refused_on_cuda_with_what_to_change():
    with pytest.raises(LoadError, match="--quantization int8 runs on a CPU.*--device cpu, or --quantization none"):
        loader.pick_dtype("auto", torch.device("cuda"), "int8")
    assert loader.pick_dtype("auto", torch.device("cpu"), "int8") == torch.bfloat16
