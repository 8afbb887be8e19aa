"""A model's weights: the memory estimate, damaged cached copies, and pickles never read."""

from __future__ import annotations

import pytest
import torch

from depctl_runtime.backends import weights
from depctl_runtime.backends.weights import LoadError, estimate_bytes


def test_estimate_counts_weights_and_kv_cache(tiny_model_dir):
    weights = sum(p.stat().st_size for p in tiny_model_dir.glob("*.safetensors"))
    small = estimate_bytes(str(tiny_model_dir), torch.float32, context=1)
    large = estimate_bytes(str(tiny_model_dir), torch.float32, context=1001)
    # tiny llama: 2 layers x 2 kv heads x head_dim 16 x (k and v) x 4 bytes = 512 bytes per position
    assert large - small == 1000 * 2 * 2 * 2 * 16 * 4
    assert small >= weights
    assert estimate_bytes(str(tiny_model_dir), torch.bfloat16, context=1) < small  # rescaled to the dtype


def test_a_damaged_cached_model_says_how_to_fetch_it_again(tiny_model_dir, tmp_path, monkeypatch):
    """`deployment update` cannot mend a cached copy cut short; the message names the command that can."""
    import shutil

    from depctl import models

    monkeypatch.setenv("DEPCTL_CACHE", str(tmp_path))
    cached = models.models_cache() / "smollm2-135m-instruct"
    shutil.copytree(tiny_model_dir, cached)
    (cached / models.DONE_MARKER).write_text("{}")
    stored = cached / "model.safetensors"
    stored.write_bytes(stored.read_bytes()[:1000])
    with pytest.raises(LoadError) as err:
        weights.load_model("smollm2-135m-instruct", "MODEL", torch.device("cpu"), torch.float32)
    assert "depctl model pull smollm2-135m-instruct --force" in str(err.value)


def test_pickled_weights_are_never_read(tiny_model_dir, tmp_path):
    """A model directory whose only weights are a pickle (which runs code when loaded) is refused, naming why."""
    import shutil

    from tests.pickles import plant

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "model.safetensors").unlink()
    marker = tmp_path / "ran"
    plant(model / "pytorch_model.bin", marker)
    with pytest.raises(LoadError) as err:
        weights.load_model(str(model), "MODEL", torch.device("cpu"), torch.float32)
    assert "never reads pickled" in str(err.value) and not marker.exists()
