"""The loader's checks that run before any weights are loaded."""

from __future__ import annotations

import pytest
import torch

from depctl.spec import DeploymentSpec
from depctl_runtime.backends import loader
from depctl_runtime.backends.loader import LoadError, check_memory, estimate_bytes, load_deployment
from depctl_runtime.kernels.surgery import row_invariant_chunk


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

    spec = DeploymentSpec(
        id="q",
        model=str(tiny_model_dir),
        device="cpu",
        speculation=DraftModelSpeculation(draft_model=str(tiny_draft_dir), num_draft_tokens=3),
    )
    loaded = load_deployment(spec, calibrate=False)
    assert loaded.draft.precision == "int8"
    linears = [type(m).__module__ for m in loaded.draft.model.modules() if "Linear" in type(m).__name__]
    assert linears and all("quantized" in m for m in linears), linears
    assert loaded.target.precision == str(loader.pick_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    assert not any("quantized" in type(m).__module__ for m in loaded.target.model.modules())


@pytest.mark.parametrize("quantization, bits", [("int8", 8), ("int4", 4)])
def test_a_quantized_target_loads_depctls_grouped_linears(tiny_model_dir, quantization, bits):
    from depctl_runtime.kernels.quantized import QuantizedLinear

    spec = DeploymentSpec(id="w", model=str(tiny_model_dir), device="cpu", quantization=quantization)
    loaded = load_deployment(spec, calibrate=False)
    assert loaded.target.precision == loader.QUANTIZED[quantization]
    assert loaded.target.dtype == loader.pick_dtype("auto", torch.device("cpu"), quantization)
    linears = [m for m in loaded.target.model.modules() if isinstance(m, (torch.nn.Linear, QuantizedLinear))]
    assert linears and all(isinstance(m, QuantizedLinear) and m.bits == bits for m in linears)  # the output layer too
    assert f"depctl int{bits} grouped" in loaded.products


def test_a_quantized_target_is_refused_on_cuda_with_what_to_change():
    with pytest.raises(LoadError, match="--quantization int4 is a CPU kernel.*--device cpu, or --quantization none"):
        loader.pick_dtype("auto", torch.device("cuda"), "int4")
    assert loader.pick_dtype("float32", torch.device("cpu"), "int4") == torch.float32


def test_an_int4_draft_is_depctls_4_bit_linears(tiny_model_dir, tiny_draft_dir):
    from depctl.spec import DraftModelSpeculation
    from depctl_runtime.kernels.quantized import QuantizedLinear

    speculation = DraftModelSpeculation(draft_model=str(tiny_draft_dir), num_draft_tokens=3, draft_precision="int4")
    spec = DeploymentSpec(id="q4", model=str(tiny_model_dir), device="cpu", speculation=speculation)
    loaded = load_deployment(spec, calibrate=False)
    assert loaded.draft.precision == loader.INT4_WEIGHTS and loaded.draft.dtype == torch.float32
    assert any(isinstance(m, QuantizedLinear) and m.bits == 4 for m in loaded.draft.model.modules())
    with pytest.raises(LoadError, match="--draft-precision int4 runs on a CPU only"):
        loader.pick_draft_precision("int4", torch.device("cuda"), torch.bfloat16)


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
    monkeypatch.setattr(loader, "free_bytes", lambda device: 1000)  # bytes

    def unexpected(*args, **kwargs):
        raise AssertionError("the build started")

    monkeypatch.setattr(compiled, "build", unexpected)
    loaded = load_deployment(
        DeploymentSpec(id="f", model=str(tiny_model_dir), device="cpu", dtype="bfloat16"), calibrate=False
    )
    assert loaded.engine.target.fast_pass is None
    assert loaded.compiled.startswith("no (building the library needs about 0.00 GiB free while it compiles")


def _graph_runners(tiny_model_dir, tiny_draft_dir, rows: int = 4):
    """A target and a draft runner as load_deployment builds them for a GPU, here on the CPU (the fixed-shape passes
    then run without recording: ``depctl_runtime.model.graphs``)."""
    from depctl_runtime.model.runner import ModelRunner

    runners = []
    for path in (tiny_model_dir, tiny_draft_dir):
        model = loader.load_model(str(path), "MODEL", torch.device("cpu"), torch.float32).model
        loader.fuse_projections(model)
        runners.append(ModelRunner(model, max_rows=rows))
    return runners


def test_the_gpu_path_puts_target_and_draft_on_fixed_shapes_once_they_check_exact(tiny_model_dir, tiny_draft_dir):
    target, draft = _graph_runners(tiny_model_dir, tiny_draft_dir)
    passes = loader.graph_passes(target, 5, draft)
    assert passes.kind == loader.PassKind.CUDA_GRAPHS
    assert passes.describe() == "yes (fixed-shape passes of 4 x 5 tokens; the draft model's forwards too)"
    assert passes.target.fast_pass.widths == (5,) and passes.draft.fast_pass.widths == (1, 2)
    assert target.fast_pass is None  # the eager runners are left as they were


def test_the_gpu_path_falls_back_to_eager_and_says_why(tiny_model_dir, tiny_draft_dir, monkeypatch):
    from depctl_runtime.model import compiled, graphs

    target, draft = _graph_runners(tiny_model_dir, tiny_draft_dir)
    monkeypatch.setattr(compiled, "check", lambda runner: False)
    passes = loader.graph_passes(target, 5, draft)
    assert passes.describe() == (
        "no (a verify pass through the CUDA graphs rounded differently from single steps on this GPU)"
    )
    assert passes.target.fast_pass is None and passes.draft.fast_pass is None

    def broken(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(graphs, "FixedShapePass", broken)
    passes = loader.graph_passes(target, 5, draft)
    assert passes.describe() == (
        "no (recording CUDA graphs failed: RuntimeError: operation not permitted when stream is capturing)"
    )
    assert passes.target.fast_pass is None


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


def test_a_damaged_cached_model_says_how_to_fetch_it_again(tiny_model_dir, tmp_path, monkeypatch):
    """`deployment update` cannot mend a cached copy cut short; the message names the command that can."""
    import shutil

    from depctl import models

    monkeypatch.setenv("DEPCTL_CACHE", str(tmp_path))
    cached = models.models_cache() / "smollm2-135m-instruct"
    shutil.copytree(tiny_model_dir, cached)
    (cached / models.DONE_MARKER).write_text("{}")
    weights = cached / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(LoadError) as err:
        loader.load_model("smollm2-135m-instruct", "MODEL", torch.device("cpu"), torch.float32)
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
        loader.load_model(str(model), "MODEL", torch.device("cpu"), torch.float32)
    assert "never reads pickled" in str(err.value) and not marker.exists()


def test_a_head_whose_weights_are_a_pickle_is_refused_without_running_it(tmp_path):
    from depctl_runtime.model import speculators
    from tests.pickles import plant
    from tests.runtime.model.test_eagle import tiny_head

    head = tiny_head()
    speculators.save(head, tmp_path / "head", {"name_or_path": "t", "architectures": [], "fingerprint": "f"}, 2, {})
    marker = tmp_path / "ran"
    plant(tmp_path / "head" / "model.safetensors", marker)
    with pytest.raises(Exception):  # noqa: B017 - any refusal will do: what matters is that nothing ran
        speculators.load(tmp_path / "head", head.embed_tokens.weight)
    assert not marker.exists()
