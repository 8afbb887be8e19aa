"""depctl's C++ ops (``token_attention.cpp``), built once per machine with torch's extension builder and loaded on
demand.

- ``torch.ops.depctl_native.token_attention(query, keys, values, rows, positions, scale)``: every token of a pass
  attends its own cache row up to its own position, alone, through ATen's SDPA. The compiled pass
  (``runtime.engine.compiled``) calls it once per layer; a Python op there cost more than the attention it ran
  (SmolLM2 in float32: ~26 us a layer against ~8 for the SDPA call inside it, 30 layers a step).

Only a compiled pass needs it, and it needs what a compiled pass needs anyway: a C++ compiler (and ninja, a
dependency). The build takes ~10 s and is kept under the cache directory, keyed by the source and the torch build;
``load`` raises ``NativeUnavailable`` with the reason where it cannot be built, and the loader then runs eagerly.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("token_attention.cpp")

_lock = threading.Lock()
_loaded = False


class NativeUnavailable(RuntimeError):
    """depctl's C++ ops could not be built or loaded here; the message says why."""


def build_directory(root: Path) -> Path:
    key = hashlib.sha256()
    key.update(SOURCE.read_bytes())
    key.update(f"{torch.__version__}|{sys.version}|{platform.machine()}".encode())
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
        directory = build_directory(root)
        directory.mkdir(parents=True, exist_ok=True)
        _ninja_on_path()
        try:
            from torch.utils import cpp_extension

            cpp_extension.load(name="depctl_native", sources=[str(SOURCE)], build_directory=str(directory),
                               extra_cflags=["-O3"], is_python_module=False, verbose=False)
        except Exception as e:  # no compiler, no ninja, headers missing: the caller runs eagerly and says why
            last = (str(e).strip().splitlines() or [type(e).__name__])[-1]
            raise NativeUnavailable(f"could not build depctl's C++ attention op ({last}); install a C++ compiler "
                                    "(g++ or clang++) and update the deployment to retry, or use --no-compile") from e
        torch.library.register_fake("depctl_native::token_attention")(_token_attention_shape)
        _loaded = True


def _token_attention_shape(query, keys, values, rows, positions, scale):
    """What the op returns, for tracing: [1, T, heads, dim] from query [1, heads, T, dim]."""
    return query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])


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
