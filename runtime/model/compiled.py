"""Compiled decode and verify passes: a fused model's forward (``depctl_runtime.model.decoder``) compiled ahead of time.

Why: on a CPU, between a step's matrix products sit ~20 small ops a layer (norms, RoPE, the cache write, residuals)
and the Python that calls them; compiled, they become a few fused C++ loops and the products are called directly.

- **AOTInductor, not ``torch.compile``**: the exported library has no guards to evaluate over ~300 tensors a call
  and no Python between kernels; it is a file the next load opens in about a second (``package_path``).
- **One graph for every pass**: token count, cache rows and capacity are symbolic, so a plain step, a verify pass and
  a batch run the same kernels, nothing recompiles, and a row's arithmetic never depends on what else is in the pass
  (kernels specialised for one token round differently).
- **The weights stay the model's**: the library is built without constants and borrows the model's tensors. oneDNN's
  reordered weights do not trace, so the trace sees plain stand-ins (``surgery.plain_stand_ins``).
- **Attention is one C++ op a layer** (``depctl_native::token_attention``): every token attends its own row up to its
  own position with the same loops whatever else is in the pass, so a verify pass rounds like the steps it checks.

Prompts are read eagerly (plain and speculative decoding prefill alike). ``check`` proves at load that a verify pass
through the library is bit-identical to one-token steps through it; the loader keeps the eager pass if not.
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import os
import platform
import re
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.weak import WeakTensorKeyDictionary

from depctl_runtime.kernels import native, quantized, surgery
from depctl_runtime.kernels.surgery import plain_stand_ins
from depctl_runtime.model import attention, decoder

log = logging.getLogger("depctl.compiled")


class _Pass(nn.Module):
    """What is exported: ``decoder.forward`` over cache tensors given as inputs, one [rows, kv_heads, capacity, dim]
    pair per layer, up to the final norm: the output layer runs outside the library, where a greedy pass can screen
    it (``depctl_runtime.model.screened_head``) and a sampling row computes it in full."""

    def __init__(self, model: nn.Module, features: tuple[int, ...] = ()):
        super().__init__()
        self.model = model
        self.features = features  # layers whose outputs are a second output (``decoder.forward_with_features``)

    def forward(self, input_ids, positions, rows, keys: list[torch.Tensor], values: list[torch.Tensor]):
        def attend(i, attn, q, k, v):
            # k, v: [1, kv_heads, T, dim]; token t goes to cache row rows[t] at positions[t]
            keys[i][rows, :, positions] = k[0].transpose(0, 1)
            values[i][rows, :, positions] = v[0].transpose(0, 1)
            return torch.ops.depctl_native.token_attention(q, keys[i], values[i], rows, positions, attn.scaling)

        hidden, states = decoder.forward_with_features(
            self.model, input_ids, positions, attend, head=False, features=self.features
        )
        return hidden if states is None else (hidden, states)  # [T, hidden], [T, layers * hidden]


# Loaded libraries whose engine is gone, by (package, device index): the next load of the same package takes one.
# Each load maps a fresh copy of the library's .so that stays mapped for the life of the process, so a daemon that
# reloads a deployment reuses them rather than growing by one copy a reload.
_SPARE: dict[tuple[str, int], list] = {}
_SPARE_LOCK = threading.Lock()
# Every tensor a library has borrowed: a library reads the data pointers it was given at load, so such a tensor never
# gets new storage (another library's borrow of it included), or the first reads freed memory.
_LENT = WeakTensorKeyDictionary()


class Library:
    """An AOTInductor package through ``depctl_native::run_pass``, borrowing its constants from ``module`` (named as
    the export named them, under ``prefix``)."""

    def __init__(self, package: Path, module: nn.Module, prefix: str):
        native.load()  # the library calls depctl's ops; run_pass calls the library
        device = next(module.parameters()).device
        self._key = (str(package), -1 if device.index is None else device.index)
        with _SPARE_LOCK:
            spare = _SPARE.get(self._key)
            self.runner = spare.pop() if spare else None
        if self.runner is None:
            # torch's Python loader (torch._inductor.aoti_load_package) keeps the GIL for the whole pass: in the
            # daemon the event loop then waited out every pass (see compiled_pass.cpp). Ours releases it, as an op
            # does.
            self.runner = torch.classes.depctl_native.CompiledPass(*self._key)
        named = dict(module.named_parameters(remove_duplicate=False))  # a tied output layer is a constant of its own
        named.update(module.named_buffers(remove_duplicate=False))
        names = self.runner.constant_names()
        borrowed = [named[fqn.removeprefix(prefix)] for fqn in names]
        with _SPARE_LOCK:
            for tensor in borrowed:
                # oneDNN's reordered weights (opaque, no storage to ask about) are already copies of our own
                if tensor.is_mkldnn:
                    continue
                # mapped from the weights file: a copy of our own, which ``ModelRunner.release`` can free; unless a
                # library reads it already
                if not tensor.untyped_storage().resizable() and tensor not in _LENT:
                    tensor.data = tensor.data.clone()
                _LENT[tensor] = True
        self.runner.borrow_constants(names, borrowed)

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        return torch.ops.depctl_native.run_pass(self.runner, list(inputs))

    def release(self) -> None:
        """Nothing runs this library again: it goes back for the next load of its package to borrow new weights
        (which replace these in full: ``load_constants`` checks every constant is given)."""
        runner, self.runner = self.runner, None
        if runner is not None:
            with _SPARE_LOCK:
                _SPARE.setdefault(self._key, []).append(runner)


class CompiledPass:
    """A fused model's decode/verify pass as an AOTInductor library, called like ``decoder.forward``."""

    def __init__(self, package: Path, model: nn.Module, features: tuple[int, ...] = ()):
        self.package = package
        self.features = features  # as built: the library returns these layers' outputs too
        self._model = model
        self.library = Library(package, model, "model.")

    returns_hidden = True  # the output layer is the runner's (``runner.Scores``)

    def another(self) -> CompiledPass:
        """The same library for another runner over the same model: the caches are the library's inputs, so a runner
        with a cache of its own (a learning head's idle answers) passes through it without touching this one's."""
        return CompiledPass(self.package, self._model, self.features)

    def release(self) -> None:
        """Nothing runs this pass again (``Library.release``)."""
        self.library.release()

    def fits(self, first: int, widths: list[int], keep: list[int] | None) -> bool:
        return True  # every size is symbolic, and ``keep`` picks rows of the output (a draft's catch-up wants them)

    def set_widths(self, widths: tuple[int, ...]) -> None:
        pass  # every size is symbolic

    def describe(self) -> str:
        return f"AOTInductor library {self.package.name}"

    def __call__(self, input_ids: torch.Tensor, layout, cache, keep=None):
        """input_ids: [T]; returns the final norm's output [T, hidden] (or the ``keep`` rows of it) and the layer
        features [T, layers * hidden] the library was built with (None without). The library's
        inputs in the order the export flattened ``_Pass.forward``'s arguments: ids, positions, rows ([T] each),
        every layer's keys, then values."""
        inputs = [
            input_ids,
            cache.step.positions,
            cache.step.rows,
            *(layer.keys for layer in cache.layers),
            *(layer.values for layer in cache.layers),
        ]
        outputs = self.library(*inputs)
        hidden = outputs[0] if keep is None else outputs[0][keep]
        return hidden, (outputs[1] if self.features else None)


def code_fingerprint(text: str, cpp: bool = False) -> str:
    """The code of a source file without its comments and docstrings, so that editing prose rebuilds nothing."""
    if cpp:
        text = re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)
        return "\n".join(line.strip() for line in text.splitlines() if line.strip())
    tree = ast.parse(text)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(getattr(body[0], "value", None), ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def package_path(model: nn.Module, precision: str, root: Path, features: tuple[int, ...] = ()) -> Path:
    """Where the library for this model, precision, torch build and CPU lives. The key holds everything the
    generated code depends on, and the source of the files it was traced from; not the weights, which it borrows."""
    sources = hashlib.sha256()
    for module in (sys.modules[__name__], decoder, attention, surgery, quantized):  # the code the pass is traced from
        sources.update(code_fingerprint(Path(module.__file__).read_text()).encode())
    for source in (native.SOURCE, native.LINEAR_SOURCE, native.QUANTIZED_SOURCE):  # the ops the library calls
        sources.update(code_fingerprint(source.read_text(), cpp=True).encode())
    fields = {
        "config": model.config.to_diff_dict() if hasattr(model.config, "to_diff_dict") else str(model.config),
        "precision": precision,
        "features": list(features),
        "dtype": str(next(model.parameters()).dtype),
        "modules": sorted({type(m).__name__ for m in model.modules()}),
        "sources": sources.hexdigest(),
    }
    return root / f"{library_key(fields)}.pt2"


def library_key(fields: dict) -> str:
    """A library's name: a digest of ``fields`` (what its generated code depends on), the torch build and the CPU."""
    build = {"torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability(), "machine": platform.machine()}
    key = json.dumps({**fields, **build}, sort_keys=True, default=str)
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def build(model: nn.Module, cache, package: Path, features: tuple[int, ...] = ()) -> float:
    """Export and compile the pass into ``package`` (written atomically); returns the seconds it took. The example
    inputs are fresh tensors of the cache's shapes (two rows, 64 positions): every size is symbolic."""
    t0 = time.perf_counter()
    native.load()
    layer0 = cache.layers[0]
    kv_heads, dim, dtype = layer0.keys.shape[1], layer0.keys.shape[3], layer0.keys.dtype
    device = layer0.keys.device
    n = len(cache.layers)
    keys = [torch.zeros(2, kv_heads, 64, dim, dtype=dtype, device=device) for _ in range(n)]
    values = [torch.zeros(2, kv_heads, 64, dim, dtype=dtype, device=device) for _ in range(n)]
    tokens = torch.tensor([1, 2], device=device)
    positions = torch.tensor([0, 0], device=device)
    rows = torch.tensor([0, 1], device=device)
    t = torch.export.Dim("tokens", min=1, max=1 << 20)
    r = torch.export.Dim("rows", min=1, max=1 << 12)
    c = torch.export.Dim("capacity", min=2, max=1 << 22)
    cache_dims = [{0: r, 2: c}] * n
    package.parent.mkdir(parents=True, exist_ok=True)
    partial = package.with_name(f".{package.stem}.{os.getpid()}.partial.pt2")
    try:
        with plain_stand_ins(model):  # oneDNN's reordered weights do not trace; the library borrows them at load
            exported = torch.export.export(
                _Pass(model, features),
                (tokens, positions, rows, keys, values),
                dynamic_shapes=({0: t}, {0: t}, {0: t}, cache_dims, cache_dims),
                strict=False,
            )
            torch._inductor.aoti_compile_and_package(
                exported, package_path=str(partial), inductor_configs={"aot_inductor.package_constants_in_so": False}
            )
        os.replace(partial, package)
    finally:
        partial.unlink(missing_ok=True)
    seconds = time.perf_counter() - t0
    log.info("built %s in %.0fs", package, seconds)
    return seconds


def check(runner) -> bool:
    """On a scratch row: is a 3-token pass through the compiled library bit-identical to three one-token passes through
    it, alone and beside another row? (What speculation's exactness rests on.) Uses rows 0 and 1 and leaves them
    empty."""
    tokens = [11, 12, 13]
    for row in range(min(2, runner.max_rows)):
        runner.set_length(row, 0)
    try:
        runner.forward(0, [[1, 2, 3, 4]], prefill=True)
        runner.forward(1, [[5, 6, 7, 8]], prefill=True) if runner.max_rows > 1 else None
        wide = runner.forward(0, [tokens])
        runner.set_length(0, 4)
        steps = torch.cat([runner.forward(0, [[t]]) for t in tokens])
        same = torch.equal(wide, steps)
        if runner.max_rows > 1:
            runner.set_length(0, 4)
            beside = runner.forward(0, [tokens, [9]])[:3]
            same = same and torch.equal(beside, wide)
        return same
    finally:
        for row in range(min(2, runner.max_rows)):
            runner.set_length(row, 0)
