"""Compiled decode and verify passes (depctl_runtime.model.compiled): exact, shared weights, one graph, cached."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from depctl_runtime.backends.passes import COMPILED_PRECISIONS
from depctl_runtime.backends.precision import INT4_WEIGHTS, INT8_WEIGHTS, surgery_for
from depctl_runtime.kernels import native
from depctl_runtime.kernels.surgery import onednn_row_invariant
from depctl_runtime.model import compiled
from depctl_runtime.model.runner import ModelRunner
from tests.driving import assert_speculation_is_exact
from tests.tiny import tiny_llama

pytestmark = pytest.mark.slow  # AOTInductor builds: tens of seconds each

RUNS = {  # the precisions the loader compiles, and what each needs of this CPU
    INT8_WEIGHTS: (),  # depctl's grouped products (kernels.quantized): row-invariant by construction
    INT4_WEIGHTS: (),
    "float32": (),  # depctl's blocked product (surgery.BlockedLinear): row-invariant on any CPU, by construction
    "bfloat16": pytest.mark.skipif(
        not (native.blocked_supports(torch.bfloat16) or onednn_row_invariant(torch.bfloat16)),
        reason="no blocked bf16 product (AVX-512 BF16) and no row-invariant oneDNN bf16 linear here: bf16 takes "
        "split-K linears, eager",
    ),
}
PRECISIONS = [pytest.param(p, marks=RUNS[p], id=p.replace(" ", "-")) for p in COMPILED_PRECISIONS]


def prepared(model, precision: str):
    """What the loader makes of a model at ``precision``: fused projections, then int8 or int4 weights (float32
    activations), float32 and bf16 through depctl's blocked product (bf16 where the CPU has AVX-512 BF16, else
    oneDNN's)."""
    dtype = torch.bfloat16 if precision == "bfloat16" else torch.float32
    return surgery_for(model.to(dtype), precision, exact=True)


def runner_for(model, rows: int = 3) -> ModelRunner:
    runner = ModelRunner(model, max_rows=rows)
    runner.forward(0, [[0]], prefill=True)  # allocates the cache (as the loader does before it compiles)
    runner.set_length(0, 0)
    return runner


@pytest.fixture(scope="module", params=PRECISIONS)
def package(request, tmp_path_factory):
    """One build per precision for the module: a minute or less on two cores for the tiny model. Returns the
    package and a function making a fresh model that the package fits."""
    precision = request.param
    make = lambda: prepared(tiny_llama(), precision)  # noqa: E731
    model = make()
    path = compiled.package_path(model, precision, tmp_path_factory.mktemp("compiled"))
    compiled.build(model, runner_for(model).cache, path)
    return path, make


def compiled_runner(package, rows: int = 3, model=None) -> ModelRunner:
    path, make = package
    model = model or make()
    runner = runner_for(model, rows)
    runner.fast_pass = compiled.CompiledPass(path, model)
    return runner


def test_the_package_is_keyed_by_what_the_code_depends_on_not_by_where_the_weights_are(tmp_path):
    a, b = prepared(tiny_llama(), INT8_WEIGHTS), prepared(tiny_llama(), INT8_WEIGHTS)
    assert compiled.package_path(a, INT8_WEIGHTS, tmp_path) == compiled.package_path(b, INT8_WEIGHTS, tmp_path)
    wider = prepared(tiny_llama(hidden=128), INT8_WEIGHTS)
    assert compiled.package_path(wider, INT8_WEIGHTS, tmp_path) != compiled.package_path(a, INT8_WEIGHTS, tmp_path)
    full = prepared(tiny_llama(), "float32")
    assert compiled.package_path(full, "float32", tmp_path) != compiled.package_path(a, INT8_WEIGHTS, tmp_path)


def test_the_compiled_pass_computes_what_the_eager_pass_computes(package):
    model = package[1]()
    eager, fast = runner_for(model), compiled_runner(package, model=model)
    prompt = [5, 9, 14, 3, 7, 7, 2]
    for runner in (eager, fast):
        runner.forward(0, [prompt], prefill=True)
    a = eager.forward(0, [[4, 8, 15]]).float()
    b = fast.forward(0, [[4, 8, 15]]).float()
    # fused kernels round differently from eager ops, so not bit for bit: the same function
    assert torch.allclose(a, b, atol=0.1, rtol=0.05), (a - b).abs().max()
    top2 = a.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 0.1  # a random bf16 model has near-ties that rounding may flip
    assert torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear])


def test_a_pass_that_wants_each_rows_last_token_runs_compiled(package, monkeypatch):
    """A draft model catching up feeds one or more tokens a row and wants only each row's last logits: eager, that
    pass cost a 0.5B int4 draft 50% more than the same forward through its library."""
    runner = compiled_runner(package)
    for row, p in enumerate([[3, 1, 4], [9, 2], [5, 3, 5, 8]]):
        runner.forward(row, [p], prefill=True)
    lengths = [runner.length(r) for r in range(3)]

    def eager(*args):
        raise AssertionError("the eager pass ran")

    monkeypatch.setattr(runner, "_forward", eager)
    last = runner.forward(0, [[2, 7], [1], [8, 1, 8]], last_only=True)
    for r, n in enumerate(lengths):
        runner.set_length(r, n)
    full = runner.forward(0, [[2, 7], [1], [8, 1, 8]])
    assert last.shape[0] == 3 and torch.equal(last, full[[1, 2, 5]])


def test_it_borrows_the_models_weights_and_the_package_holds_none(package):
    model = package[1]()
    runner = compiled_runner(package, model=model)
    runner.forward(0, [[1, 2, 3]], prefill=True)
    before = runner.forward(0, [[4]])
    with torch.no_grad():  # a change to the model's own tensor is seen by the compiled pass: it reads that tensor
        model.model.norm.weight.mul_(2)  # the final norm's scale: every logit doubles
    runner.set_length(0, 3)
    after = runner.forward(0, [[4]])
    assert torch.allclose(after.float(), before.float() * 2, rtol=0.02, atol=0.02)
    assert package[0].stat().st_size < 2_000_000  # code only: the weights are not in it


def test_a_weight_one_library_borrowed_keeps_its_storage_when_another_borrows_it(package):
    # a library reads the data pointers it was given at load: a borrowed weight given new storage afterwards (as the
    # next library gave one that had turned unresizable) left the first reading freed memory
    model = package[1]()
    runner = compiled_runner(package, model=model)
    runner.forward(0, [[1, 2, 3]], prefill=True)
    before = runner.forward(0, [[4]])
    weights = [t for t in model.parameters() if not t.is_mkldnn and t.is_contiguous()]
    pointers = [t.data_ptr() for t in weights]
    for tensor in weights:  # a numpy view of a tensor makes its storage unresizable
        tensor.detach().view(-1).view(torch.uint8).numpy()
    another = compiled.CompiledPass(package[0], model)
    assert [t.data_ptr() for t in weights] == pointers
    runner.set_length(0, 3)
    assert torch.equal(runner.forward(0, [[4]]), before)
    another.release()


def test_a_verify_pass_is_bit_identical_to_one_token_steps_alone_batched_and_ragged(package):
    runner = compiled_runner(package)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7]]
    for row, p in enumerate(prompts):
        runner.forward(row, [p], prefill=True)
    drafts = [[2, 7, 1, 8], [2], [8, 1, 8]]

    def reset():
        for row, p in enumerate(prompts):
            runner.set_length(row, len(p))

    steps = []
    for row, d in enumerate(drafts):
        reset()
        steps.append(torch.cat([runner.forward(row, [[t]]) for t in d]))
    reset()
    ragged = runner.forward(0, drafts)  # every row's drafts in one pass
    offsets = [0, 4, 5, 8]
    for row in range(3):
        assert torch.equal(ragged[offsets[row] : offsets[row + 1]], steps[row]), f"row {row}"
    reset()
    alone = runner.forward(0, [drafts[0]])
    assert torch.equal(alone, steps[0])
    assert compiled.check(runner)


def test_speculation_through_the_compiled_pass_is_exact_against_plain_decoding_through_it(package):
    model = package[1]()
    assert_speculation_is_exact(compiled_runner(package, model=model))


def test_another_instance_serves_a_runner_with_a_cache_of_its_own_beside_the_first(package):
    """A learning head's idle answers run through the deployment's library with a cache of their own: passes on
    either leave the other's rows as they were, and both compute what the first alone does."""
    model = package[1]()
    first = compiled_runner(package, model=model)
    second = runner_for(model, rows=2)
    second.fast_pass = first.fast_pass.another()
    prompt, steps = [5, 9, 14, 3], [[4], [8], [15]]
    first.forward(0, [prompt], prefill=True)
    alone = torch.cat([first.forward(0, [s]) for s in steps])
    first.set_length(0, len(prompt))
    second.forward(1, [prompt], prefill=True)
    interleaved, other = [], []
    for s in steps:  # the two runners' passes in turn, as a step and an idle piece
        interleaved.append(first.forward(0, [s]))
        other.append(second.forward(1, [s]))
    assert torch.equal(torch.cat(interleaved), alone) and torch.equal(torch.cat(other), alone)
    assert second.cache.layers[0].keys.shape[0] == 2 and first.length(0) == second.length(1) == len(prompt) + 3
    second.fast_pass.release()


def test_the_cache_may_grow_under_it(package):
    """Capacity is symbolic: a row that outgrows the cache's first allocation keeps running the same library."""
    runner = compiled_runner(package, rows=1)
    capacity = runner.cache.capacity
    runner.forward(0, [list(range(1, capacity - 2))], prefill=True)
    before = runner.cache.layers[0].keys.shape[2]
    for t in range(8):
        runner.forward(0, [[t + 1, t + 2]])
    assert runner.cache.layers[0].keys.shape[2] > before


def test_other_python_threads_run_while_a_pass_does(package):
    """The daemon's event loop streams, reads requests and answers health checks while the engine thread is inside a
    pass. torch's own loader keeps the GIL for the whole pass (a thread sleeping 0.2 ms woke only when a 6 ms pass
    ended), so here a thread that takes the GIL every millisecond must get it while a pass runs: with the GIL held,
    none of its wake-ups could fall inside a pass."""
    runner = compiled_runner(package, rows=1)
    runner.forward(0, [[(7 * i) % 200 for i in range(300)]], prefill=True)
    woke, stop = [], threading.Event()

    def wake_every_millisecond():
        while not stop.is_set():
            time.sleep(0.001)
            woke.append(time.perf_counter())  # only with the GIL

    passes, library = [], runner.fast_pass

    class Timed(compiled.CompiledPass):
        def __init__(self):
            pass

        def __call__(self, *args):  # the library call alone: around it the engine's own Python may yield the GIL
            t0 = time.perf_counter()
            out = library(*args)
            passes.append((t0, time.perf_counter()))
            return out

    runner.fast_pass = Timed()
    thread = threading.Thread(target=wake_every_millisecond)
    thread.start()
    try:
        while sum(t1 - t0 for t0, t1 in passes) < 0.2 and len(passes) < 500:
            runner.set_length(0, 300)
            runner.forward(0, [[(3 * i) % 200 for i in range(150)]])  # 150 tokens over 300+ positions: ~1.5 ms
    finally:
        stop.set()
        thread.join()
    inside = [t for t in woke if any(t0 + 0.0002 < t < t1 for t0, t1 in passes)]
    # torch's loader: 0 of 68 wake-ups inside 68 such passes; this one: 30 of 98
    assert inside, f"no wake-up inside {len(passes)} passes ({sum(t1 - t0 for t0, t1 in passes) * 1000:.0f} ms)"


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_qwen2_with_biases_and_tied_embeddings_compiles_and_checks_exact(tmp_path, precision):
    """The architecture of the real draft/target pair: q, k and v biases in the fused projection, the output layer
    tied to the embeddings (two tensors once the output layer is int8; in float32 one tensor under two names)."""
    from tests.tiny import tiny_qwen2

    model = prepared(tiny_qwen2(), precision)
    eager = runner_for(model)
    package = compiled.package_path(model, precision, tmp_path)
    compiled.build(model, eager.cache, package)
    fast = runner_for(model)
    fast.fast_pass = compiled.CompiledPass(package, model)
    assert compiled.check(fast)
    for runner in (eager, fast):
        runner.forward(0, [[7, 3, 9, 1]], prefill=True)
    a, b = eager.forward(0, [[2, 5]]).float(), fast.forward(0, [[2, 5]]).float()
    assert torch.allclose(a, b, atol=0.1, rtol=0.05) and torch.equal(a.argmax(-1), b.argmax(-1))
