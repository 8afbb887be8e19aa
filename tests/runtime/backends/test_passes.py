"""How passes run: compiled libraries built once and reused, CUDA graphs proven exact first, and eager with the
reason wherever a fast pass is refused or fails."""

from __future__ import annotations

import pytest
import torch

from depctl.spec import DeploymentSpec
from depctl_runtime.backends import loader, passes, weights
from depctl_runtime.backends.loader import load_deployment
from depctl_runtime.kernels.surgery import row_invariant_chunk
from depctl_runtime.model.decoder import fuse_projections


@pytest.mark.slow
def test_an_int8_target_on_a_cpu_runs_compiled_passes_built_once_and_reused(tiny_model_dir, tmp_path, monkeypatch):
    from depctl_runtime.kernels import native

    if not native.available():
        pytest.skip("depctl's C++ ops could not be built here: int8 takes PyTorch's kernel, and nothing compiles")
    monkeypatch.setenv("DEPCTL_CACHE", str(tmp_path))
    spec = DeploymentSpec(id="w8", model=str(tiny_model_dir), device="cpu", quantization="int8")
    first = load_deployment(spec, calibrate=False)
    assert (
        first.engine.target.fast_pass is not None
        and first.compiled.startswith("yes (AOTInductor")
        and "built in" in first.compiled
    )
    (package,) = (tmp_path / "compiled").glob("*.pt2")
    built = package.stat().st_mtime_ns
    second = load_deployment(spec, calibrate=False)  # a restart: the package is opened, not rebuilt
    assert second.engine.target.fast_pass is not None and "built in" not in second.compiled
    assert package.stat().st_mtime_ns == built
    package.write_bytes(package.read_bytes()[:1000])  # a disk filled up, a copy cut short: rebuilt, not run eagerly
    third = load_deployment(spec, calibrate=False)
    assert third.engine.target.fast_pass is not None and "built in" in third.compiled
    off = load_deployment(spec.model_copy(update={"compile": False}), calibrate=False)
    assert off.engine.target.fast_pass is None and off.compiled == "no (the spec says compile: false)"


@pytest.mark.slow
def test_an_int4_draft_on_a_cpu_drafts_through_a_compiled_library_of_its_own(
    tiny_model_dir, tiny_draft_dir, tmp_path, monkeypatch
):
    """Eager, a 0.5B int4 draft spent a third of each forward between ops, and drafting cost more than it saved."""
    from depctl.spec import DraftModelSpeculation
    from depctl_runtime.kernels import native
    from depctl_runtime.speculation import GenerationParams, generate

    if not native.available():
        pytest.skip("depctl's C++ ops could not be built here: no int4 draft, and nothing compiles")
    monkeypatch.setenv("DEPCTL_CACHE", str(tmp_path))
    speculation = DraftModelSpeculation(draft_model=str(tiny_draft_dir), num_draft_tokens=3, draft_precision="int4")
    spec = DeploymentSpec(
        id="d4", model=str(tiny_model_dir), device="cpu", quantization="int4", speculation=speculation
    )
    loaded = load_deployment(spec, calibrate=False)
    runner = loaded.engine.draft_model.runner
    assert runner.fast_pass is not None and loaded.engine.target.fast_pass is not None
    assert "; the draft model through AOTInductor library" in loaded.compiled
    assert len(list((tmp_path / "compiled").glob("*.pt2"))) == 2  # one library per model
    prompt = [5, 17, 42, 99, 3, 17, 42, 99, 3, 8]

    def run(params):
        return [t for o in generate(loaded.engine, prompt, params) for t in o.token_ids]

    loaded.engine.policy.adaptive = False  # draft K every step
    spec_out = run(GenerationParams(max_tokens=24, ignore_eos=True))
    assert loaded.engine.stats.num_draft_tokens > 0
    assert spec_out == run(GenerationParams(max_tokens=24, ignore_eos=True, speculate=False))


@pytest.mark.skipif(row_invariant_chunk(torch.float16) is None, reason="this CPU's fp16 products are not row-invariant")
def test_other_precisions_stay_eager_and_say_why(tiny_model_dir):
    loaded = load_deployment(
        DeploymentSpec(id="f", model=str(tiny_model_dir), device="cpu", dtype="float16"), calibrate=False
    )
    assert loaded.engine.target.fast_pass is None and loaded.compiled.startswith("no (float16 passes ")


def test_a_compile_that_fails_leaves_the_eager_pass_and_the_deployment_serves(tiny_model_dir, tmp_path, monkeypatch):
    from depctl_runtime.kernels import native
    from depctl_runtime.model import compiled

    if not native.available():
        pytest.skip("depctl's C++ ops could not be built here: int8 takes PyTorch's kernel, and nothing compiles")
    monkeypatch.setenv("DEPCTL_CACHE", str(tmp_path))

    def no_compiler(*args, **kwargs):
        raise RuntimeError("g++: command not found\nmore lines")

    monkeypatch.setattr(compiled, "build", no_compiler)
    reported = []
    loaded = load_deployment(
        DeploymentSpec(id="w8", model=str(tiny_model_dir), device="cpu", quantization="int8"), report=reported.append
    )
    assert loaded.engine.target.fast_pass is None
    assert loaded.compiled == "no (compiling failed: RuntimeError: g++: command not found)"
    assert [stage.name for stage in reported] == ["resolving", "loading", "compiling", "calibrating"], reported
    assert loaded.calibration  # it went on to calibrate, and serves eagerly


def test_a_float_build_that_would_not_fit_in_memory_is_not_started(tiny_model_dir, tmp_path, monkeypatch):
    """The build traces over plain stand-ins of oneDNN's reordered weights (a bf16 target's on a CPU without AVX-512
    BF16, made so here), the weights' size again: with less memory free than that, the deployment runs eagerly and
    says why, rather than meeting the OOM killer mid-build."""
    from depctl_runtime.kernels import native
    from depctl_runtime.kernels.surgery import onednn_row_invariant
    from depctl_runtime.model import compiled

    if not onednn_row_invariant(torch.bfloat16):
        pytest.skip("no row-invariant oneDNN bf16 linear here: no product is traced over stand-ins")
    monkeypatch.setattr(native, "blocked_supports", lambda dtype: dtype == torch.float32)  # bf16 takes oneDNN's
    monkeypatch.setenv("DEPCTL_CACHE", str(tmp_path))
    monkeypatch.setattr(loader, "check_memory", lambda needs, device: None)  # the load itself fits: not tested here
    monkeypatch.setattr(passes, "free_bytes", lambda device: 1000)  # bytes

    def unexpected(*args, **kwargs):
        raise AssertionError("the build started")

    monkeypatch.setattr(compiled, "build", unexpected)
    loaded = load_deployment(
        DeploymentSpec(id="f", model=str(tiny_model_dir), device="cpu", dtype="bfloat16"), calibrate=False
    )
    assert loaded.engine.target.fast_pass is None
    assert loaded.compiled.startswith("no (building the library needs about 0.00 GiB free while it compiles")


def test_the_gpu_path_puts_target_and_draft_on_fixed_shapes_once_they_check_exact(tiny_model_dir, tiny_draft_dir):
    target, draft = _graph_runners(tiny_model_dir, tiny_draft_dir)
    chosen = passes.graph_passes(target, 5, draft)
    assert chosen.kind == passes.PassKind.CUDA_GRAPHS
    assert chosen.describe() == "yes (fixed-shape passes of 4 x 5 tokens; the draft model's forwards too)"
    assert chosen.target.fast_pass.widths == (5,) and chosen.draft.fast_pass.widths == (1, 2)
    assert target.fast_pass is None  # the eager runners are left as they were


def test_a_gpu_deployment_without_compiling_keeps_the_fixed_shape_passes_unrecorded(tiny_model_dir, tiny_draft_dir):
    """cuBLAS picks kernels by shape: eager passes of changing widths would make speculation round differently."""
    target, draft = _graph_runners(tiny_model_dir, tiny_draft_dir)
    chosen = passes.graph_passes(target, 5, draft, record=False)
    assert chosen.kind == passes.PassKind.EAGER
    assert chosen.describe() == "no (the spec says compile: false; fixed-shape passes of 4 x 5 tokens)"
    assert chosen.target.fast_pass.widths == (5,) and not chosen.target.fast_pass.capture
    assert chosen.draft is draft and draft.fast_pass is None  # a draft only proposes: its forwards stay eager


def test_the_gpu_path_falls_back_to_eager_and_says_why(tiny_model_dir, tiny_draft_dir, monkeypatch):
    from depctl_runtime.model import compiled, graphs

    target, draft = _graph_runners(tiny_model_dir, tiny_draft_dir)
    monkeypatch.setattr(compiled, "check", lambda runner: False)
    chosen = passes.graph_passes(target, 5, draft)
    assert chosen.describe() == (
        "no (a verify pass through the CUDA graphs rounded differently from single steps on this GPU)"
    )
    assert chosen.target.fast_pass is None and chosen.draft.fast_pass is None

    def broken(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(graphs, "FixedShapePass", broken)
    chosen = passes.graph_passes(target, 5, draft)
    assert chosen.describe() == (
        "no (recording CUDA graphs failed: RuntimeError: operation not permitted when stream is capturing)"
    )
    assert chosen.target.fast_pass is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests need one")
def test_a_cuda_deployment_replays_its_passes_from_graphs_and_stays_exact(tiny_model_dir, tiny_draft_dir):
    from depctl.spec import DraftModelSpeculation
    from depctl_runtime.speculation import GenerationParams, generate

    spec = DeploymentSpec(
        id="g",
        model=str(tiny_model_dir),
        device="cuda",
        max_batch_size=4,
        speculation=DraftModelSpeculation(draft_model=str(tiny_draft_dir), num_draft_tokens=4),
    )
    loaded = load_deployment(spec)
    assert loaded.compiled == "yes (CUDA graphs of 4 x 5 tokens; the draft model's forwards too)"
    prompt = [5, 17, 42, 99, 3, 17, 42, 99, 3, 8]

    def run(speculate: bool) -> list[int]:
        params = GenerationParams(max_tokens=48, ignore_eos=True, speculate=speculate)
        return [t for o in generate(loaded.engine, prompt, params) for t in o.token_ids]

    assert run(True) == run(False)
    assert loaded.engine.target.fast_pass.recordings == 1


def _graph_runners(tiny_model_dir, tiny_draft_dir, rows: int = 4):
    """A target and a draft runner as load_deployment builds them for a GPU, here on the CPU (the fixed-shape passes
    then run without recording: ``depctl_runtime.model.graphs``)."""
    from depctl_runtime.model.runner import ModelRunner

    runners = []
    for path in (tiny_model_dir, tiny_draft_dir):
        model = weights.load_model(str(path), "MODEL", torch.device("cpu"), torch.float32).model
        fuse_projections(model)
        runners.append(ModelRunner(model, max_rows=rows))
    return runners
