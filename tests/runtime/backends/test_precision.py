"""Device, dtype and draft precision: what each choice loads, and what is refused with what to change."""

from __future__ import annotations

import pytest
import torch

from depctl.spec import DeploymentSpec
from depctl_runtime.backends import precision
from depctl_runtime.backends.loader import load_deployment
from depctl_runtime.backends.weights import LoadError


def test_draft_precision_resolution():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # a device object only: nothing is allocated
    assert precision.pick_draft_precision("auto", cpu, torch.float32) == "int8"
    assert precision.pick_draft_precision("auto", cuda, torch.bfloat16) == "bfloat16"
    assert precision.pick_draft_precision("float32", cpu, torch.float32) == "float32"
    with pytest.raises(LoadError, match="--draft-precision int8 runs on a CPU only.*--draft-precision auto"):
        precision.pick_draft_precision("int8", cuda, torch.bfloat16)


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
    assert loaded.target.precision == str(precision.pick_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    assert not any("quantized" in type(m).__module__ for m in loaded.target.model.modules())


@pytest.mark.slow  # two full loads (a 4-bit one is also loaded by tests/runtime/backends/test_local.py)
@pytest.mark.parametrize("quantization, bits", [("int8", 8), ("int4", 4)])
def test_a_quantized_target_loads_depctls_grouped_linears(tiny_model_dir, quantization, bits):
    from depctl_runtime.kernels.quantized import QuantizedLinear

    spec = DeploymentSpec(id="w", model=str(tiny_model_dir), device="cpu", quantization=quantization)
    loaded = load_deployment(spec, calibrate=False)
    assert loaded.target.precision == precision.QUANTIZED[quantization]
    assert loaded.target.dtype == precision.pick_dtype("auto", torch.device("cpu"), quantization)
    linears = [m for m in loaded.target.model.modules() if isinstance(m, (torch.nn.Linear, QuantizedLinear))]
    assert linears and all(isinstance(m, QuantizedLinear) and m.bits == bits for m in linears)  # the output layer too
    assert f"depctl int{bits} grouped" in loaded.products


def test_a_quantized_target_is_refused_on_cuda_with_what_to_change():
    with pytest.raises(LoadError, match="--quantization int4 is a CPU kernel.*--device cpu, or --quantization none"):
        precision.pick_dtype("auto", torch.device("cuda"), "int4")
    assert precision.pick_dtype("float32", torch.device("cpu"), "int4") == torch.float32


def test_an_int4_draft_is_depctls_4_bit_linears(tiny_model_dir, tiny_draft_dir):
    from depctl.spec import DraftModelSpeculation
    from depctl_runtime.kernels.quantized import QuantizedLinear

    speculation = DraftModelSpeculation(draft_model=str(tiny_draft_dir), num_draft_tokens=3, draft_precision="int4")
    spec = DeploymentSpec(id="q4", model=str(tiny_model_dir), device="cpu", speculation=speculation)
    loaded = load_deployment(spec, calibrate=False)
    assert loaded.draft.precision == precision.INT4_WEIGHTS and loaded.draft.dtype == torch.float32
    assert any(isinstance(m, QuantizedLinear) and m.bits == 4 for m in loaded.draft.model.modules())
    with pytest.raises(LoadError, match="--draft-precision int4 runs on a CPU only"):
        precision.pick_draft_precision("int4", torch.device("cuda"), torch.bfloat16)
