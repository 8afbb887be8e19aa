"""Sampling parameters and the logits -> probabilities transform shared by target and draft.

The verifier's guarantee is relative to this transform: with temperature/top-k/top-p applied identically to the
target and the draft, the accepted tokens follow exactly the distribution the target alone would sample from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from depctl_runtime.speculation.params import Penalties, SamplingParams


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus), then softmax, in float32.

    logits: [n, vocab] -> probs: [n, vocab]
    """
    logits = logits.float() / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [n, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [n, vocab]
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p; the top token always stays
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def apply_penalties(
    penalties: Penalties, logits: torch.Tensor, prompt: list[int], output: list[int], drafts: list[int]
) -> torch.Tensor:
    """logits: [k + 1, vocab] float32 for the positions after ``output`` and after each of the k drafts."""
    n, vocab = logits.shape
    device = logits.device
    if penalties.presence or penalties.frequency or penalties.repetition != 1.0:
        counts = torch.zeros(n, vocab, device=device)  # [k + 1, vocab]: occurrences in the output at each position
        if output:
            counts += torch.bincount(torch.tensor(output, device=device), minlength=vocab)[:vocab].float()
        for j, token in enumerate(drafts):
            counts[j + 1 :, token] += 1
        logits = logits - penalties.frequency * counts - penalties.presence * (counts > 0).float()
        if penalties.repetition != 1.0:
            seen = counts > 0
            if prompt:
                seen[:, torch.tensor(prompt, device=device)] = True
            penalised = torch.where(logits > 0, logits / penalties.repetition, logits * penalties.repetition)
            logits = torch.where(seen, penalised, logits)
    if penalties.logit_bias:
        ids = torch.tensor([t for t, _ in penalties.logit_bias], device=device)
        bias = torch.tensor([b for _, b in penalties.logit_bias], device=device, dtype=logits.dtype)
        logits = logits.index_add(1, ids, bias.expand(n, -1).contiguous())
    return logits


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the target, and the ``top`` most likely tokens at its position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """The target's raw log-probabilities (before temperature, penalties and any grammar mask, as vLLM reports them
    by default) of ``tokens``, one per row of ``logits`` ([len(tokens), vocab])."""
    logprobs = logits.float().log_softmax(-1)  # [n, vocab]
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logits.device)[:, None]).squeeze(1).tolist()
    alternatives = _top_first_among_equals(logprobs, top) if top else [()] * len(tokens)
    return [TokenLogprob(t, lp, alt) for t, lp, alt in zip(tokens, chosen, alternatives)]


def _top_first_among_equals(logprobs: torch.Tensor, top: int) -> list[tuple[tuple[int, float], ...]]:
    """Each row's ``top`` most likely (id, log-probability), equals in id order as greedy breaks ties (topk orders
    equals arbitrarily, so a greedy token tied in bf16 could be listed second)."""
    top = min(top, logprobs.shape[-1])
    values, ids = logprobs.topk(top, dim=-1)
    ids, by_id = ids.sort(dim=-1)
    values, by_value = values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(1, by_value)
    rows = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    # a tie across the cut: which of the equals made the set was topk's choice too
    for r in ((logprobs >= values[:, -1:]).sum(-1) > top).nonzero().flatten().tolist():
        order = logprobs[r].sort(descending=True, stable=True)
        rows[r] = tuple(zip(order.indices[:top].tolist(), order.values[:top].tolist()))
    return rows
