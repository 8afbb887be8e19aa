"""The loader's model surgery: module swaps that keep a model's results while changing how a CPU computes them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from depctl_runtime.kernels.surgery import SplitKLinear, WeightMajorLinear, row_invariant_chunk, split_k_linears


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_split_k_linear_is_a_linear_whose_rows_do_not_depend_on_their_neighbours(dtype, bias):
    # the chunk is what this CPU's library keeps row-invariant (512 on an AVX-512-bf16 EPYC; on a Xeon with AMX no bf16
    # chunk is, and the loader never splits there): a fixed 512 failed on such a Xeon
    chunk = row_invariant_chunk(dtype)
    if chunk is None:
        pytest.skip(
            f"no inner dimension keeps this CPU's {dtype} linear row-invariant: the loader does not split-K here"
        )
    torch.manual_seed(0)
    linear = nn.Linear(1536, 320, bias=bias).to(dtype)
    split = SplitKLinear(linear, chunk)
    x = torch.randn(72, 1536).to(dtype)
    ref = (x.float() @ linear.weight.float().T + (linear.bias.float() if bias else 0)).to(dtype)
    y = split(x)
    assert y.dtype == dtype and y.shape == (72, 320)
    assert torch.allclose(y.float(), ref.float(), rtol=2e-2, atol=2e-1)
    alone = torch.cat([split(x[i : i + 1]) for i in range(72)])
    for m in range(1, 73):  # the same bits for a row, whatever else is in the pass
        assert torch.equal(split(x[:m]), alone[:m]), m
    assert torch.equal(split(x.view(8, 9, 1536)).view(72, 320), y)  # [batch, tokens, in] like a model's activations


def test_split_k_swaps_only_long_inner_dimensions_and_frees_the_original_weight():
    model = nn.Sequential(nn.Linear(512, 1536), nn.ReLU(), nn.Linear(1536, 512)).to(torch.bfloat16)
    before = sum(p.numel() for p in model.parameters())
    assert split_k_linears(model, 1024) == 1
    assert type(model[0]) is nn.Linear and isinstance(model[2], SplitKLinear)
    assert sum(p.numel() for p in model.parameters()) == before  # the chunks replace the weight
    assert len(model[2].chunks) == 2


def test_row_invariant_chunk_is_measured_once():
    chunk = row_invariant_chunk(torch.bfloat16)
    assert chunk is None or 128 <= chunk <= 2048
    assert row_invariant_chunk(torch.bfloat16) == chunk


def test_weight_major_linear_keeps_the_weights():
    linear = nn.Linear(64, 32)
    wm = WeightMajorLinear.wrap(linear)
    assert wm.weight is linear.weight
    x = torch.randn(5, 64)
    assert torch.allclose(wm(x), linear(x), atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_int8_weight_linear_is_close_to_the_linear_and_row_invariant(bias):
    from depctl_runtime.kernels.surgery import Int8WeightLinear, int8_row_invariant

    torch.manual_seed(0)
    linear = nn.Linear(576, 320, bias=bias)
    q = Int8WeightLinear(linear, torch.bfloat16)
    assert q.qweight.dtype == torch.int8 and q.qweight.shape == (320, 576) and q.scales.dtype == torch.bfloat16
    # per output row, max |w| maps to 127: the dequantized weight is within half a step of the original
    step = q.scales.float()[:, None]
    assert (q.qweight.float() * step - linear.weight).abs().max() <= (step / 2 + 1e-3 * step).max()
    assert q.qweight.abs().amax(dim=1).min() >= 126
    x = torch.randn(40, 576)
    y = q(x.bfloat16())
    assert y.dtype == torch.bfloat16 and y.shape == (40, 320)
    ref = linear(x)
    assert (y.float() - ref).norm() / ref.norm() < 0.02
    assert torch.equal(q(x.bfloat16().view(5, 8, 576)).view(40, 320), y)  # [batch, tokens, in]
    if int8_row_invariant(torch.bfloat16):  # what the loader requires before it uses the kernel for a target
        alone = torch.cat([q(x[i : i + 1].bfloat16()) for i in range(40)])
        for m in range(1, 41):
            assert torch.equal(q(x[:m].bfloat16()), alone[:m]), m
    assert set(dict(q.named_buffers())) == {"qweight", "scales"}  # moved by .to(device), saved in a state dict


def test_int8_weight_linears_swaps_every_linear():
    from depctl_runtime.kernels.surgery import Int8WeightLinear, int8_weight_linears

    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)).to(torch.bfloat16)
    assert int8_weight_linears(model) == 2
    assert all(isinstance(model[i], Int8WeightLinear) for i in (0, 2))
    assert model(torch.randn(3, 64).bfloat16()).shape == (3, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_is_the_linear_and_rounds_a_row_alike_for_any_row_count(bias, dtype):
    from depctl_runtime.kernels.surgery import OneDNNLinear, onednn_row_invariant

    torch.manual_seed(0)
    linear = nn.Linear(1536, 320, bias=bias).to(dtype)
    x = torch.randn(40, 1536).to(dtype)
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN: the loader keeps weight-major or split-K linears")
    if dtype == torch.bfloat16 and not onednn_row_invariant(torch.bfloat16):
        pytest.skip("this CPU's oneDNN bf16 linear is not row-invariant (measured: a row rounds apart beside others)")
    fast = OneDNNLinear(linear)
    assert fast.weight.is_mkldnn and fast.bias is linear.bias  # the weight reordered once; the bias shared
    # the reordered weight gives the plain weight's bits
    plain = torch.ops.mkldnn._linear_pointwise(x[:7], linear.weight.detach(), linear.bias, "none", [], "")
    assert torch.equal(fast(x[:7]), plain)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fast(x).float(), linear(x).float(), rtol=tol, atol=tol)
    assert fast(x[:1]).shape == (1, 320) and fast(x.view(5, 8, 1536)).shape == (5, 8, 320)
    if onednn_row_invariant(dtype):  # what the loader requires before it uses it for a target
        alone = torch.cat([fast(x[i : i + 1]) for i in range(40)])
        for m in range(1, 41):
            assert torch.equal(fast(x[:m]), alone[:m]), m


@pytest.fixture(scope="module")
def native_ops():
    from depctl_runtime.kernels import native

    try:
        native.load()
    except native.NativeUnavailable as e:  # the loader then takes oneDNN's product (the test below checks that)
        pytest.skip(f"depctl's C++ ops cannot be built here: {e}")


KERNELS = [(torch.float32, "fma"), (torch.bfloat16, "avx512-bf16"), (torch.bfloat16, "amx-bf16")]


@pytest.fixture
def kernel(native_ops):
    """use(dtype, name): run the blocked product for ``dtype`` through kernel ``name`` for the rest of the test (a CPU
    with AMX runs both bf16 kernels, one at a time), or skip where this CPU does not have it."""
    from depctl_runtime.kernels import native

    def use(dtype, name):
        if not native.blocked_supports(dtype):
            pytest.skip(f"no blocked {dtype} product here (bf16 needs AVX-512 BF16): the loader takes oneDNN's")
        if dtype == torch.bfloat16 and torch.ops.depctl_native.blocked_refuse_amx(name != "amx-bf16") != name:
            pytest.skip("this CPU has no AMX (or Linux refused its tile registers): its bf16 product is vdpbf16ps")
        assert torch.ops.depctl_native.blocked_kernel(dtype) == name

    yield use
    torch.ops.depctl_native.blocked_refuse_amx(False)


@pytest.mark.parametrize("out_features, in_features", [(320, 1536), (37, 19), (5, 3), (1, 64), (48, 576)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype, name", KERNELS)
def test_blocked_linear_is_the_linear_and_rounds_a_row_alike_for_any_row_count(
    kernel, out_features, in_features, bias, dtype, name
):
    from depctl_runtime.kernels.surgery import BlockedLinear

    kernel(dtype, name)
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=bias).to(dtype)
    fast = BlockedLinear(linear)
    assert fast.bias is linear.bias  # shared, not copied
    x = torch.randn(40, in_features).to(dtype)
    y = fast(x)
    assert y.dtype == dtype
    # every output one float32 chain over the inner dimension: float64's product to rounding (bf16: of the result)
    product = x.double() @ linear.weight.double().T
    exact = product + (linear.bias.double() if bias else 0)
    if dtype == torch.float32:
        torch.testing.assert_close(y, exact.float(), rtol=1e-5, atol=1e-5 * in_features**0.5)
    else:  # rounded to bf16 at the end, and again adding the bias: within a bf16 unit of each term
        scale = product.abs() + (linear.bias.double().abs() if bias else 0)
        assert ((y.double() - exact).abs() <= scale * 2**-7 + 1e-6 * in_features**0.5).all()
    assert fast(x.view(5, 8, in_features)).shape == (5, 8, out_features) and fast(x[:0]).shape == (0, out_features)
    alone = torch.cat([fast(x[i : i + 1]) for i in range(40)])
    # the vector loops' tiles of 1 to 6 rows and every remainder, AMX's tiles of up to 16 and a zero-padded last one
    for m in range(1, 41):
        assert torch.equal(fast(x[:m]), alone[:m]), m  # the same bits for a row in each
    assert torch.equal(fast(x[7:19]), alone[7:19])  # and wherever it sits in the pass


@pytest.mark.parametrize("dtype, name", KERNELS)
def test_blocked_linear_spreads_a_product_over_torchs_threads_with_the_same_bits(kernel, dtype, name):
    from depctl_runtime.kernels.surgery import BlockedLinear

    kernel(dtype, name)
    torch.manual_seed(0)
    fast = BlockedLinear(nn.Linear(576, 3072, bias=False).to(dtype))
    x = torch.randn(9, 576).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fast(x)
        torch.set_num_threads(max(threads, 2))
        assert torch.equal(fast(x), one)  # a thread takes whole blocks of outputs: no sum is split between threads
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype, name", KERNELS[:2])
def test_the_weight_prefetch_changes_no_bit_and_is_chosen_by_vendor(kernel, dtype, name):
    from depctl_runtime.kernels.surgery import BlockedLinear

    kernel(dtype, name)
    ops = torch.ops.depctl_native
    chosen = ops.blocked_weight_prefetch(-1)
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():  # on by default, off where the CPU is an AMD one (its tiles of 2+ rows ran slower with it)
        assert chosen == ("AuthenticAMD" not in cpuinfo.read_text(errors="replace"))
    torch.manual_seed(0)
    fast = BlockedLinear(nn.Linear(576, 200, bias=False).to(dtype))
    x = torch.randn(13, 576).to(dtype)
    try:
        for m in range(1, 14):  # every tile height and remainder
            assert ops.blocked_weight_prefetch(1)
            on = fast(x[:m])
            assert not ops.blocked_weight_prefetch(0)
            assert torch.equal(fast(x[:m]), on), m
    finally:
        ops.blocked_weight_prefetch(int(chosen))
    assert ops.blocked_weight_prefetch(-1) == chosen


def test_blocked_linear_refuses_a_weight_it_did_not_pack(native_ops):
    from depctl_runtime.kernels.surgery import BlockedLinear

    fast = BlockedLinear(nn.Linear(64, 32))
    with pytest.raises(RuntimeError, match="pack_blocked"):
        torch.ops.depctl_native.blocked_linear(torch.randn(2, 64), torch.randn(32, 64), 32)
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.depctl_native.blocked_linear(torch.randn(2, 63), fast.weight, 32)
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.depctl_native.blocked_linear(torch.randn(2, 64).bfloat16(), fast.weight, 32)


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("ops_build", [True, False])
def test_the_float_surgery_is_picked_by_what_the_machine_does(monkeypatch, precision, ops_build):
    from depctl_runtime.backends.precision import surgery_for
    from depctl_runtime.kernels import native
    from depctl_runtime.kernels.surgery import BlockedLinear, OneDNNLinear, onednn_row_invariant, products

    dtype = getattr(torch, precision)
    if dtype == torch.bfloat16 and not onednn_row_invariant(dtype) and row_invariant_chunk(dtype) is None:
        pytest.skip("neither bf16 product is row-invariant on this CPU: the loader refuses a bf16 target here")
    if ops_build and not native.available():
        pytest.skip("depctl's C++ ops cannot be built here: the case without them is the other parameter")
    if not ops_build:
        monkeypatch.setattr(native, "available", lambda: False)
    model = nn.Sequential(nn.Linear(4096, 32)).to(dtype)  # longer than any split-K chunk
    model.config = None
    surgery_for(model, precision, exact=True)
    if ops_build and native.blocked_supports(dtype):
        assert isinstance(model[0], BlockedLinear)
        kernel = torch.ops.depctl_native.blocked_kernel(dtype)  # and `deployment get` says which loops run it
        assert (
            products(model)
            == {
                "fma": "depctl blocked float32 (FMA) x1",
                "amx-bf16": "depctl blocked bf16 on AMX tiles x1",
                "avx512-bf16": "depctl blocked bf16 (AVX-512 BF16) x1",
            }[kernel]
        )
        return
    fallback = WeightMajorLinear if dtype == torch.float32 else SplitKLinear
    assert isinstance(model[0], OneDNNLinear if onednn_row_invariant(dtype) else fallback)
    assert (
        products(model)
        == {
            OneDNNLinear: "oneDNN x1",
            WeightMajorLinear: "weight-major x1",
            SplitKLinear: "oneDNN, split inner dimension x1",
        }[type(model[0])]
    )


def test_products_names_each_kernel_once_per_product():
    from depctl_runtime.kernels.surgery import Int8WeightLinear, products

    model = nn.Sequential(
        nn.Linear(64, 64), Int8WeightLinear(nn.Linear(64, 32), torch.bfloat16), nn.ReLU(), nn.Linear(32, 8)
    )
    assert products(model) == "torch linear x2, torch int8 weight-packed x1"
    assert products(nn.ReLU()) == "none"


def test_int8_prompt_chunks_take_the_dequantized_path_only_inside_a_prefill_pass():
    from depctl_runtime.kernels import surgery
    from depctl_runtime.kernels.surgery import Int8WeightLinear, prefill_pass

    torch.manual_seed(0)
    q = Int8WeightLinear(nn.Linear(576, 320), torch.bfloat16)
    x = torch.randn(64, 576).bfloat16()
    kernel = q(x)
    with prefill_pass([q]):
        chunk = q(x)
        assert torch.equal(
            q(x[: surgery.PREFILL_DEQUANT_ROWS]), kernel[: surgery.PREFILL_DEQUANT_ROWS]
        )  # few rows: the kernel
    assert not torch.equal(chunk, kernel)  # another kernel: different last bits...
    assert (chunk.float() - kernel.float()).norm() / kernel.float().norm() < 0.01  # ...the same product
    assert torch.equal(q(x), kernel)  # the pass ended: decode and verify passes use the row-invariant kernel
    with pytest.raises(RuntimeError), prefill_pass([q]):
        raise RuntimeError("a failed forward")
    assert torch.equal(q(x), kernel)  # reset even when the forward raised
