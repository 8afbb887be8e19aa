"""depctl's C++ ops (depctl_runtime.kernels.native): built with torch's extension builder, the attention the eager pass
computes (to rounding), a token's bits independent of the rest of its pass, and a clear reason where they cannot be
built."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from depctl_runtime.kernels import native
from depctl_runtime.model.attention import RowLayout, rows_attention


@pytest.fixture(scope="module")
def op():
    try:
        native.load()
    except native.NativeUnavailable as e:  # the same condition under which the loader runs passes eagerly
        pytest.skip(f"depctl's C++ ops cannot be built here: {e}")
    return torch.ops.depctl_native.token_attention


def cache(rows=3, kv_heads=2, capacity=40, dim=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(rows, kv_heads, capacity, dim, generator=g).to(dtype),
        torch.randn(rows, kv_heads, capacity, dim, generator=g).to(dtype),
    )


def reference(query, keys, values, starts, widths, scale=0.25):
    """The eager attention of the same pass: every row alone, a verify pass position by position."""
    offsets = [0]
    for w in widths:
        offsets.append(offsets[-1] + w)
    layout = RowLayout(0, starts, widths, offsets, torch.device("cpu"), per_position=True)
    out, _ = rows_attention(None, query, keys, values, None, scaling=scale, depctl_rows=layout)
    return out


def stream(starts, widths):
    """rows and positions [T] of a pass where row b adds widths[b] tokens from position starts[b]."""
    rows = [b for b, w in enumerate(widths) for _ in range(w)]
    positions = [s + j for s, w in zip(starts, widths) for j in range(w)]
    return torch.tensor(rows), torch.tensor(positions)


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
DTYPES = pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["float32", "bfloat16", "float16"]
)
PASSES = pytest.mark.parametrize(
    "starts,widths",
    [([7], [1]), ([12], [9]), ([3, 20, 0], [1, 1, 1]), ([5, 30, 2], [4, 1, 6])],
    ids=["one-step", "verify-of-8", "batch-of-3", "ragged"],
)


@DTYPES
@PASSES
def test_it_computes_the_eager_attention_it_replaces(op, dtype, starts, widths):
    keys, values = cache(dtype=dtype)
    query = torch.randn(1, 4, sum(widths), 16).to(dtype)  # 4 heads over 2 kv heads: grouped-query
    rows, positions = stream(starts, widths)
    with torch.inference_mode():
        got = op(query, keys, values, rows, positions, 0.25)
        want = reference(query, keys, values, starts, widths)
    assert got.shape == (1, sum(widths), 4, 16) and got.is_contiguous() and got.dtype == dtype
    assert torch.allclose(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@DTYPES
@pytest.mark.parametrize(
    "heads,kv_heads,dim",
    [(18, 1, 20), (6, 6, 64), (14, 2, 64), (1, 1, 3), (2, 1, 72), (2, 2, 264)],
    ids=["18-heads-a-group-dim-20", "no-grouping", "7-a-group", "dim-3", "dim-72", "dim-264"],
)
def test_any_grouping_and_head_size(op, heads, kv_heads, dim, dtype):
    """Query heads go through in blocks of up to 8 a kv head, head dimensions in vectors plus a masked or scalar tail
    (heads over 256 wide by the loops without the 16-key blocks); rows long enough for several blocks of keys."""
    keys, values = cache(kv_heads=kv_heads, dim=dim, capacity=70, dtype=dtype)
    query = torch.randn(1, heads, 6, dim).to(dtype)
    starts, widths = [5, 50], [4, 2]
    rows, positions = stream(starts, widths)
    with torch.inference_mode():
        got = op(query, keys, values, rows, positions, dim**-0.5)
        want = reference(query, keys, values, starts, widths, scale=dim**-0.5)
    assert torch.allclose(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@DTYPES
@pytest.mark.parametrize("capacity", [40, 1100], ids=["one-thread", "threads"])
def test_a_tokens_result_does_not_depend_on_the_rest_of_the_pass(op, dtype, capacity):
    """What speculation's exactness rests on: a token rounds the same alone (a plain step), in a verify pass, beside
    other rows, on whichever thread (a pass with enough work is spread over the intra-op threads)."""
    keys, values = cache(capacity=capacity, dim=64, dtype=dtype)
    starts, widths = [capacity - 20, 3, capacity - 40], [9, 1, 5]
    query = torch.randn(1, 4, sum(widths), 64).to(dtype)
    rows, positions = stream(starts, widths)
    with torch.inference_mode():
        wide = op(query, keys, values, rows, positions, 0.125)
        alone = torch.cat(
            [
                op(query[:, :, t : t + 1].contiguous(), keys, values, rows[t : t + 1], positions[t : t + 1], 0.125)
                for t in range(sum(widths))
            ],
            1,
        )
    assert torch.equal(wide, alone)


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="torch runs one thread here: nothing to share the work with")
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="no /proc: threads' CPU time cannot be read")
def test_a_large_pass_keeps_torchs_threads_busy(op):
    """``at::parallel_for`` is a header template: its OpenMP pragma is compiled into the op, so an op built without
    ``-fopenmp`` ran every token on the calling thread while torch's other threads idled. The library must call into
    the OpenMP runtime, and a pass of 64 tokens over 4096 cached positions must run on more than one of the process's
    threads (each thread's own CPU time, so a busy machine slows it but cannot fake or hide it)."""
    from depctl import config

    library = native.build_directory(config.cache_dir() / "compiled", native.build_flags()) / "depctl_native.so"
    assert b"GOMP_parallel" in library.read_bytes(), "the op was built without OpenMP"
    keys, values = cache(rows=1, kv_heads=2, capacity=4096, dim=64)
    query = torch.randn(1, 4, 64, 64)
    rows, positions = torch.zeros(64, dtype=torch.long), torch.full((64,), 4095, dtype=torch.long)
    op(query, keys, values, rows, positions, 0.125)  # the pool's threads exist from here
    before = _thread_cpu_ticks()
    for _ in range(40):
        op(query, keys, values, rows, positions, 0.125)
    busy = [tid for tid, ticks in _thread_cpu_ticks().items() if ticks > before.get(tid, 0)]
    assert len(busy) >= 2, f"only {len(busy)} thread worked: the op ran on one thread"


def _thread_cpu_ticks() -> dict[int, int]:
    """Each of this process's threads' user + system CPU time, in clock ticks (/proc/self/task/*/stat)."""
    ticks = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # a thread that ended meanwhile
            continue
        ticks[int(task.name)] = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return ticks


def test_a_position_outside_the_cache_is_refused_with_the_token_named(op):
    keys, values = cache(capacity=8)
    with pytest.raises(RuntimeError, match="token 1 at row 0, position 8 is outside the cache"):
        op(torch.randn(1, 4, 2, 16), keys, values, torch.tensor([0, 0]), torch.tensor([7, 8]), 0.25)


def test_a_build_that_fails_says_why_and_what_to_do_and_leaves_nothing_behind(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    def no_compiler(**_):
        raise RuntimeError("Error building extension 'depctl_native'\nc++: command not found")

    monkeypatch.setattr(native, "_loaded", False)
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    with pytest.raises(native.NativeUnavailable, match=r"c\+\+: command not found.*--no-compile"):
        native.load(tmp_path)
    assert not list(tmp_path.glob("*/" + native.LIBRARY)) and not list(tmp_path.glob("*.build-*"))


def test_a_failed_build_is_remembered_for_a_while_and_names_the_compilers_error(monkeypatch, tmp_path):
    """Each test process, each daemon start, would otherwise spend the build's minute failing again."""
    from torch.utils import cpp_extension

    tries = []

    def failing(**_):
        tries.append(1)
        raise RuntimeError(
            "Error building extension 'depctl_native': [1/5] c++ -c a.cpp\nFAILED: a.o\n"
            "a.cpp:3:10: fatal error: Python.h: No such file or directory\nninja: build stopped: subcommand failed."
        )

    monkeypatch.setattr(native, "_loaded", False)
    monkeypatch.setattr(cpp_extension, "load", failing)
    with pytest.raises(native.NativeUnavailable, match=r"\(a.cpp:3:10: fatal error: Python.h: No such file"):
        native.load(tmp_path)
    with pytest.raises(native.NativeUnavailable, match=r"C\+\+ ops 0 min ago \(a.cpp:3:10: fatal error: Python.h"):
        native.load(tmp_path)  # another process, soon after: not built again
    assert len(tries) == 1
    later = time.time() + native.RETRY_AFTER + 1
    monkeypatch.setattr(native.time, "time", lambda: later)
    with pytest.raises(native.NativeUnavailable):
        native.load(tmp_path)
    assert len(tries) == 2  # tried again once the failure is old


def test_a_build_is_announced_installed_in_one_rename_and_never_repeated(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    builds, announced, loaded = [], [], []

    def build(name, sources, build_directory, **_):  # torch's builder builds and loads
        builds.append(build_directory)
        library = Path(build_directory) / f"{name}.so"
        library.write_bytes(b"built")
        loaded.append(str(library))
        return str(library)

    monkeypatch.setattr(native, "_loaded", False)
    monkeypatch.setattr(cpp_extension, "load", build)
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    monkeypatch.setattr(torch.library, "register_fake", lambda name: lambda f: f)
    leftover = tmp_path / f"{native.build_directory(tmp_path, native.build_flags()).name}.build-killed"
    leftover.mkdir()  # what a build killed midway leaves

    assert not native.built(tmp_path)
    native.load(tmp_path, building=lambda: announced.append(native.built(tmp_path)))
    library = native.build_directory(tmp_path, native.build_flags()) / native.LIBRARY
    assert announced == [False] and len(builds) == 1 and not builds[0].startswith(str(library.parent) + os.sep)
    assert library.read_bytes() == b"built" and loaded == [f"{builds[0]}/depctl_native.so"], "loaded once"
    assert not list(tmp_path.glob("*.build-*")), "the build's own folder (and a killed build's) is removed"

    monkeypatch.setattr(native, "_loaded", False)  # a second process on this machine
    native.load(tmp_path, building=lambda: announced.append("again"))
    assert len(builds) == 1 and announced == [False] and loaded[1:] == [str(library)]


def test_the_build_key_is_what_changes_the_code_not_who_asks(monkeypatch, tmp_path):
    """Two checkouts, two virtualenvs or two PATHs (and so two ninjas) share one build; another compiler does not."""
    flags = native.build_flags()
    here = native.build_directory(tmp_path, flags)
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(native, "CSRC", tmp_path / "another-checkout")
    monkeypatch.setattr(native.sys, "executable", str(tmp_path / "another-venv" / "bin" / "python"))
    assert native.build_directory(tmp_path, flags) == here
    assert native.build_directory(tmp_path, [*flags, "-DANOTHER"]) != here
    monkeypatch.setattr(native, "_compiler", lambda: "clang++: Debian clang version 16")
    assert native.build_directory(tmp_path, flags) != here


@pytest.mark.slow
def test_a_second_checkout_in_a_second_venv_with_another_ninja_builds_nothing(op, tmp_path):
    """The machine's build (this process's) is loaded by another copy of the code, from another virtualenv, with a
    PATH whose first ninja records any call: nothing is built again."""
    import shutil
    import subprocess
    import sys
    import sysconfig

    import depctl
    from depctl import config

    clone = tmp_path / "clone"
    shutil.copytree(Path(native.__file__).parents[1], clone / "depctl_runtime")
    shutil.copytree(Path(depctl.__file__).parent, clone / "depctl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(tmp_path / "venv")}))
    (site / "shared.pth").write_text(sysconfig.get_path("purelib") + "\n")  # torch and the rest, not depctl
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "ninja").write_text(f"#!/bin/sh\ntouch {tmp_path}/ninja-ran\nexit 1\n")
    (tools / "ninja").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{tools}{os.pathsep}/usr/bin{os.pathsep}/bin",
        "PYTHONPATH": str(clone),
        "DEPCTL_CACHE": str(config.cache_dir()),
        "VIRTUAL_ENV": str(tmp_path / "venv"),
    }
    script = "from depctl_runtime.kernels import native; b = native.built(); native.load(); print(b, native.__file__)"
    proc = subprocess.run(
        [str(tmp_path / "venv" / "bin" / "python"), "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True", str(clone / "depctl_runtime" / "kernels" / "native.py")]
    assert not (tmp_path / "ninja-ran").exists()


def test_ninja_from_the_virtualenv_is_found_without_an_activated_path(monkeypatch):
    """A daemon started as .venv/bin/depctl has no virtualenv on PATH; torch's builder looks for ninja there."""
    ninja = pytest.importorskip("ninja")
    monkeypatch.setenv("PATH", "/nonexistent")
    native._ninja_on_path()
    assert ninja.BIN_DIR in os.environ["PATH"].split(os.pathsep)


@pytest.mark.parametrize("isa_name", ["avx2", "avx512"])
def test_the_flags_for_every_x86_isa_cover_the_half_precision_conversions_the_kernels_use(monkeypatch, isa_name):
    # the int4 kernels' AVX2 tiles convert fp16 scales with F16C, also inside AVX-512 builds; inductor's AVX-512
    # flags name no -mf16c, and GCC refused to inline _mm256_cvtph_ps there (no ops at all on AVX-512 machines)
    from torch._inductor import cpu_vec_isa

    isa = {"avx2": cpu_vec_isa.VecAVX2(), "avx512": cpu_vec_isa.VecAVX512()}[isa_name]
    monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", lambda: isa)
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    assert "-mf16c" in native.build_flags()
