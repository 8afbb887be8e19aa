"""A float32 target's output layer on a CPU with bf16 instructions: greedy choices screened in bf16.

Why: a small model's output layer is a fifth of the bytes a float32 step reads, and greedy decoding needs only each
token's argmax, which a handful of tokens can win. ``ScreenedHead.argmax`` computes every logit in bf16, bounds how far
each can be from its float32
value, and recomputes in float32 only the tokens whose bound reaches the best (``depctl_native::screened_argmax``,
whose header has the bound): a few of the vocabulary, typically one.

What stays as it was: ``forward`` is the full float32 product (a ``BlockedLinear``), which transformers' calling
convention, a prompt's first token, a draft and every sampling row read. The greedy choice of a decode or verify
pass is the argmax of float32 logits computed by the op's dot product, the same code for a token in a plain step,
in a verify pass and beside other rows, so speculation stays exact; where two logits are within float32 rounding of
each other it may pick the other one than the full product would, as two GEMM libraries may.

Where: the loader's surgery swaps a float32 target's output layer for one when the CPU has bf16 dot products
(AVX-512 BF16, AMX), depctl's C++ ops build, and the layer is tied to the embeddings (their table is the plain copy
the op reads, so nothing is duplicated but the bf16 copy). The screen is switched on with the
compiled passes, which load the native ops (``screen``); until then greedy choices come from the full product
(``runner.Scores``).
"""

from __future__ import annotations

import torch
from torch import nn

from depctl_runtime.kernels.surgery import BlockedLinear, OneDNNLinear


class ScreenedHead(nn.Module):
    def __init__(self, linear: nn.Linear, table: torch.Tensor):
        super().__init__()
        self.full = BlockedLinear(linear)
        self.register_buffer("table", table.detach(), persistent=False)  # [vocab, hidden] float32, the embeddings'
        self.approx: OneDNNLinear | None = None  # the bf16 copy, once ``screen`` ran
        self.norms = self.errors = None  # [vocab] float32 each, per row: max(|w|, |bf16(w)|), |bf16(w) - w|
        self.max_norm = self.max_error = 0.0  # their largest values

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.full(x)

    @property
    def screening(self) -> bool:
        return self.approx is not None

    @torch.inference_mode()
    def screen(self, vocab_size: int | None = None, chunk: int = 4096) -> None:
        """Build the bf16 copy and each row's bounds (float64 sums, rounded up), over the first ``vocab_size`` rows
        (the tokenizer's; padding rows of a table are never chosen)."""
        rows = self.table[: vocab_size or self.table.shape[0]]
        low = rows.to(torch.bfloat16)
        norms, errors = [], []
        for start in range(0, rows.shape[0], chunk):
            w, b = rows[start : start + chunk].double(), low[start : start + chunk].double()
            norms.append(torch.maximum(w.norm(dim=1), b.norm(dim=1)))
            errors.append((b - w).norm(dim=1))
        self.norms = (torch.cat(norms) * (1 + 1e-6)).float()
        self.errors = (torch.cat(errors) * (1 + 1e-6)).float()
        self.max_norm, self.max_error = float(self.norms.max()), float(self.errors.max())
        self.approx = OneDNNLinear.of(low)

    def argmax(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: [T, hidden] float32 (after the final norm) -> ([T] int64 greedy choices among the screened rows,
        [T] how many tokens each recomputed in float32). Only once ``screen`` ran."""
        approx = self.approx(hidden.to(torch.bfloat16))  # [T, vocab] bf16
        return torch.ops.depctl_native.screened_argmax(
            approx, hidden, self.table[: approx.shape[-1]], self.norms, self.errors, self.max_norm, self.max_error
        )


def screen_output_layer(model: nn.Module) -> bool:
    """Swap a float32 model's output layer for a ``ScreenedHead`` where it is a plain ``nn.Linear`` tied to the
    input embeddings; False (nothing changed) otherwise."""
    head = getattr(model, "lm_head", None)
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if type(head) is not nn.Linear or embeddings is None or head.bias is not None:
        return False
    if head.weight is not embeddings.weight or head.weight.dtype != torch.float32:
        return False
    model.lm_head = ScreenedHead(head, embeddings.weight)
    return True
