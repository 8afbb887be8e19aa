"""An EAGLE head's draft step compiled ahead of time (AOTInductor), as the target's passes are (``model.compiled``).

Why: a head is one decoder layer, a hundredth of a small target's bytes, yet run eagerly right after a target pass
its draft step cost far more than its bytes: some sixty small ops (norms, RoPE, the cache writes, attention, the
MLP's activation), each paying for caches the pass just emptied. Compiled, they are a few C++ loops between the
products (BENCHMARKS.md, "A compiled head step").

Two libraries, both with every size symbolic (tokens, cache rows, capacity):

- ``keys``: the head's inputs for T entries (tokens, their hidden states, positions, cache rows) -> the entries' keys
  and values written into the head's cache at (row, position), and the queries and residual to attend with;
- ``attend``: queries -> each attends its own row of the cache up to its own position (``depctl_native::
  token_attention``, as the target's passes do), then the layer's output and the head's logits.

Drafting runs both over the B rows each step; a catch-up runs ``keys`` over every waiting entry and ``attend`` only
over each row's last. The libraries are built without constants and borrow the serving head's weights (and the
target's embeddings, which the head reads), so every generation of a learning head reuses them. Drafts only
propose: the output is the target's whatever the head computes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path

import torch
from torch import nn

from depctl_runtime.kernels import native, quantized
from depctl_runtime.model import compiled, eagle
from depctl_runtime.model.compiled import code_fingerprint

log = logging.getLogger("depctl.compiled")

PARTS = ("keys", "attend")


class _Keys(nn.Module):
    def __init__(self, head: eagle.EagleHead):
        super().__init__()
        self.head = head

    def forward(self, tokens, hidden, positions, rows, keys, values):
        q, k, v, residual = self.head._qkv(tokens, hidden, positions)
        keys[rows, :, positions] = k.transpose(0, 1)
        values[rows, :, positions] = v.transpose(0, 1)
        return q, residual  # [heads, T, dim], [T, hidden]


class _Attend(nn.Module):
    def __init__(self, head: eagle.EagleHead):
        super().__init__()
        self.head = head
        self.scale = head.config.head_dim**-0.5

    def forward(self, q, residual, positions, rows, keys, values):
        attended = torch.ops.depctl_native.token_attention(q[None], keys, values, rows, positions, self.scale)
        out = self.head._finish(attended[0].transpose(0, 1), residual)  # [T, hidden]
        return out, self.head.logits(out)


def package_paths(head: eagle.EagleHead, root: Path) -> dict[str, Path]:
    """Where the libraries for heads of this shape, dtype, torch build and CPU live, one per part. The key holds
    everything the generated code depends on, and the source it was traced from; not the weights, which it borrows."""
    sources = hashlib.sha256()
    for module in (compiled, eagle, quantized):
        sources.update(code_fingerprint(Path(module.__file__).read_text()).encode())
    sources.update(code_fingerprint(Path(__file__).read_text()).encode())
    for source in (native.SOURCE, native.QUANTIZED_SOURCE):
        sources.update(code_fingerprint(source.read_text(), cpp=True).encode())
    fields = {
        "config": head.config.to_dict(),
        "dtype": str(head.norm.weight.dtype),
        "embeddings": list(head.embed_tokens.weight.shape),
        "modules": sorted({type(m).__name__ for m in head.modules()}),
        "bits": {name: m.bits for name, m in head.named_modules() if isinstance(m, quantized.QuantizedLinear)},
        "sources": sources.hexdigest(),
    }
    digest = compiled.library_key(fields)
    return {part: root / f"head-{digest}-{part}.pt2" for part in PARTS}


def build(head: eagle.EagleHead, root: Path) -> float:
    """Export and compile both parts for ``head``'s shapes (each written atomically); returns the seconds it took."""
    t0 = time.perf_counter()
    native.load()
    c = head.config
    dtype, device = head.norm.weight.dtype, head.norm.weight.device
    keys = torch.zeros(2, c.num_key_value_heads, 64, c.head_dim, dtype=dtype, device=device)
    values = torch.zeros_like(keys)
    positions = torch.tensor([3, 4], device=device)
    rows = torch.tensor([0, 1], device=device)
    q = torch.zeros(c.num_attention_heads, 2, c.head_dim, dtype=dtype, device=device)
    hidden = torch.zeros(2, c.hidden_size, dtype=dtype, device=device)
    t = torch.export.Dim("tokens", min=1, max=1 << 20)
    r = torch.export.Dim("rows", min=1, max=1 << 12)
    capacity = torch.export.Dim("capacity", min=2, max=1 << 22)
    cache = {0: r, 2: capacity}
    parts = {
        "keys": (_Keys(head), (torch.tensor([1, 2], device=device), hidden, positions, rows, keys, values), {0: t}),
        "attend": (_Attend(head), (q, hidden, positions, rows, keys, values), {1: t}),
    }
    paths = package_paths(head, root)
    for part, (module, inputs, first) in parts.items():
        package = paths[part]
        package.parent.mkdir(parents=True, exist_ok=True)
        partial = package.with_name(f".{package.stem}.{os.getpid()}.partial.pt2")
        dims = (first, {0: t}, {0: t}, {0: t}, cache, cache)
        try:
            with torch.inference_mode(False), torch.no_grad():
                exported = torch.export.export(module, inputs, dynamic_shapes=dims, strict=False)
                torch._inductor.aoti_compile_and_package(
                    exported,
                    package_path=str(partial),
                    inductor_configs={"aot_inductor.package_constants_in_so": False},
                )
            os.replace(partial, package)
        finally:
            partial.unlink(missing_ok=True)
    seconds = time.perf_counter() - t0
    log.info("built the head's step %s in %.0fs", paths["keys"].name.removesuffix("-keys.pt2"), seconds)
    return seconds


class CompiledHead:
    """A serving head's draft step through its two libraries (``package_paths``), borrowing the head's weights."""

    def __init__(self, paths: dict[str, Path], head: eagle.EagleHead):
        self._libraries = {part: compiled.Library(paths[part], head, "head.") for part in PARTS}

    def keys(self, tokens, hidden, positions, rows, keys, values) -> tuple[torch.Tensor, torch.Tensor]:
        """Write T entries' keys and values at (rows, positions) of the cache; their queries [heads, T, dim] and the
        residual [T, hidden]."""
        q, residual = self._libraries["keys"](tokens, hidden, positions, rows, keys, values)
        return q, residual

    def attend(self, q, residual, positions, rows, keys, values) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query over its row's entries up to its position -> the layer's output [T, hidden] and the head's
        logits [T, draft_vocab]."""
        out, logits = self._libraries["attend"](q.contiguous(), residual.contiguous(), positions, rows, keys, values)
        return out, logits

    def release(self) -> None:
        for library in self._libraries.values():
            library.release()
