"""ModelRunner: one model plus the one KV cache it owns (a ``SlotCache``: a row per running sequence).

A forward takes a contiguous range of rows and a list of new tokens per row (ragged: padded to the longest), writes
them at each row's length, and returns their logits. The engine keeps one invariant with ``set_length`` after every
step, for the target and the draft alike: a row holds a prefix of its accepted sequence, and for the target exactly
``len(tokens) - 1`` positions, so that the last accepted token is the next forward's first input. A draft row may be
*shorter* (after a full accept it never saw ``d_k``); it catches up by feeding ``tokens[length:]`` next time.
"""

from __future__ import annotations

import torch

from runtime.engine.cache import SlotCache

PAD_TOKEN = 0  # fills ragged rows; what a padded position computes is never read


class ModelRunner:
    def __init__(self, model: torch.nn.Module, vocab_size: int | None = None, max_rows: int = 1,
                 max_context: int | None = None, slack: int = 64):
        self.model = model
        self.device = next(model.parameters()).device
        config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        max_context = max_context or getattr(config, "max_position_embeddings", 2048)
        # Logit rows beyond the tokenizer's vocabulary are padding (Qwen pads its tables); sliced off so target
        # and draft probabilities line up.
        self.vocab_size = vocab_size
        self.max_rows = max_rows
        # slack: a verify writes up to K + 1 positions past a row's length, some of them padding
        self.cache = SlotCache(model.config, max_rows, max_context + slack)
        self._eager = getattr(model.config, "_attn_implementation", "sdpa") == "eager"

    def length(self, row: int) -> int:
        return self.cache.lengths[row]

    def set_length(self, row: int, length: int) -> None:
        self.cache.set_length(row, length)

    def move_row(self, src: int, dst: int) -> None:
        self.cache.move_row(src, dst)

    @torch.inference_mode()
    def forward(self, first: int, inputs: list[list[int]] | torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Append ``inputs[b]`` to row ``first + b`` for every b and return the logits.

        inputs: B lists of token ids (ragged), or a [B, S] tensor already on the device (no host round trip)

        returns: [B, S, vocab] with S = the longest input (row b's logits for its tokens are ``[b, :len(inputs[b])]``),
        or [B, 1, vocab] when ``last_only`` (a prefill: skip the lm_head for the rest; rows must be equally long)
        """
        if isinstance(inputs, torch.Tensor):
            input_ids = inputs  # [B, S]
            widths = [inputs.shape[1]] * inputs.shape[0]
        else:
            widths = [len(x) for x in inputs]
            width = max(widths)
            padded = [x + [PAD_TOKEN] * (width - len(x)) for x in inputs]
            input_ids = torch.tensor(padded, dtype=torch.long, device=self.device)  # [B, S]
        position_ids, mask = self.cache.begin(first, widths, self.device)
        if self._eager:  # eager attention adds its mask: 0 where visible, the dtype's minimum elsewhere
            mask = _additive(mask, self.model.dtype)
        try:
            out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                             past_key_values=self.cache, use_cache=True, logits_to_keep=1 if last_only else 0)
        finally:
            self.cache.advance(first, widths)
        logits = out.logits  # [B, S or 1, vocab]
        if self.vocab_size is not None and logits.shape[-1] != self.vocab_size:
            logits = _fit_vocab(logits, self.vocab_size)
        return logits


def _additive(mask, dtype: torch.dtype):
    if isinstance(mask, dict):
        return {k: _additive(v, dtype) for k, v in mask.items()}
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def _fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    if logits.shape[-1] > vocab_size:
        return logits[..., :vocab_size]
    pad = logits.new_full((*logits.shape[:-1], vocab_size - logits.shape[-1]), float("-inf"))
    return torch.cat([logits, pad], dim=-1)
