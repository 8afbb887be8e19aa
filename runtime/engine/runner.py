"""ModelRunner: one model plus the one KV cache it owns.

The cache always holds a prefix of the accepted sequence. The engine keeps this invariant with one call,
``crop_to(len(tokens) - 1)`` after every step, for the target and the draft alike: positions that held rejected
drafts are dropped, and the last accepted token is left out so that it is the next forward's first input.
A draft model whose cache ends up *shorter* than that (after a full accept it never saw ``d_k``) catches up by
feeding ``tokens[cache_len:]`` in its next forward.
"""

from __future__ import annotations

import types

import torch
from transformers import DynamicCache


class ModelRunner:
    def __init__(self, model: torch.nn.Module, vocab_size: int | None = None, cpu_small_batch_linear: bool = True):
        self.model = model
        self.device = next(model.parameters()).device
        if cpu_small_batch_linear and self.device.type == "cpu":
            use_weight_major_linear(model)
        # Logit rows beyond the tokenizer's vocabulary are padding (Qwen pads its tables); sliced off so target
        # and draft probabilities line up.
        self.vocab_size = vocab_size
        self.cache: DynamicCache | None = None

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)

    @property
    def length(self) -> int:
        return 0 if self.cache is None else self.cache.get_seq_length()

    @torch.inference_mode()
    def forward(self, token_ids: list[int] | torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Append ``token_ids`` to the cache and return their logits.

        token_ids: n ints, or a [n] / [1, n] tensor already on the device
        returns: [n, vocab] logits, or [1, vocab] when ``last_only`` (prefill: skip the lm_head for the rest)
        """
        if isinstance(token_ids, torch.Tensor):
            input_ids = token_ids.view(1, -1)
        else:
            input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        out = self.model(
            input_ids=input_ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1 if last_only else 0
        )
        logits = out.logits[0]  # [n, vocab]
        if self.vocab_size is not None and logits.shape[-1] != self.vocab_size:
            logits = _fit_vocab(logits, self.vocab_size)
        return logits

    def crop_to(self, length: int) -> None:
        """Drop cached positions >= ``length`` (no-op when the cache is already that short)."""
        extra = self.length - length
        if extra > 0:
            # transformers 5: crop(-n) removes the last n positions; a positive argument raises
            self.cache.crop(-extra)


WEIGHT_MAJOR_MAX_ROWS = 64  # past this (a prefill), F.linear's GEMM is faster: SmolLM2, 250 tokens, 425 vs 510 ms


def _weight_major_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # x: [..., in] -> [..., out], computed as (W @ x^T)^T
    if x.numel() > WEIGHT_MAJOR_MAX_ROWS * x.shape[-1]:
        return torch.nn.functional.linear(x, self.weight, self.bias)
    # [n, in], row-major: the product below then reads x^T column-major, MKL's fast layout for a thin right-hand
    # side. A transposed view (the output of the previous weight-major linear, through the MLP's silu * up)
    # took a path ~5x slower on Qwen's down_proj for 5 rows; the copy is n * in floats.
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    y = (self.weight @ flat.T).T.reshape(*x.shape[:-1], self.weight.shape[0])  # [..., out]
    return y if self.bias is None else y + self.bias


def use_weight_major_linear(model: torch.nn.Module) -> None:
    """Compute every ``nn.Linear`` of ``model`` as ``(W @ x^T)^T`` instead of ``F.linear``.

    Why: on a CPU, ``F.linear`` for a handful of rows (a verify pass over k + 1 tokens) takes a GEMM path that
    costs nearly 2x a single-token step; the weight-major product keeps it close to the one-token cost (SmolLM2 on
    2 cores: verify of 5 tokens 68 ms instead of 109 ms; a single step unchanged at 58 ms). That is what makes
    verifying K drafts nearly as cheap as one step, which speculation needs. Plain decoding goes through the same
    layers, so greedy speculative output still equals plain greedy output of this runner (tests check it on tiny
    and real models). Passes over more than ``WEIGHT_MAJOR_MAX_ROWS`` rows (prefills) keep ``F.linear``, which is
    faster there. Patched per instance: other users of the class are untouched.
    """
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.forward = types.MethodType(_weight_major_forward, module)


def _fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    if logits.shape[-1] > vocab_size:
        return logits[..., :vocab_size]
    pad = logits.new_full((*logits.shape[:-1], vocab_size - logits.shape[-1]), float("-inf"))
    return torch.cat([logits, pad], dim=-1)
