"""Model surgery for CPU inference, applied by the loader explicitly, as module swaps a benchmark can leave out.

- ``weight_major_linears(model)``: every ``nn.Linear`` becomes a ``WeightMajorLinear`` (same weights, shared, not
  copied) that computes ``(W @ x^T)^T`` for a few rows. This is what makes verifying k drafts cost close to one
  step on a CPU.
- ``int8_linears(model)``: dynamic int8 linears (a draft model only: its numerics never reach the output).

Neither changes what a model *is* (its config, its weights); each returns how many modules it swapped.
"""

from __future__ import annotations

import torch
from torch import nn

WEIGHT_MAJOR_MAX_ROWS = 64  # past this (a prefill), F.linear's GEMM is faster: SmolLM2, 250 tokens, 425 vs 510 ms


class WeightMajorLinear(nn.Linear):
    """``nn.Linear`` computed as ``(W @ x^T)^T`` for up to ``WEIGHT_MAJOR_MAX_ROWS`` rows.

    Why: on a CPU, ``F.linear`` for a handful of rows (a verify pass over k + 1 tokens, a small batch) takes an MKL
    GEMM path that costs nearly 2x a single-row step; the weight-major product stays close to the one-row cost
    (SmolLM2 on 2 cores: 5 rows 68 ms instead of 109 ms; one row unchanged at 58 ms). ``x`` is made row-major first:
    a transposed view (what the MLP's ``silu(gate) * up`` inherits from the previous weight-major output) took a
    path ~5x slower on Qwen's ``down_proj`` for 5 rows; the copy is ``rows x in`` floats.
    """

    @classmethod
    def wrap(cls, linear: nn.Linear) -> "WeightMajorLinear":
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias  # the same Parameters: no copy
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        if x.numel() > WEIGHT_MAJOR_MAX_ROWS * x.shape[-1]:
            return nn.functional.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, x.shape[-1]).contiguous()  # [n, in], row-major
        y = (self.weight @ flat.T).T.reshape(*x.shape[:-1], self.weight.shape[0])
        return y if self.bias is None else y + self.bias


def _swap(model: nn.Module, pick, make) -> int:
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if pick(child):
                setattr(parent, name, make(child))
                swapped += 1
    return swapped


def weight_major_linears(model: nn.Module) -> int:
    """Swap every plain ``nn.Linear`` of ``model`` for a ``WeightMajorLinear`` over the same weights."""
    return _swap(model, lambda m: type(m) is nn.Linear, WeightMajorLinear.wrap)


def int8_linears(model: nn.Module) -> nn.Module:
    """Dynamic int8 for every ``nn.Linear`` (weights int8 per tensor, activations quantized per call): ~3x faster on
    a CPU, with outputs close to but not equal to float32 (and not batch-invariant): right for a draft, wrong for a
    target. Raises ``RuntimeError`` when this torch build has no dynamic quantization."""
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao.quantization is deprecated in favour of torchao
            from torch.ao.quantization import quantize_dynamic

            return quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=True)
    except Exception as exc:  # removed or unsupported in this torch build
        raise RuntimeError(f"{type(exc).__name__}: {exc}") from exc
