"""Where a deployment runs and in what numbers: the device, the dtype, a draft's precision, and the module surgery
that makes a CPU's products fast and keeps a target's exact under speculation (a row's result must not depend on
how many rows share the pass)."""

from __future__ import annotations

import torch

from depctl_runtime.backends.weights import LoadedModel, LoadError
from depctl_runtime.kernels import native
from depctl_runtime.kernels.quantized import quantized_linears
from depctl_runtime.kernels.surgery import (
    blocked_linears,
    int8_linears,
    int8_row_invariant,
    int8_weight_linears,
    onednn_linears,
    onednn_row_invariant,
    row_invariant_chunk,
    split_k_linears,
    weight_major_linears,
)
from depctl_runtime.model.decoder import fuse_projections
from depctl_runtime.model.screened_head import screen_output_layer

INT8_WEIGHTS = "int8 weights"  # a target's --quantization int8: weight-only int8 in groups (kernels.quantized)
INT4_WEIGHTS = "int4 weights"  # --quantization int4, and a draft's --draft-precision int4
QUANTIZED = {"int8": INT8_WEIGHTS, "int4": INT4_WEIGHTS}


def pick_device(requested: str) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise LoadError(
                "device 'cuda' was requested but torch sees no CUDA GPU "
                f"(torch {torch.__version__}, built {'with' if torch.version.cuda else 'without'} CUDA); "
                "update the deployment with --device cpu or --device auto"
            )
        return torch.device("cuda")
    return torch.device("cpu")


def pick_dtype(requested: str, device: torch.device, quantization: str = "none") -> torch.dtype:
    if quantization != "none":  # the activations' dtype around depctl's quantized products
        if device.type != "cpu":
            raise LoadError(
                f"--quantization {quantization} is a CPU kernel in this version, and this deployment resolved to "
                f"{device.type}: update it with --device cpu, or --quantization none"
            )
        if not native.available():
            return _quantized_without_native(quantization)
        if requested != "auto":
            return getattr(torch, requested)
        return torch.bfloat16 if cpu_has_bf16() and native.blocked_supports(torch.bfloat16) else torch.float32
    if requested != "auto":
        return getattr(torch, requested)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    # With bf16 dot-product instructions (AVX-512 BF16, AMX) bf16 halves the bytes a step reads and a product of a few
    # rows costs little more than one; without them bf16 is emulated and float32 is the fast choice. Either way the
    # result stays exact (surgery).
    if cpu_has_bf16() and cpu_bf16_exact():
        return torch.bfloat16
    return torch.float32


def _quantized_without_native(quantization: str) -> torch.dtype:
    """Where depctl's C++ ops cannot be built: int8 through PyTorch's own int8 weight kernel (bf16 activations,
    one scale a row); no int4."""
    if quantization == "int4":
        raise LoadError(
            "--quantization int4 runs on depctl's C++ ops, which could not be built here (the log says why): "
            "install a C++ compiler (g++ or clang++) and update the deployment to retry, or use --quantization int8"
        )
    if not int8_row_invariant(torch.bfloat16):
        raise LoadError(
            "this CPU's int8 weight kernel gives a row a different result depending on how many rows "
            "share the pass, so speculation would not be exact: update the deployment with "
            "--quantization none"
        )
    return torch.bfloat16


def cpu_bf16_exact() -> bool:
    """Whether this CPU can run a bf16 target exactly under speculation: our blocked product runs here (AVX-512 BF16:
    ``BlockedLinear``), oneDNN's linear is row-invariant from two rows (``OneDNNLinear``), or ``F.linear`` is once its
    inner dimension is cut (``SplitKLinear``)."""
    return (
        native.blocked_supports(torch.bfloat16)
        or onednn_row_invariant(torch.bfloat16)
        or row_invariant_chunk(torch.bfloat16) is not None
    )


def cpu_has_bf16() -> bool:
    """bf16 dot products in hardware: AVX-512 BF16 (Zen 4, Cooper Lake on) or AMX tiles (Sapphire Rapids on)."""
    cpu = getattr(torch, "cpu", None)
    return any(
        bool(getattr(cpu, name, lambda: False)()) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    )


def pick_draft_precision(requested: str, device: torch.device, target_dtype: torch.dtype) -> str:
    """How the draft's weights are held: "int8" or a dtype name. The draft only proposes, so this never changes
    the output. auto: int8 on a CPU (a draft token about 3x faster than float32), the target's dtype on a GPU (dynamic
    int8 is a CPU kernel)."""
    if requested == "auto":
        return "int8" if device.type == "cpu" else str(target_dtype).removeprefix("torch.")
    if requested in ("int8", "int4") and device.type != "cpu":
        raise LoadError(
            f"--draft-precision {requested} runs on a CPU only, and this deployment is on {device.type}; "
            "update it with --draft-precision auto (the target's dtype) or bfloat16"
        )
    if requested == "int4":
        if not native.available():
            raise LoadError(
                "--draft-precision int4 runs on depctl's C++ ops, which could not be built here (the log says why): "
                "install a C++ compiler and update the deployment to retry, or use --draft-precision int8"
            )
        return INT4_WEIGHTS
    return requested


def load_dtype(precision: str) -> torch.dtype:
    """The dtype a model of this precision is loaded in: an int8 or int4 draft is loaded in float32, then
    quantized."""
    return torch.float32 if precision in ("int8", INT4_WEIGHTS) else getattr(torch, precision)


def quantize_int8(model: torch.nn.Module) -> torch.nn.Module:
    """The draft's int8 surgery (``surgery.int8_linears``), with a load error the user can act on."""
    try:
        return int8_linears(model)
    except RuntimeError as exc:
        raise LoadError(
            f"int8 drafting is not available in torch {torch.__version__} ({exc}); "
            "update the deployment with --draft-precision float32"
        ) from exc


def surgery(loaded: LoadedModel, exact: bool = True) -> None:
    """The loader's model surgery, explicit and in one place: fused projections for Llama-family models on any device
    (``model.decoder``: the runner then steps our own forward), then on a CPU the module swaps that make it
    fast and keep it exact (``kernels.surgery``). ``exact``: the model's numerics reach the output (a target),
    so its products must not depend on how many rows share a pass; a draft's never do."""
    if loaded.device.type == "cpu":
        loaded.model = surgery_for(loaded.model, loaded.precision, exact)
    else:
        fuse_projections(loaded.model)


def surgery_for(model: torch.nn.Module, precision: str, exact: bool, fuse: bool = True) -> torch.nn.Module:
    """A CPU's surgery: fused projections where the architecture allows (then the swaps below apply to the fused
    linears); weight-only int8 linears for an int8 target (exact under speculation); dynamic int8 linears for an int8
    draft; for a bf16/fp16 target, oneDNN linears with at least two rows a product where that is row-invariant here
    (bf16 on AVX-512 machines), else split inner dimensions where the CPU's GEMM would round a row differently with
    more rows beside it (a half-precision draft needs neither); for float32, our own blocked linears where depctl's
    C++ ops build (else oneDNN linears where row-invariant, else weight-major linears: a handful of rows cost close
    to one), and with them, on a CPU with bf16 instructions, a target's output layer tied to its embeddings becomes a
    ``ScreenedHead`` (greedy choices without the full float32 product, once
    the compiled passes switch it on: ``depctl_runtime.model.screened_head``)."""
    if fuse:
        fuse_projections(model)
    if precision in (INT8_WEIGHTS, INT4_WEIGHTS):
        if not native.available():  # pick_dtype let only int8 through: PyTorch's kernel
            int8_weight_linears(model, torch.bfloat16)
            return model
        quantized_linears(model, 4 if precision == INT4_WEIGHTS else 8)
        # a linear the groups do not fit (inputs not a multiple of 32) keeps the dtype's own product
        dtype = next(model.parameters()).dtype
        return surgery_for(model, str(dtype).removeprefix("torch."), exact, fuse=False)
    if precision == "int8":
        return quantize_int8(model)
    if precision in ("bfloat16", "float16"):
        dtype = getattr(torch, precision)
        if native.blocked_supports(dtype):  # our own product: row-invariant, and faster than oneDNN's here
            blocked_linears(model, dtype)
            return model
        if exact:
            if onednn_row_invariant(dtype):
                onednn_linears(model, dtype)
                return model
            chunk = row_invariant_chunk(dtype)
            if chunk is None:
                raise LoadError(
                    f"{precision} matrix products on this CPU give a row a different result depending on how many "
                    "rows share the pass, so speculation would not be exact: update the deployment with --dtype float32"
                )
            split_k_linears(model, chunk)
        return model
    if native.available():  # our own row-invariant product (surgery.BlockedLinear), faster than oneDNN's here
        if (
            exact and cpu_has_bf16()
        ):  # greedy choices from a bf16 screen of the output layer (depctl_runtime.model.screened_head)
            screen_output_layer(model)
        blocked_linears(model)
    elif onednn_row_invariant():
        onednn_linears(model)
    else:
        weight_major_linears(model)
    return model
