"""Weight-only 4-bit and 8-bit linears through depctl's own product (``csrc/quantized_linear.cpp``).

A weight is cut into groups of 32 inputs per output, as GGUF's Q4_1 and Q4_K's sub-blocks are; a group holds
``w ~= scale * q + offset`` with q unsigned (0..15 or 0..255) and scale and offset in fp16: 5 bits a weight at 4
bits, 9 at 8. Activations stay float32 or bf16. The product's result for a row does not depend on the other rows of
the pass (the kernel's header says how), so speculation against a quantized target reproduces that target decoding
plainly, as every other precision does.

- ``quantize(weight, bits)``: the groups' q, scales and offsets, fitted by least squares around min-max.
- ``pack(q, scales, offsets, bits)``: the kernel's blocked layout.
- ``QuantizedLinear``: the module; ``quantized_linears(model, bits)`` swaps a model's linears for it.
"""

from __future__ import annotations

import torch
from torch import nn

GROUP = 32
REFINE_STEPS = 4  # least-squares passes over the min-max grid; more changed the error by under 0.1%


def quantize(weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [out, in] (in a multiple of 32) -> q [out, in] uint8, scales and offsets [out, in / 32] fp16.

    Each group starts from its min-max grid; then, a few times, q is rounded against the grid and the grid refitted to
    q by least squares (the scale and offset that minimise the group's squared error for that q), keeping the best
    grid seen. A weight that already lies on a 16-level grid (a dequantized GGUF Q4 tensor) is found again exactly up
    to fp16's rounding of its scale and offset."""
    levels = (1 << bits) - 1
    w = weight.detach().float().reshape(weight.shape[0], -1, GROUP)  # [out, groups, 32]
    low, high = w.amin(-1), w.amax(-1)
    scale, offset = _half((high - low) / levels), _half(low)
    best = (torch.full_like(low, float("inf")), scale, offset)
    for _ in range(REFINE_STEPS + 1):
        q = _round(w, scale, offset, levels)
        error = (q * scale[..., None] + offset[..., None] - w).square().sum(-1)
        better = error < best[0]
        best = tuple(torch.where(better, new, old) for new, old in zip((error, scale, offset), best))
        scale, offset = _fit(w, q)
    _, scale, offset = best
    q = _round(w, scale, offset, levels).to(torch.uint8)
    return q.reshape(weight.shape), scale.half(), offset.half()


def _half(t: torch.Tensor) -> torch.Tensor:
    """Rounded to fp16 (what is stored) and back, so q is computed against the stored grid."""
    return t.clamp(-65504, 65504).half().float()


def _round(w: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, levels: int) -> torch.Tensor:
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    return torch.round((w - offset[..., None]) / safe[..., None]).clamp(0, levels)


def _fit(w: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The least-squares scale and offset of each group for its q: w ~= scale * q + offset."""
    n = w.shape[-1]
    sq, sw = q.sum(-1), w.sum(-1)
    sqq, sqw = (q * q).sum(-1), (q * w).sum(-1)
    det = n * sqq - sq * sq
    flat = det == 0  # every q equal: the offset alone
    scale = torch.where(flat, torch.zeros_like(sq), (n * sqw - sq * sw) / torch.where(flat, 1, det))
    offset = (sw - scale * sq) / n
    return _half(scale), _half(offset)


def dequantize(q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """q [out, in], scales and offsets [out, in / 32] -> the weight [out, in] in float32."""
    out = q.shape[0]
    w = q.float().reshape(out, -1, GROUP) * scales.float()[..., None] + offsets.float()[..., None]
    return w.reshape(q.shape)


def pack(q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int, width: int):
    """The kernel's layout for blocks of ``width`` outputs (``quantized_width(bits)``): (packed uint8
    [blocks, in * bits / 8, width], scales and offsets fp16 [blocks, in / 32, width]), outputs zero-padded to whole
    blocks. 8 bits: step k of a block is input k of its outputs. 4 bits (the dot-product layout in
    ``quantized_linear.cpp``): per group, 4 runs of [width outputs, 4 inputs], run p's low nibbles inputs 8p..8p+3 and
    its high nibbles 8p+4..8p+7."""
    out, inner = q.shape
    blocks = -(-out // width)
    padded = torch.zeros(blocks * width, inner, dtype=torch.uint8)
    padded[:out] = q
    if bits == 4:
        runs = padded.view(blocks, width, inner // GROUP, 4, 2, 4)  # [block, output, group, run, half, input]
        nibbles = runs[..., 0, :] | (runs[..., 1, :] << 4)  # [block, output, group, run, input]
        packed = nibbles.permute(0, 2, 3, 1, 4).reshape(blocks, inner // 2, width)
    else:
        packed = padded.view(blocks, width, -1).transpose(1, 2).contiguous()

    def layout(t: torch.Tensor) -> torch.Tensor:
        full = torch.zeros(blocks * width, t.shape[1], dtype=torch.half)
        full[:out] = t
        return full.view(blocks, width, -1).transpose(1, 2).contiguous()

    return packed, layout(scales), layout(offsets)


class QuantizedLinear(nn.Module):
    """An ``nn.Linear`` with 4- or 8-bit weights in groups (``quantize``) through ``depctl_native::quantized_linear``.
    Its output has the input's dtype (float32 or bf16). The packed weights are the only copy kept. Prompt chunks take
    the same kernel: it read a 200-token prompt in about half the time of dequantizing the weights for torch's GEMM
    (BENCHMARKS.md, "The products"). Needs depctl's C++ ops loaded (``native.load``)."""

    def __init__(self, linear: nn.Linear, bits: int):
        super().__init__()
        self.in_features, self.out_features, self.bits = linear.in_features, linear.out_features, bits
        if self.in_features % GROUP:
            raise ValueError(f"a {bits}-bit linear needs a multiple of {GROUP} inputs, not {self.in_features}")
        width = torch.ops.depctl_native.quantized_width(bits)
        packed, scales, offsets = pack(*quantize(linear.weight, bits), bits, width)
        self.register_buffer("packed", packed, persistent=False)  # [blocks, in * bits / 8, width] uint8
        self.register_buffer("scales", scales, persistent=False)  # [blocks, in / 32, width] fp16
        self.register_buffer("offsets", offsets, persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        flat = x.reshape(-1, self.in_features)
        y = torch.ops.depctl_native.quantized_linear(
            flat, self.packed, self.scales, self.offsets, self.out_features, self.bits
        )
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The dequantized weight [out, in], float32."""
        blocks, steps, width = self.packed.shape
        if self.bits == 4:
            runs = self.packed.view(blocks, -1, 4, width, 4)  # [block, group, run, output, input]
            halves = torch.stack([runs & 0xF, runs >> 4], dim=3)  # [block, group, run, half, output, input]
            rows = halves.permute(0, 4, 1, 2, 3, 5).reshape(blocks * width, -1)[: self.out_features]
        else:
            rows = self.packed.transpose(1, 2).reshape(blocks * width, steps)[: self.out_features]

        def plain(t: torch.Tensor) -> torch.Tensor:
            return t.transpose(1, 2).reshape(blocks * width, -1)[: self.out_features]

        return dequantize(rows, plain(self.scales), plain(self.offsets))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits} in groups of {GROUP}"


def quantized_linears(model: nn.Module, bits: int) -> int:
    """Swap every plain ``nn.Linear`` of ``model`` (the output layer included) for a ``QuantizedLinear``; returns how
    many. A linear whose inputs are not a multiple of 32 stays as it is."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.in_features % GROUP == 0:
                setattr(parent, name, QuantizedLinear(child, bits))
                swapped += 1
    return swapped


def packed_bytes(module: nn.Module) -> int:
    """What a model's quantized linears hold: packed weights, scales and offsets."""
    return sum(
        sum(t.numel() * t.element_size() for t in (m.packed, m.scales, m.offsets))
        for m in module.modules()
        if isinstance(m, QuantizedLinear)
    )
