"""Model surgery for CPU inference, applied by the loader explicitly, as module swaps a benchmark can leave out.

- ``blocked_linears(model, dtype)``: float32 linears, and bf16 ones on a CPU with AVX-512 BF16 (AMX tiles where it
  has them), through our own product (``BlockedLinear``, ``csrc/blocked_linear.cpp``): row-invariant by construction
  and faster than oneDNN's; where depctl's C++ ops cannot be built, the loader takes ``onednn_linears`` instead.
- ``products(model)``: what computes a model's products after the surgery, as ``deployment get`` shows it.
- ``onednn_linears(model, dtype)``: bfloat16 (or, without our C++ ops, float32) linears through oneDNN, never fewer
  than two rows a product: faster than MKL for few rows, exact under speculation (``OneDNNLinear``), and they compile.
- ``weight_major_linears(model)``: the float32 fallback where neither ours nor a row-invariant oneDNN is here: every
  ``nn.Linear`` becomes a ``WeightMajorLinear`` (same weights, shared, not copied) that computes ``(W @ x^T)^T`` for a
  few rows, so that verifying k drafts costs close to one step.
- ``int8_linears(model)``: dynamic int8 linears (a draft model only: its numerics never reach the output).
- ``int8_weight_linears(model)``: PyTorch's weight-only int8 (one scale per output channel, bf16 activations), for
  ``--quantization int8`` where depctl's C++ ops (``kernels.quantized``) cannot be built; exact under speculation.
- ``split_k_linears(model, chunk)``: for bfloat16/float16 on a CPU where oneDNN's linear is not row-invariant,
  every ``nn.Linear`` whose inner dimension is longer than ``chunk`` becomes a ``SplitKLinear``, so that a row's
  product does not depend on how many rows share the pass (``row_invariant_chunk`` measures ``chunk`` on this CPU).
  Without it a bf16 target verifying k drafts does not reproduce the same target decoding one token at a time, and
  speculation would not be exact.

None changes what a model *is* (its config, its weights); each returns how many modules it swapped.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
from torch import nn

from depctl_runtime.kernels.quantized import QuantizedLinear

WEIGHT_MAJOR_MAX_ROWS = 64  # past this (a prefill chunk), F.linear's GEMM is the faster


class WeightMajorLinear(nn.Linear):
    """``nn.Linear`` computed as ``(W @ x^T)^T`` for up to ``WEIGHT_MAJOR_MAX_ROWS`` rows.

    Why: on a CPU, ``F.linear`` for a handful of rows (a verify pass over k + 1 tokens, a small batch) takes an MKL
    GEMM path that costs nearly 2x a single-row step; the weight-major product stays close to the one-row cost.
    ``x`` is made row-major first: a transposed view (what the MLP's ``silu(gate) * up`` inherits from the previous
    weight-major output) takes a far slower path.
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


class OneDNNLinear(nn.Module):
    """An ``nn.Linear`` through oneDNN's linear (``torch.ops.mkldnn._linear_pointwise``, what inductor calls), float32
    or bfloat16, with at least two rows in every product.

    Why: MKL's single-row float32 product reads weights far slower than oneDNN's. oneDNN rounds one row
    differently from two or more (a separate single-row kernel), but gives a row the same bits for any row count from
    two on (``onednn_row_invariant`` checks this on the machine, per dtype; in bf16 it holds where ``F.linear``'s
    matmul does not, so no split-K is needed). So every product gets one more row, a copy of the first, whose result
    is dropped: every pass, a plain step or a verify, then rounds a row the same way, and speculation stays exact.
    The extra row is added unconditionally rather than only for one-row products, so the forward has no branch on
    the row count and traces into one graph (``depctl_runtime.model.compiled``) that calls oneDNN directly.

    The weight is reordered once, here, into oneDNN's blocked layout (``_reorder_linear_weight``), and that is the only
    copy kept (a ``weight`` buffer; the plain one goes with the module it came from): given a plain weight, oneDNN
    reorders it on every call. Same bits as the plain weight, for every row count, and faster. An output layer tied to
    the embeddings gets its own reordered copy (the embedding lookup keeps the plain table).
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_size=2)
        self.register_buffer("weight", packed, persistent=False)  # [out, in], oneDNN's opaque layout
        self.bias = linear.bias  # the same Parameter: no copy

    @classmethod
    def of(cls, weight: torch.Tensor) -> "OneDNNLinear":
        """Over ``weight`` [out, in], with no bias (and no ``nn.Linear`` to initialise first)."""
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        linear.weight = nn.Parameter(weight, requires_grad=False)
        return cls(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        flat = x.reshape(-1, self.in_features)
        rows = flat.shape[0]
        y = torch.ops.mkldnn._linear_pointwise(torch.cat([flat, flat[:1]]), self.weight, self.bias, "none", [], "")
        return y[:rows].reshape(*x.shape[:-1], self.out_features)


class BlockedLinear(nn.Module):
    """An ``nn.Linear`` in float32 or bfloat16 through ``depctl_native::blocked_linear``: its weight stored in blocks
    of output features (the only copy kept; the plain one goes with the module it came from), each output one chain
    of fused multiply-adds (bf16: dot products of pairs) over the inner dimension in order, so a row's result is the
    same bits whatever else is in the pass and speculation over the model stays exact. Faster than oneDNN's linear
    for one row and for a prompt chunk; bf16 needs AVX-512 BF16 (``native.blocked_supports``) and takes AMX tiles
    where the CPU has them.
    A plain tensor, so it traces into a compiled pass as it is. The op needs depctl's C++ ops loaded
    (``native.load``)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.depctl_native.pack_blocked(linear.weight.detach())
        self.register_buffer("weight", packed, persistent=False)  # [blocks, in, block width]
        self.bias = linear.bias  # the same Parameter: no copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        y = torch.ops.depctl_native.blocked_linear(x.reshape(-1, self.in_features), self.weight, self.out_features)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def blocked_linears(model: nn.Module, dtype: torch.dtype = torch.float32) -> int:
    """Swap every plain ``nn.Linear`` of ``model`` whose weight is ``dtype`` for a ``BlockedLinear`` over the same
    weights."""
    return _swap(model, lambda m: type(m) is nn.Linear and m.weight.dtype == dtype, BlockedLinear)


@contextmanager
def plain_stand_ins(model: nn.Module):
    """Inside: every ``OneDNNLinear``'s weight is an uninitialised plain tensor of its shape, for ``torch.export``,
    which
    cannot trace oneDNN's opaque tensors. The compiled library is built without its constants and borrows the
    reordered weights at load (``depctl_runtime.model.compiled``): oneDNN's linear takes either. The stand-ins cost the
    weights' size in memory while a library is built (once per model and precision); a zero-stride stand-in would
    cost nothing, but the library then read it as a plain tensor (wrong logits: the compiled-vs-eager test caught
    it), and the meta device does not mix with the model's other tensors in a trace."""
    linears = [m for m in model.modules() if isinstance(m, OneDNNLinear)]
    packed = [m.weight for m in linears]
    try:
        for m, w in zip(linears, packed):
            m.weight = torch.empty(w.shape, dtype=w.dtype)
        yield
    finally:
        for m, w in zip(linears, packed):
            m.weight = w


def plain_stand_in_bytes(model: nn.Module) -> int:
    """What ``plain_stand_ins`` allocates for ``model``: its oneDNN linears' weights, in their dtype."""
    return sum(m.weight.shape.numel() * m.weight.dtype.itemsize for m in model.modules() if isinstance(m, OneDNNLinear))


@functools.cache
def onednn_row_invariant(dtype: torch.dtype = torch.float32, max_rows: int = 96) -> bool:
    """Whether this torch build has oneDNN's linear for ``dtype`` and it gives a row the same result with 2 to
    ``max_rows`` rows in the product (a row computed beside a copy of itself being the reference), for the inner
    dimensions of small and large models. Measured once per process and dtype (~1 s)."""
    ok = torch.backends.mkldnn.is_available() and all(
        hasattr(torch.ops.mkldnn, op) for op in ("_linear_pointwise", "_reorder_linear_weight")
    )
    try:
        g = torch.Generator().manual_seed(0)
        for n, k in ((256, 576), (256, 1536), (128, 8960)) if ok else ():
            lin = nn.Linear(k, n, bias=False, dtype=dtype)
            lin.weight = nn.Parameter(torch.randn(n, k, generator=g).to(dtype), requires_grad=False)
            lin = OneDNNLinear(lin)
            x = torch.randn(max_rows, k, generator=g).to(dtype)
            alone = torch.cat([lin(x[i : i + 1]) for i in range(max_rows)])
            ok = ok and all(torch.equal(lin(x[:m]), alone[:m]) for m in range(2, max_rows + 1))
    except RuntimeError:  # the op exists but refuses this build's tensors or this dtype
        ok = False
    return bool(ok)


def onednn_linears(model: nn.Module, dtype: torch.dtype = torch.float32) -> int:
    """Swap every plain ``nn.Linear`` of ``model`` whose weight is ``dtype`` for a ``OneDNNLinear`` over the same
    weights."""
    return _swap(model, lambda m: type(m) is nn.Linear and m.weight.dtype == dtype, OneDNNLinear)


class SplitKLinear(nn.Module):
    """``nn.Linear`` whose result for a row is the same whatever the number of rows in the pass.

    Why: a CPU's bf16 GEMM (oneDNN) reduces the inner dimension in one block for a few rows and in several for more
    once that dimension is long (on one AVX-512-bf16 CPU: K = 1536 changes from 7 rows on; K <= 768 never
    does), so a verify pass over k + 1 tokens rounds differently from k + 1 single-token steps. Here the inner
    dimension is cut into fixed chunks no longer than what the CPU reduces the same way for any row count, each
    chunk's product is taken separately and the partial products are summed in float32 in a fixed order: the same
    arithmetic for every row count. The chunks are contiguous copies that replace the weight (no extra memory).
    """

    def __init__(self, linear: nn.Linear, chunk: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        self.bounds = list(range(0, self.in_features, chunk)) + [self.in_features]
        self.chunks = nn.ParameterList(
            [
                nn.Parameter(w[:, lo:hi].contiguous(), requires_grad=False)
                for lo, hi in zip(self.bounds, self.bounds[1:])
            ]
        )
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = None
        for (lo, hi), w in zip(zip(self.bounds, self.bounds[1:]), self.chunks):
            part = nn.functional.linear(x[..., lo:hi], w).float()
            out = part if out is None else out.add_(part)
        if self.bias is not None:
            out = out.add_(self.bias.float())
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, chunks={len(self.chunks)}"


class Int8WeightLinear(nn.Module):
    """``nn.Linear`` with int8 weights, one scale per output channel, and activations kept in ``act_dtype`` (bf16).

    Why: a decode step reads every weight once, so on a CPU its cost is bytes; int8 halves bf16's. The product is
    PyTorch's own weight-packed kernel (``torch._weight_int8pack_mm``: dequantizes a tile of int8 weights in
    registers, accumulates in float32). Its result for a row does not depend on how many rows share the pass (it
    computes rows
    in blocks of four with the same inner loop; ``int8_row_invariant`` checks it on this CPU), so a verify pass
    rounds as single-token steps do and speculation over this model stays exact. It wants bf16 activations:
    with float32 ones it takes a path 10-20x slower.

    The weight is quantized symmetrically per output row: ``scale = max|w| / 127`` rounded to ``act_dtype`` first, so
    that the stored scale is the one the int8 values were computed against.
    """

    def __init__(self, linear: nn.Linear, act_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        qweight, scales = quantize_rows(linear.weight.detach(), act_dtype)
        self.register_buffer("qweight", qweight)  # [out, in] int8
        self.register_buffer("scales", scales)  # [out] act_dtype
        self.bias = (
            None if linear.bias is None else nn.Parameter(linear.bias.detach().to(act_dtype), requires_grad=False)
        )
        self.prefill = (
            False  # inside ``prefill_pass``: a prompt chunk, which may take a faster, differently rounded path
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        flat = x.reshape(-1, self.in_features).to(self.scales.dtype).contiguous()
        if self.prefill and flat.shape[0] > PREFILL_DEQUANT_ROWS:
            # a prompt chunk: the kernel's cost grows with rows, while dequantizing once and taking bf16's GEMM does
            # not. Prompts prefill alike whether the request speculates or not, so exactness is untouched.
            weight = self.qweight.to(self.scales.dtype) * self.scales[:, None]
            y = nn.functional.linear(flat, weight)
        else:
            y = torch._weight_int8pack_mm(flat, self.qweight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-row, {self.scales.dtype}"


PREFILL_DEQUANT_ROWS = 8


@contextmanager
def prefill_pass(linears: list[nn.Module]):
    """The forward inside reads a prompt chunk (``ModelRunner.forward(prefill=True)``): ``linears`` may take a path
    that is faster for many rows but rounds differently from the decode path. Plain and speculative decoding read
    prompts alike, so this never touches exactness."""
    for linear in linears:
        linear.prefill = True
    try:
        yield
    finally:
        for linear in linears:
            linear.prefill = False


def quantize_rows(weight: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: ``weight ~= q * scale[:, None]``, q in [-127, 127] (int8), scale in
    ``scale_dtype``. Returns (q [out, in] int8, scale [out])."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny).to(scale_dtype)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale


def int8_weight_linears(model: nn.Module, act_dtype: torch.dtype = torch.bfloat16) -> int:
    """Swap every plain ``nn.Linear`` of ``model`` (the output layer included) for an ``Int8WeightLinear``."""
    return _swap(model, lambda m: type(m) is nn.Linear, lambda m: Int8WeightLinear(m, act_dtype))


@functools.cache
def int8_row_invariant(act_dtype: torch.dtype = torch.bfloat16, max_rows: int = 40) -> bool:
    """Whether this CPU's int8 weight kernel gives a row the same result with 1 to ``max_rows`` rows in the pass
    (random data, the inner dimensions of small and large models). Measured once per process."""
    g = torch.Generator().manual_seed(0)
    ok = True
    for n, k in ((256, 576), (256, 1536), (128, 8960)):
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        s = (torch.rand(n, generator=g) / 100).to(act_dtype)
        x = torch.randn(max_rows, k, generator=g).to(act_dtype)
        alone = torch.cat([torch._weight_int8pack_mm(x[i : i + 1], q, s) for i in range(max_rows)])
        ok = ok and all(torch.equal(torch._weight_int8pack_mm(x[:m], q, s), alone[:m]) for m in range(2, max_rows + 1))
    return ok


CHUNK_CANDIDATES = (2048, 1536, 1024, 896, 768, 640, 576, 512, 384, 256, 128)


@functools.cache
def row_invariant_chunk(dtype: torch.dtype, max_rows: int = 128) -> int | None:
    """The longest inner dimension for which this CPU's ``F.linear`` in ``dtype`` gives every row the same result
    with 1 to ``max_rows`` rows in the pass (checked on random data, all rows, every row count); None if even 128 is
    not. Measured once per process (~1 s): it depends on the CPU and the kernel library, not on the model."""
    return next((k for k in CHUNK_CANDIDATES if _row_invariant(k, dtype, max_rows)), None)


def _row_invariant(k: int, dtype: torch.dtype, max_rows: int, n: int = 1024) -> bool:
    g = torch.Generator().manual_seed(k)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(max_rows, k, generator=g).to(dtype)
    alone = torch.cat([nn.functional.linear(x[i : i + 1], w) for i in range(max_rows)])
    return all(torch.equal(nn.functional.linear(x[:m], w), alone[:m]) for m in range(2, max_rows + 1))


def products(model: nn.Module) -> str:
    """What computes ``model``'s matrix products after the surgery, for ``deployment get`` and the load log: e.g.
    "depctl blocked bf16 on AMX tiles x121" (a count per kernel, most used first)."""
    from collections import Counter

    names = Counter(name for name in map(_product_name, model.modules()) if name)
    return ", ".join(f"{name} x{count}" for name, count in names.most_common()) or "none"


def _product_name(module: nn.Module) -> str | None:
    if isinstance(module, BlockedLinear):
        kernel = torch.ops.depctl_native.blocked_kernel(module.weight.dtype)
        return "depctl blocked " + {
            "fma": "float32 (FMA)",
            "avx512-bf16": "bf16 (AVX-512 BF16)",
            "amx-bf16": "bf16 on AMX tiles",
        }.get(kernel, kernel)
    if isinstance(module, WeightMajorLinear):  # an nn.Linear too: before it
        return "weight-major"
    if type(module).__name__ == "Linear" and "dynamic" in type(module).__module__:  # torch.ao's dynamic int8
        return "torch dynamic int8"
    if isinstance(module, QuantizedLinear):
        return f"depctl int{module.bits} grouped"
    return {
        OneDNNLinear: "oneDNN",
        SplitKLinear: "oneDNN, split inner dimension",
        Int8WeightLinear: "torch int8 weight-packed",
        nn.Linear: "torch linear",
    }.get(type(module))


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


def split_k_linears(model: nn.Module, chunk: int) -> int:
    """Swap every ``nn.Linear`` of ``model`` with an inner dimension longer than ``chunk`` for a ``SplitKLinear``."""
    return _swap(model, lambda m: type(m) is nn.Linear and m.in_features > chunk, lambda m: SplitKLinear(m, chunk))


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
