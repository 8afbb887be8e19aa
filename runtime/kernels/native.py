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

Built for this CPU's vector instruction set with inductor's flags (``torch._inductor.cpu_vec_isa``), kept under the
cache directory keyed by the sources and the torch build. It needs a C++ compiler (and ninja, a dependency); ``load``
raises ``NativeUnavailable`` with the reason where it cannot be built, and the loader then runs without it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
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
    return ["-O3", *threads, *(f"-D{macro}" for macro in isa.build_macro()), *isa.build_arch_flags().split()]


def build_directory(root: Path, flags: list[str]) -> Path:
    key = hashlib.sha256()
    for source in SOURCES:
        key.update(source.read_bytes())
    key.update(f"{torch.__version__}|{sys.version}|{platform.machine()}|{' '.join(flags)}".encode())
    # torch's build file names the sources by path: two checkouts sharing one directory rebuilt it in turn, each
    # load waiting minutes for the other's build under the lock
    key.update(str(CSRC.resolve()).encode())
    return root / f"native-{key.hexdigest()[:16]}"


def load(root: Path | None = None) -> None:
    """Build (first time on this machine) and load the ops into this process; a no-op once loaded."""
    global _loaded
    with _lock:
        if _loaded:
            return
        if root is None:
            from depctl import config

            root = config.cache_dir() / "compiled"
        flags = build_flags()
        directory = build_directory(root, flags)
        directory.mkdir(parents=True, exist_ok=True)
        _ninja_on_path()
        try:
            from filelock import FileLock
            from torch.utils import cpp_extension

            # torch's own build lock is a plain file that a killed build leaves behind, and every later load then
            # waits on it forever; ours is released by the OS with its process, so under it any torch lock is stale
            with FileLock(str(directory) + ".lock"):
                (directory / "lock").unlink(missing_ok=True)
                _build(cpp_extension, directory, flags)
        except Exception as e:  # no compiler, no ninja, headers missing: the caller runs eagerly and says why
            last = (str(e).strip().splitlines() or [type(e).__name__])[-1]
            raise NativeUnavailable(
                f"could not build depctl's C++ ops ({last}); install a C++ compiler "
                "(g++ or clang++) and update the deployment to retry, or use --no-compile"
            ) from e
        torch.library.register_fake("depctl_native::token_attention")(_token_attention_shape)
        torch.library.register_fake("depctl_native::blocked_linear")(_blocked_linear_shape)
        torch.library.register_fake("depctl_native::quantized_linear")(_quantized_linear_shape)
        _loaded = True


def _build(cpp_extension, directory: Path, flags: list[str]) -> None:
    cpp_extension.load(
        name="depctl_native",
        sources=[str(s) for s in SOURCES],
        build_directory=str(directory),
        extra_cflags=flags,
        extra_ldflags=[f for f in flags if f == "-fopenmp"],
        is_python_module=False,
        verbose=False,
    )


def available() -> bool:
    """Whether the ops load here (built once, cached); False, with the reason logged, where they cannot."""
    try:
        load()
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
