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
