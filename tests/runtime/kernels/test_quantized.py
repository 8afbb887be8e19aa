"""depctl's 4- and 8-bit grouped linears (depctl_runtime.kernels.quantized, csrc/quantized_linear.cpp)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from depctl_runtime.kernels.quantized import (
    GROUP,
    QuantizedLinear,
    dequantize,
    packed_bytes,
    quantize,
    quantized_linears,
)
from depctl_runtime.kernels.surgery import products

pytestmark = pytest.mark.usefixtures("native_ops")


@pytest.mark.parametrize("bits, worst", [(4, 0.1), (8, 0.005)])
def test_quantize_fits_each_group_no_worse_than_its_min_max_grid(bits, worst):
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    q, scales, offsets = quantize(w, bits)
    assert q.dtype == torch.uint8 and int(q.max()) <= (1 << bits) - 1
    assert scales.shape == offsets.shape == (48, 96 // GROUP) and scales.dtype == torch.float16
    error = (dequantize(q, scales, offsets) - w).reshape(48, -1, GROUP).square().sum(-1)
    groups = w.reshape(48, -1, GROUP)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    step = ((high - low) / ((1 << bits) - 1)).half().float()  # the start's grid, stored in fp16
    low = low.half().float()
    levels = torch.round((groups - low) / step).clamp(0, (1 << bits) - 1)
    min_max = (levels * step + low - groups).square().sum(-1)
    assert (error <= min_max + 1e-7).all()  # least squares only ever improves on the min-max start
    assert (error.sum() / w.square().sum()).sqrt().item() < worst


def test_a_weight_already_on_a_4_bit_grid_comes_back_exactly():
    # a dequantized GGUF Q4 tensor: every group is scale * q + offset with 16 levels, scale and offset in fp16
    g = torch.Generator().manual_seed(1)
    levels = torch.randint(0, 16, (16, 64), generator=g)
    levels[:, ::GROUP] = 0  # each group spans its whole grid, as a fitted quantizer's groups do
    levels[:, 1::GROUP] = 15
    scale = torch.rand(16, 2, generator=g).half().float().repeat_interleave(GROUP, 1)
    offset = -torch.rand(16, 2, generator=g).half().float().repeat_interleave(GROUP, 1)
    w = levels * scale + offset
    q, scales, offsets = quantize(w, 4)
    assert torch.equal(dequantize(q, scales, offsets), w)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_product_is_the_dequantized_linear_and_a_row_never_depends_on_the_pass(bits, dtype):
    torch.manual_seed(0)
    linear = nn.Linear(96, 70, bias=True)  # 70 outputs: the last block is partial
    q = QuantizedLinear(linear, bits)
    x = torch.randn(21, 96).to(dtype)
    y = q(x)
    assert y.dtype == dtype and y.shape == (21, 70)
    reference = nn.functional.linear(x.float(), q.dequantized(), linear.bias.float())
    # 4 bits round each row's inputs to int8 per group inside the product (as llama.cpp does): ~1% of a row's scale
    tolerance = 0.02 if bits == 4 or dtype == torch.bfloat16 else 1e-5
    assert (y.float() - reference).abs().max() <= tolerance * reference.abs().max()
    alone = torch.cat([q(x[i : i + 1]) for i in range(21)])
    for rows in range(1, 22):  # a row's bits, alone and beside any number of other rows
        assert torch.equal(q(x[:rows]), alone[:rows]), rows
    assert torch.equal(q(x.flip(0)), alone.flip(0))


def test_packing_keeps_the_weights():
    linear = nn.Linear(64, 19, bias=False)
    for bits in (4, 8):
        q = QuantizedLinear(linear, bits)
        expected = dequantize(*quantize(linear.weight, bits))
        assert torch.equal(q.dequantized(), expected)
    assert packed_bytes(QuantizedLinear(nn.Linear(64, 32), 4)) == 32 * 64 // 2 + 2 * 2 * 32 * 2  # q, scales, offsets


def test_quantized_linears_swaps_the_linears_the_groups_fit():
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8), nn.Linear(8, 4))
    assert quantized_linears(model, 4) == 2
    assert isinstance(model[0], QuantizedLinear) and isinstance(model[2], QuantizedLinear)
    assert type(model[3]) is nn.Linear  # 8 inputs: not a whole group
    assert products(model) == "depctl int4 grouped x2, torch linear x1"


def test_bad_operands_are_refused_with_the_reason():
    q = QuantizedLinear(nn.Linear(64, 16), 4)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.depctl_native.quantized_linear(torch.randn(1, 48), q.packed, q.scales, q.offsets, 16, 4)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        q(torch.randn(1, 64).half())
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantizedLinear(nn.Linear(40, 8), 4)
