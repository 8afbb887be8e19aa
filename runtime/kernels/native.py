"""depctl's C++ ops (``csrc/``), built once per machine with torch's extension builder and loaded on demand.

- ``token_attention(query, keys, values, rows, positions, scale)``: every token of a pass attends its own cache row up
  to its own position, alone; the compiled pass calls it once per layer.
- ``blocked_linear(x, packed, out_features)`` and ``pack_blocked(weight)``: float32 and bf16 matrix products whose
  result for a row does not depend on the other rows (``surgery.BlockedLinear``). ``blocked_kernel(dtype)`` names the
  loops that run them ("fma", "avx512-bf16", "amx-bf16"); a process keeps one bf16 kernel, since they round
  differently (``blocked_refuse_amx`` is for tests).
- ``quantized_linear(x, packed, scales, offsets, out_features, bits)``: products over 4- or 8-bit weights in groups
  of 32 with fp16 scales and offsets, row-invariant likewise (``quantized.QuantizedLinear``).
- ``CompiledPass(package, device_index)`` and ``run_pass(pass, inputs)``: a compiled pass's library, run without the
  GIL, which torch's own Python binding holds for the whole pass.
- ``screened_argmax(...)``: a float32 output layer's greedy choices from its bf16 logits (``model.screened_head``).

Built for this CPU's vector instruction set with inductor's flags (``torch._inductor.cpu_vec_isa``), once per
machine: kept under the cache directory keyed by the sources, the torch build and the compiler, and shared by every
checkout and virtualenv that has them. It needs a C++ compiler (and ninja, a dependency); ``load``
raises ``NativeUnavailable`` with the reason where it cannot be built, and the loader then runs without it.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCE = CSRC / "token_attention.cpp"  # what a compiled package calls (part of its key)
LINEAR_SOURCE = CSRC / "blocked_linear.cpp"  # also called by a compiled package
QUANTIZED_SOURCE = CSRC / "quantized_linear.cpp"  # likewise
SOURCES = (SOURCE, LINEAR_SOURCE, QUANTIZED_SOURCE, CSRC / "compiled_pass.cpp", CSRC / "screened_argmax.cpp")

log = logging.getLogger("depctl.native")
_lock = threading.Lock()
_loaded = False


class NativeUnavailable(RuntimeError):
    """depctl's C++ ops could not be built or loaded here; the message says why."""


def build_flags() -> list[str]:
    """Compiler flags for this CPU's vector ISA, as inductor picks it: ``-D CPU_CAPABILITY_AVX512`` and ``-mavx512f
    ...`` on an AVX-512 machine, and nothing where it finds no ISA it can build for (at::vec then runs plain C++).
    And ``-fopenmp`` on Linux: ``at::parallel_for`` is a header template whose OpenMP pragma is compiled into the op
    itself, so without the flag the ops ran on the calling thread alone (the other core waited out the attention of
    every layer). The library links to the libgomp torch has already loaded (the same soname)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    threads = ["-fopenmp"] if platform.system() == "Linux" else []
    if not isa:
        if platform.machine() in ("x86_64", "AMD64", "aarch64", "arm64"):  # every such CPU has one; its check failed
            log.warning(
                "torch found no vector instruction set to build for (its probe failed); depctl's C++ ops "
                "build as plain C++, several times slower"
            )
        return ["-O3", *threads]
    arch = isa.build_arch_flags().split()
    if platform.machine() in ("x86_64", "AMD64") and "-mf16c" not in arch:
        # the int4 tiles convert fp16 scales with F16C (_mm256_cvtph_ps) in AVX-512 builds too, and inductor's
        # AVX-512 flags leave it out; every AVX2 or AVX-512 CPU has it
        arch.append("-mf16c")
    return ["-O3", *threads, *(f"-D{macro}" for macro in isa.build_macro()), *arch]


LIBRARY = "depctl_native.so"


def build_directory(root: Path, flags: list[str]) -> Path:
    """Where this machine's library lives: one folder per key, the key being all that changes the built code (the
    sources, the torch build, the Python ABI, the compiler, the flags), and nothing about the caller (its checkout,
    virtualenv, PATH or ninja), so every clone and venv on the machine with the same torch shares one build."""
    key = hashlib.sha256()
    for source in SOURCES:
        key.update(source.read_bytes())
    torch_build = f"{torch.__version__}|{torch.version.git_version}|{torch.version.cuda}"
    python = sys.implementation.cache_tag
    key.update(f"{torch_build}|{python}|{platform.machine()}|{_compiler()}|{' '.join(flags)}".encode())
    return root / f"native-{key.hexdigest()[:16]}"


@functools.cache
def _compiler() -> str:
    """The compiler torch's builder runs (``$CXX`` or ``c++``) and its version: a different compiler builds other
    code."""
    compiler = os.environ.get("CXX", "c++")
    try:
        found = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
        return f"{compiler}: {(found.stdout.splitlines() or [''])[0]}"
    except (OSError, subprocess.SubprocessError):
        return compiler  # the build will fail and say why


def _default_root() -> Path:
    from depctl import config

    return config.cache_dir() / "compiled"


def identity() -> str:
    """The loaded library's build (its folder: the sources, torch, compiler and flags), or "" where none is loaded:
    what a measurement of its products was taken with."""
    return build_directory(_default_root(), build_flags()).name if _loaded else ""


def built(root: Path | None = None) -> bool:
    """Whether this machine's library is already built (a load is then a few milliseconds, with no build)."""
    return _loaded or (build_directory(root or _default_root(), build_flags()) / LIBRARY).exists()


def load(root: Path | None = None, building: Callable[[], None] | None = None) -> None:
    """Build (first time on this machine) and load the ops into this process; a no-op once loaded. ``building`` is
    called before a build starts, so a caller can say what the wait is for."""
    global _loaded
    with _lock:
        if _loaded:
            return
        flags = build_flags()
        directory = build_directory(root or _default_root(), flags)
        library = directory / LIBRARY
        failed = directory.parent / f"{directory.name}.failed"
        if not library.exists() and (earlier := _recent_failure(failed)) is not None:
            raise NativeUnavailable(
                _unavailable(earlier, f" {(time.time() - failed.stat().st_mtime) / 60:.0f} min ago")
            )
        try:
            built_here = False
            if not library.exists():
                from filelock import FileLock

                directory.mkdir(parents=True, exist_ok=True)
                with FileLock(str(directory) + ".lock"):  # one build per machine: the others wait, then load it
                    if not library.exists():
                        for stale in directory.parent.glob(f"{directory.name}.build-*"):  # builds killed midway
                            shutil.rmtree(stale, ignore_errors=True)
                        if building is not None:
                            building()
                        _build(directory, flags)
                        built_here = True
            if not built_here:  # torch's builder loaded its own copy: a second would register every op twice
                torch.ops.load_library(str(library))
        except Exception as e:  # no compiler, no ninja, headers missing: the caller runs eagerly and says why
            reason = _why(e)
            log.debug("the build of depctl's C++ ops failed", exc_info=e)
            try:
                failed.parent.mkdir(parents=True, exist_ok=True)
                failed.write_text(reason)
            except OSError:
                pass
            raise NativeUnavailable(_unavailable(reason)) from e
        torch.library.register_fake("depctl_native::token_attention")(_token_attention_shape)
        torch.library.register_fake("depctl_native::blocked_linear")(_blocked_linear_shape)
        torch.library.register_fake("depctl_native::quantized_linear")(_quantized_linear_shape)
        _loaded = True


RETRY_AFTER = 600.0  # seconds a failed build is remembered: the processes started meanwhile do not each spend a minute


def _recent_failure(marker: Path) -> str | None:
    """Why the last build on this machine failed, if it failed less than ``RETRY_AFTER`` seconds ago."""
    try:
        if time.time() - marker.stat().st_mtime < RETRY_AFTER:
            return marker.read_text()
    except OSError:
        pass
    return None


def _why(error: Exception) -> str:
    """The line of a failed build that says why: the compiler's first error, else the output's last line (ninja's
    "build stopped" says nothing)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    return next((line for line in lines if "error:" in line), lines[-1])[:300]


def _unavailable(reason: str, when: str = "") -> str:
    return (
        f"could not build depctl's C++ ops{when} ({reason}); install a C++ compiler (g++ or clang++) and update the "
        f"deployment to retry (a failed build is tried again after {RETRY_AFTER / 60:.0f} min), or use --no-compile"
    )


def _build(directory: Path, flags: list[str]) -> None:
    """Build in a folder of this build's own, then move the library into place in one rename: a build killed
    half-way, or one ninja's log another ninja cannot read, never leaves a library or a state the next load trusts.
    The build's folder goes with it (the library is all that is kept)."""
    from torch.utils import cpp_extension

    _ninja_on_path()
    work = Path(tempfile.mkdtemp(prefix=f"{directory.name}.build-", dir=directory.parent))
    try:
        started = time.perf_counter()
        built_library = cpp_extension.load(
            name="depctl_native",
            sources=[str(s) for s in SOURCES],
            build_directory=str(work),
            extra_cflags=flags,
            extra_ldflags=[f for f in flags if f == "-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
        staged = directory / f"{LIBRARY}.{os.getpid()}.tmp"
        shutil.copyfile(built_library, staged)
        os.replace(staged, directory / LIBRARY)
        log.info("built depctl's C++ ops in %.0f s into %s", time.perf_counter() - started, directory)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def available(building: Callable[[], None] | None = None) -> bool:
    """Whether the ops load here (built once, cached); False, with the reason logged, where they cannot.
    ``building``: as for ``load``."""
    try:
        load(building=building)
        return True
    except NativeUnavailable as exc:
        log.warning("%s", exc)
        return False


def _token_attention_shape(query, keys, values, rows, positions, scale):
    """What the op returns, for tracing: [1, T, heads, dim] from query [1, heads, T, dim]."""
    return query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])


def blocked_supports(dtype: torch.dtype) -> bool:
    """Whether ``surgery.BlockedLinear`` takes ``dtype`` here: float32 wherever the ops build, bfloat16 where the CPU
    has AVX-512 BF16 (and the ops were built for AVX-512)."""
    return available() and bool(torch.ops.depctl_native.blocked_supports(dtype))


def _blocked_linear_shape(x, packed, out_features):
    """[rows, out_features] from x [rows, in]."""
    return x.new_empty(x.shape[0], out_features)


def _quantized_linear_shape(x, packed, scales, offsets, out_features, bits):
    """[rows, out_features] from x [rows, in]."""
    return x.new_empty(x.shape[0], out_features)


def _ninja_on_path() -> None:
    """torch's builder runs ``ninja`` from PATH; the ``ninja`` wheel puts it beside this interpreter, which a daemon
    started as ``.venv/bin/depctl`` (no activated virtualenv) does not have on its PATH."""
    if shutil.which("ninja"):
        return
    candidates = [Path(sys.executable).parent]
    try:
        import ninja

        candidates.insert(0, Path(ninja.BIN_DIR))
    except (ImportError, AttributeError):
        pass
    for directory in candidates:
        if (directory / "ninja").exists():
            os.environ["PATH"] = f"{directory}{os.pathsep}{os.environ.get('PATH', '')}"
            return
