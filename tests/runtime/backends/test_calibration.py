"""Pass costs kept between loads: a reload of the same deployment on the same machine starts from what the last load
measured and refined while serving, and calibrates only when the shape is new."""

from __future__ import annotations

from depctl import config
from depctl.spec import DeploymentSpec, NgramSpeculation
from depctl_runtime.backends.loader import load_deployment


def _spec(name: str, model_dir, **kw) -> DeploymentSpec:
    speculation = NgramSpeculation(ngram_length=2, num_draft_tokens=3)
    return DeploymentSpec(
        id=name, model=str(model_dir), compile=False, device="cpu", max_batch_size=2, speculation=speculation, **kw
    )


def test_a_reload_starts_from_the_costs_the_last_load_kept_and_a_new_shape_calibrates(
    tiny_model_dir, tmp_path, monkeypatch
):
    monkeypatch.setattr(config, "cache_dir", lambda: tmp_path)
    spec = _spec("c", tiny_model_dir)
    stages = []
    first = load_deployment(spec, report=stages.append)
    assert "calibrating" in [s.name for s in stages] and "warming up" not in [s.name for s in stages]
    assert len(list((tmp_path / "calibration").glob("*.json"))) == 1
    first.engine.policy.verify_cost.samples[1] = 0.5  # what serving measured since
    first.release()

    stages.clear()
    second = load_deployment(spec, report=stages.append)
    assert "warming up" in [s.name for s in stages] and "calibrating" not in [s.name for s in stages]
    assert second.engine.policy.verify_cost.samples[1] == 0.5
    assert set(second.calibration["verify_ms"]) == set(first.calibration["verify_ms"])
    second.release()

    stages.clear()
    load_deployment(spec.model_copy(update={"max_batch_size": 4}), report=stages.append).release()
    assert "calibrating" in [s.name for s in stages], "other rows price other widths: measured afresh"
    assert len(list((tmp_path / "calibration").glob("*.json"))) == 2


def test_costs_measured_with_another_build_of_the_kernels_are_measured_again(tiny_model_dir, monkeypatch):
    """The products' names stay when their code changes: the kept costs follow the build of depctl's C++ ops."""
    from transformers import AutoModelForCausalLM

    from depctl_runtime.backends.calibration import kept_costs_path
    from depctl_runtime.kernels import native

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    spec = DeploymentSpec(id="c", model=str(tiny_model_dir))
    paths = []
    for build in ("native-0123", "native-4567", "native-0123"):
        monkeypatch.setattr(native, "identity", lambda build=build: build)
        paths.append(kept_costs_path(spec, model, "float32", "compiled", "depctl blocked float32 (FMA) x14"))
    assert paths[0] != paths[1] and paths[0] == paths[2]


def test_costs_kept_before_tree_passes_were_priced_are_measured_again(tmp_path):
    from depctl_runtime.backends.calibration import read_costs, write_costs

    path = tmp_path / "costs.json"
    write_costs(path, {"verify_ms": {"1": 5.0}, "draft_ms": {}})
    assert read_costs(path) is None  # no "tree_ms": a policy restored from it would never price a tree
    write_costs(path, {"verify_ms": {"1": 5.0}, "draft_ms": {}, "tree_ms": {}})
    assert read_costs(path)["verify_ms"] == {"1": 5.0}


def test_a_head_the_kept_costs_never_priced_has_its_forward_measured(tiny_model_dir, tmp_path, monkeypatch):
    # a learning deployment kept its costs before it had a head, then stopped without writing them back (killed, or
    # before its first generation served). Restored as they were, they priced no head forward, and an unmeasured
    # forward costs a second: its head never drafted
    from depctl import learning
    from depctl.spec import LearnDraftHead
    from tests.tiny import save_tiny_head

    monkeypatch.setattr(config, "cache_dir", lambda: tmp_path / "cache")
    spec = _spec("learns", tiny_model_dir, learn_draft_head=LearnDraftHead(), prefix_cache_bytes=0)
    load_deployment(spec)  # calibrates and keeps the costs; never released
    assert not read_kept(tmp_path / "cache")["draft_ms"]
    save_tiny_head(learning.path(spec.id) / "head", tiny_model_dir)  # its first generation, as a restart finds it
    stages = []
    again = load_deployment(spec, report=stages.append)
    assert "warming up" in [s.name for s in stages]  # the target's costs are the kept ones
    assert again.engine.draft_model is not None and set(again.engine.policy.draft_cost.samples) == {1, 2}
    again.release()


def read_kept(cache) -> dict:
    import json

    (path,) = (cache / "calibration").glob("*.json")
    return json.loads(path.read_text())
