"""Which weight-only product to build 4-bit deployments on: PyTorch's own int4 packed matmul against the products
depctl runs today, on the packaged models' matrix shapes.

    .venv/bin/python benchmarks/int4_kernels.py                       # SmolLM2-135M and Qwen2.5-Coder-1.5B shapes
    .venv/bin/python benchmarks/int4_kernels.py --model smollm2 --rows 1,8 --group-size 32,128

A decode step reads every weight once, so on a CPU a product's cost is mostly bytes. For each shape and row count
the table gives microseconds per product (median of interleaved runs) and the weight bytes read per microsecond
(GB/s) of:
- ``blocked f32``: depctl's own float32 product (``BlockedLinear``), what an AVX2 CPU runs today;
- ``blocked bf16``: the same in bf16, where the CPU has AVX-512 BF16;
- ``int8 bf16``: ``torch._weight_int8pack_mm``, depctl's ``--quantization int8`` today;
- ``int4 gN bf16``: ``torch.ops.aten._weight_int4pack_mm_for_cpu`` with group size N, bf16 activations;
- ``depctl int4 f32`` / ``depctl int8 f32`` (and ``bf16``): depctl's own grouped product (``QuantizedLinear``: groups
  of 32, fp16 scale and offset), what ``--quantization int4`` / ``int8`` run.
``invariant`` says whether row 0's bits stay the same whatever the number of rows in the product (1 to 16), which
speculation's exactness needs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from depctl_runtime.kernels import native  # noqa: E402
from depctl_runtime.kernels.quantized import QuantizedLinear, packed_bytes  # noqa: E402
from depctl_runtime.kernels.surgery import BlockedLinear, quantize_rows  # noqa: E402

# (name, out features, in features) of one decoder layer's products and the output layer
SHAPES = {
    "smollm2": [
        ("qkv", 960, 576),
        ("o", 576, 576),
        ("gate_up", 3072, 576),
        ("down", 576, 1536),
        ("lm_head", 49152, 576),
    ],
    "qwen1.5b": [
        ("qkv", 2048, 1536),
        ("o", 1536, 1536),
        ("gate_up", 17920, 1536),
        ("down", 1536, 8960),
        ("lm_head", 151936, 1536),
    ],
}


def int4_pack(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit per group of ``group`` inputs, in the layout torch's CPU kernel takes: the packed weight and
    ``scales_and_zeros`` [in / group, out, 2] (w ~= (q - 8) * scale + zero)."""
    out_f, in_f = weight.shape
    w = weight.float().reshape(out_f, in_f // group, group)
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = (high - low).clamp(min=1e-8) / 15
    q = ((w - low) / scale).round().clamp(0, 15).to(torch.int32).reshape(out_f, in_f)
    zero = low + 8 * scale
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scales_and_zeros = torch.stack([scale.squeeze(-1).t(), zero.squeeze(-1).t()], -1).contiguous()
    return packed, scales_and_zeros


def products(out_f: int, in_f: int, groups: list[int]) -> dict:
    """name -> (callable on x, activation dtype, weight bytes)."""
    weight = torch.randn(out_f, in_f) / in_f**0.5
    linear = nn.Linear(in_f, out_f, bias=False)
    linear.weight.data = weight
    found = {}
    if native.available():
        blocked = BlockedLinear(linear)
        found["blocked f32"] = (blocked, torch.float32, out_f * in_f * 4)
        if native.blocked_supports(torch.bfloat16):
            bf16 = nn.Linear(in_f, out_f, bias=False).to(torch.bfloat16)
            bf16.weight.data = weight.to(torch.bfloat16)
            found["blocked bf16"] = (BlockedLinear(bf16), torch.bfloat16, out_f * in_f * 2)
        for bits in (4, 8):
            ours = QuantizedLinear(linear, bits)
            found[f"depctl int{bits} f32"] = (ours, torch.float32, packed_bytes(ours))
            if native.blocked_supports(torch.bfloat16):
                found[f"depctl int{bits} bf16"] = (ours, torch.bfloat16, packed_bytes(ours))
    else:
        found["torch f32"] = (linear, torch.float32, out_f * in_f * 4)
    q8, s8 = quantize_rows(weight, torch.bfloat16)
    found["int8 bf16"] = (lambda x: torch._weight_int8pack_mm(x, q8, s8), torch.bfloat16, out_f * in_f)
    for group in (g for g in groups if in_f % g == 0):
        packed, sz = int4_pack(weight, group)
        sz = sz.to(torch.bfloat16)
        found[f"int4 g{group} bf16"] = (
            lambda x, p=packed, g=group, z=sz: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, g, z),
            torch.bfloat16,
            out_f * in_f // 2 + sz.numel() * 2,
        )
    return found


def invariant(fn, dtype: torch.dtype, in_f: int) -> bool:
    x = torch.randn(16, in_f).to(dtype)
    alone = fn(x[:1])[0]
    return all(torch.equal(fn(x[:m])[0], alone) for m in range(2, 17))


def measure(fns: dict, rows: int, in_f: int, runs: int) -> dict:
    """Median microseconds per product, the products interleaved run by run so a noisy moment hits all of them."""
    inputs = {name: torch.randn(rows, in_f).to(dtype) for name, (_, dtype, _) in fns.items()}
    times = {name: [] for name in fns}
    for _ in range(3):
        for name, (fn, _, _) in fns.items():
            fn(inputs[name])
    for _ in range(runs):
        for name, (fn, _, _) in fns.items():
            t0 = time.perf_counter()
            fn(inputs[name])
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2,qwen1.5b", help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--rows", default="1,8,16", help="rows per product: 1 a plain step, 8-16 a verify pass")
    parser.add_argument("--group-size", default="32,64", help="inputs per scale (those that divide a shape)")
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    groups = [int(g) for g in args.group_size.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}")
    print("| model | product | out x in | rows | kernel | us | GB/s | invariant |")
    print("|---|---|---|---|---|---|---|---|")
    for model in args.model.split(","):
        for name, out_f, in_f in SHAPES[model]:
            fns = products(out_f, in_f, groups)
            same = {k: invariant(fn, dtype, in_f) for k, (fn, dtype, _) in fns.items()}
            for rows in (int(r) for r in args.rows.split(",")):
                for kernel, us in measure(fns, rows, in_f, args.runs).items():
                    gbps = fns[kernel][2] / us / 1e3
                    print(
                        f"| {model} | {name} | {out_f}x{in_f} | {rows} | {kernel} | {us:.0f} | {gbps:.1f} | "
                        f"{'yes' if same[kernel] else 'NO'} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
