"""The loader's checks that run before any weights are loaded: a deployment too big for free memory is refused with
the numbers, and one whose fit cannot be measured still loads."""

from __future__ import annotations

import pytest
import torch

from depctl.spec import DeploymentSpec
from depctl_runtime.backends import loader, weights
from depctl_runtime.backends.loader import load_deployment
from depctl_runtime.backends.weights import LoadError, check_memory


def test_too_big_fails_with_the_numbers(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(weights, "free_bytes", lambda device: 1000)
    with pytest.raises(LoadError, match=r"not enough memory on cpu: need about .* GiB .* but 0.00 GiB is free"):
        check_memory([("target", 5 * 2**30)], torch.device("cpu"))
    spec = DeploymentSpec(id="big", model=str(tiny_model_dir))
    with pytest.raises(LoadError, match="not enough memory"):
        load_deployment(spec)


def test_unknown_free_memory_does_not_block(tiny_model_dir, monkeypatch):
    # a platform where free memory cannot be read (no /proc/meminfo) loads whatever the estimate says...
    monkeypatch.setattr(loader, "estimate_bytes", lambda *a, **kw: 10**15)
    spec = DeploymentSpec(id="unknown", model=str(tiny_model_dir), compile=False)
    monkeypatch.setattr(weights, "free_bytes", lambda device: None)
    loaded = load_deployment(spec, calibrate=False)
    assert len(run_plain(loaded, [1, 2, 3], 3)) == 3
    # ... where the same estimate against known free memory is refused before any weight is read
    monkeypatch.setattr(weights, "free_bytes", lambda device: 64 * 2**30)
    monkeypatch.setattr(loader, "load_model", lambda *a, **kw: pytest.fail("loaded weights it had no room for"))
    with pytest.raises(LoadError, match="not enough memory on cpu"):
        load_deployment(spec, calibrate=False)


def run_plain(loaded, prompt: list[int], max_tokens: int) -> list[int]:
    from depctl_runtime.speculation import GenerationParams, generate

    params = GenerationParams(max_tokens=max_tokens, ignore_eos=True)
    return [t for out in generate(loaded.engine, prompt, params) for t in out.token_ids]


def test_a_load_that_builds_the_cpp_ops_says_so_first(tiny_model_dir, monkeypatch):
    """A machine's first load builds depctl's C++ ops (about a minute on 2 cores): the stage names that wait, instead
    of the weights' load it used to hide in; a load on a machine that has them says nothing about them."""
    from depctl_runtime.kernels import native

    real = native.available

    def first_time(building=None):
        if building is not None:  # the loader's call; surgery's later ones pass none
            building()
        return real()

    stages = []
    spec = DeploymentSpec(id="first", model=str(tiny_model_dir), compile=False, device="cpu")
    monkeypatch.setattr(native, "available", first_time)
    load_deployment(spec, calibrate=False, report=stages.append)
    assert str(stages[0]) == "building: depctl's C++ ops (once per machine)"
    monkeypatch.setattr(native, "available", real)
    stages.clear()
    load_deployment(spec, calibrate=False, report=stages.append)
    assert [s.name for s in stages][:1] == ["resolving"] and "building" not in [s.name for s in stages]


def test_the_prefix_cache_takes_the_specs_budget_auto_by_default_and_none_when_off(tiny_model_dir):
    spec = DeploymentSpec(id="p", model=str(tiny_model_dir), compile=False, device="cpu")
    auto = load_deployment(spec, calibrate=False).engine.prefix
    assert auto is not None and 0 < auto.budget_bytes <= loader.PREFIX_CACHE_MAX
    sized = load_deployment(spec.model_copy(update={"prefix_cache_bytes": 3 << 20}), calibrate=False).engine.prefix
    assert sized.budget_bytes == 3 << 20
    assert load_deployment(spec.model_copy(update={"prefix_cache_bytes": 0}), calibrate=False).engine.prefix is None
