"""A deployment drafts from an EAGLE-3 head: loaded for its own target only, through the compiled pass, exact."""

from __future__ import annotations

import pytest
import torch

from depctl.spec import DeploymentSpec, DraftModelSpeculation
from depctl_runtime.backends.eagle import for_serving
from depctl_runtime.backends.loader import load_deployment
from depctl_runtime.backends.weights import LoadError
from depctl_runtime.kernels.quantized import QuantizedLinear
from depctl_runtime.model.runner import held_bytes
from depctl_runtime.speculation import GenerationParams, Scheduler
from depctl_runtime.speculation.eagle import EagleProposer
from depctl_runtime.speculation.policy import DraftLengthPolicy, rate_for_mean_accepted
from tests.tiny import save_tiny_head

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests need one")


@pytest.fixture(scope="module")
def head_dir(tiny_model_dir, tmp_path_factory):
    return save_tiny_head(tmp_path_factory.mktemp("head"), tiny_model_dir)


def spec_with(model_dir, head, **kw):
    speculation = DraftModelSpeculation(draft_model=str(head), num_draft_tokens=3)
    return DeploymentSpec(id="eagle", model=str(model_dir), device="cpu", speculation=speculation, **kw)


PROMPTS = [[5, 17, 42, 99, 3, 17, 42, 99, 3, 8], list(range(30, 60)), [77, 78]]
PARAMS = GenerationParams(max_tokens=24, ignore_eos=True)


def test_a_serving_heads_layer_reads_4_bit_weights_and_its_output_layer_8_bit_on_a_cpu(tiny_model_dir, head_dir):
    loaded = load_deployment(spec_with(tiny_model_dir, head_dir, compile=False), calibrate=False)
    head = loaded.engine.draft_model.head
    bits = {name: m.bits for name, m in head.named_modules() if isinstance(m, QuantizedLinear)}
    assert bits.pop("lm_head") == 8
    assert bits and set(bits.values()) == {4}
    loaded.release()


def test_a_head_made_ready_twice_is_refused_and_the_targets_embeddings_stay(tiny_model_dir, head_dir):
    loaded = load_deployment(spec_with(tiny_model_dir, head_dir, compile=False), calibrate=False)
    head, model = loaded.engine.draft_model.head, loaded.target.model
    table = model.get_input_embeddings().weight.clone()
    with pytest.raises(ValueError, match="already ready"):
        for_serving(head, model)
    assert torch.equal(model.get_input_embeddings().weight, table)
    loaded.release()


@pytest.mark.parametrize(
    "compile",
    [False, pytest.param(True, marks=pytest.mark.slow)],  # compiled: builds two head libraries
)
def test_a_head_drafts_for_its_target_and_the_output_is_the_targets(tiny_model_dir, head_dir, compile):
    loaded = load_deployment(spec_with(tiny_model_dir, head_dir, compile=compile, max_batch_size=3), calibrate=False)
    engine = loaded.engine
    assert isinstance(engine.proposer, EagleProposer)
    assert (engine.target.fast_pass is not None) == compile, loaded.compiled
    assert (engine.proposer.compiled is not None) == compile, loaded.compiled  # the head's step compiles beside it
    engine.policy.adaptive = False  # draft every step: the hardest case for exactness
    got = Scheduler(engine, 3, prefill_chunk=8).run_all(PROMPTS, PARAMS)
    plain = load_deployment(DeploymentSpec(id="p", model=str(tiny_model_dir), device="cpu", compile=False))
    assert got == Scheduler(plain.engine, 3).run_all(PROMPTS, PARAMS)
    assert engine.stats.num_draft_tokens > 0
    # the head reads the target's own embedding table, also after a compiled pass took its own copy of the weights
    # it was mapped from: held once, counted once
    table = loaded.target.model.get_input_embeddings().weight
    assert engine.proposer.head.embed_tokens.weight.data_ptr() == table.data_ptr()
    head, target = engine.proposer.head, loaded.target.model
    assert held_bytes(target, head) - held_bytes(target) == held_bytes(head) - table.nbytes


def test_the_compiled_pass_returns_the_layer_features_the_eager_pass_does(tiny_model_dir, head_dir):
    # float32: in bf16 the two passes' products may round a feature one bf16 step apart
    fast = load_deployment(spec_with(tiny_model_dir, head_dir, dtype="float32"), calibrate=False).engine.target
    eager = fast.with_pass(None)
    assert fast.fast_pass is not None and fast.features == (0, 1, 1)
    fast.prefill(0, [1, 2, 3, 4, 5])
    a = fast.score(0, [[6, 7, 8]]).features  # [3, 3 * hidden]
    fast.set_length(0, 5)
    b = eager.score(0, [[6, 7, 8]]).features
    assert a.shape == (3, 3 * 64)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_heads_drafts_start_from_the_acceptance_its_training_measured(tiny_model_dir, tmp_path):
    history = [{"minutes": 30.0, "mean_accepted": 1.2}, {"minutes": 31.0, "mean_accepted": 1.7}]
    measured = save_tiny_head(tmp_path / "measured", tiny_model_dir, extra={"history": history})
    engine = load_deployment(spec_with(tiny_model_dir, measured), calibrate=False).engine
    assert engine.policy.model_rate == pytest.approx(rate_for_mean_accepted(1.7, 4))  # the last, at its K of 4
    unmeasured = load_deployment(
        spec_with(tiny_model_dir, save_tiny_head(tmp_path / "u", tiny_model_dir)), calibrate=False
    )
    assert unmeasured.engine.policy.model_rate == DraftLengthPolicy(3).model_rate  # the default prior


def test_a_head_trained_for_another_model_is_refused_naming_both(tiny_model_dir, tiny_draft_dir, tmp_path):
    other = save_tiny_head(tmp_path / "other", tiny_draft_dir)  # the same shapes as the target's, other weights
    with pytest.raises(LoadError, match=r"EAGLE head trained for .*tiny-draft.*and MODEL .* is another model"):
        load_deployment(spec_with(tiny_model_dir, other), calibrate=False)


def test_deployment_status_counts_the_head_and_names_its_layers(tiny_model_dir, head_dir):
    loaded = load_deployment(spec_with(tiny_model_dir, head_dir, compile=False), calibrate=True)
    snapshot = loaded.engine.policy.snapshot()
    assert snapshot["draft_ms"]  # the head's step is priced like a draft model's forward


@pytest.mark.gpu
@cuda
def test_a_head_drafts_on_a_gpu_through_cuda_graphs_and_the_output_is_the_targets(tiny_model_dir, head_dir):
    loaded = load_deployment(
        spec_with(tiny_model_dir, head_dir, max_batch_size=3).model_copy(update={"device": "cuda"})
    )
    engine = loaded.engine
    assert engine.target.fast_pass is not None, loaded.compiled  # graphs recorded with the head's layers
    engine.policy.adaptive = False
    got = Scheduler(engine, 3, prefill_chunk=8).run_all(PROMPTS, PARAMS)
    plain = load_deployment(DeploymentSpec(id="p", model=str(tiny_model_dir), device="cuda"), calibrate=False)
    assert got == Scheduler(plain.engine, 3).run_all(PROMPTS, PARAMS)
    assert engine.stats.num_draft_tokens > 0


def test_a_head_whose_weights_are_a_pickle_is_refused_without_running_it(tmp_path):
    from depctl_runtime.model import eagle_format
    from tests.pickles import plant
    from tests.tiny import tiny_head

    head = tiny_head()
    eagle_format.save(head, tmp_path / "head", {"name_or_path": "t", "architectures": [], "fingerprint": "f"}, 2, {})
    marker = tmp_path / "ran"
    plant(tmp_path / "head" / "model.safetensors", marker)
    with pytest.raises(Exception):  # noqa: B017 - any refusal will do: what matters is that nothing ran
        eagle_format.load(tmp_path / "head", head.embed_tokens.weight)
    assert not marker.exists()
