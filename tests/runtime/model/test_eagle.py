"""The EAGLE-3 head: training-time test computes exactly what drafting computes, and the vocabulary map."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from depctl_runtime.model.eagle import EagleConfig, EagleHead, default_aux_layers


def tiny_head(seed: int = 0, vocab: int = 50, draft_vocab: int = 20) -> EagleHead:
    torch.manual_seed(seed)
    config = EagleConfig(
        hidden_size=32,
        target_hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        aux_layers=(0, 1, 2),
    )
    head = EagleHead(config)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
    head.set_vocabulary(torch.arange(0, vocab, vocab // draft_vocab)[:draft_vocab])
    return head.eval()


def draft_step_by_step(head: EagleHead, tokens, features, p: int, steps: int) -> list[torch.Tensor]:
    """Drafting from position p as a serving loop would run it, one query at a time over a growing key list: the
    step-0 entries of indices 0..p from the target's states, then the head's own chain. Returns each step's logits."""
    keys, values = [], []
    g = head.fuse(features)
    for i in range(p + 1):  # what the target verified: one entry per position, from its own states
        q, k, v, residual = head._qkv(tokens[i + 1 : i + 2], g[i : i + 1], torch.tensor([i]))
        keys.append(k)
        values.append(v)
    hidden = None
    out = []
    for j in range(steps):
        if j == 0:
            q, k, v, residual = head._qkv(tokens[p + 1 : p + 2], g[p : p + 1], torch.tensor([p]))
            keys[-1], values[-1] = k, v
        else:
            q, k, v, residual = head._qkv(tokens[p + 1 + j : p + 2 + j], hidden, torch.tensor([p + j]))
            keys.append(k)
            values.append(v)
        groups = head.config.num_attention_heads // head.config.num_key_value_heads
        kk = torch.cat(keys, dim=1).repeat_interleave(groups, 0)
        vv = torch.cat(values, dim=1).repeat_interleave(groups, 0)
        attended = F.scaled_dot_product_attention(q, kk, vv)  # every key is visible: none lies ahead
        hidden = head._finish(attended, residual)
        out.append(head.logits(hidden)[0])
    return out


def test_training_time_test_is_what_drafting_computes():
    head = tiny_head()
    torch.manual_seed(1)
    tokens = torch.randint(0, 50, (12,))
    features = torch.randn(12, 96)
    steps = 4
    ttt = head.ttt_logits(tokens, features, steps)
    assert [t.shape[0] for t in ttt] == [10, 9, 8, 7]  # step j, row i predicts tokens[i + 2 + j]
    for p in (0, 3, 6):
        chain = draft_step_by_step(head, tokens, features, p, steps)
        for j in range(steps):
            if p < ttt[j].shape[0]:
                torch.testing.assert_close(ttt[j][p], chain[j], atol=1e-5, rtol=1e-5)


def test_drafting_only_from_later_indices_gives_the_same_logits_there():
    # a prompt's indices give keys but no drafts (training counts answers only): the rows that draft are unchanged
    head = tiny_head()
    torch.manual_seed(2)
    tokens = torch.randint(0, 50, (14,))
    features = torch.randn(14, 96)
    full = head.ttt_logits(tokens, features, 3)
    for first in (1, 5):
        part = head.ttt_logits(tokens, features, 3, first=first)
        for j in range(3):
            torch.testing.assert_close(part[j], full[j][first:], atol=1e-5, rtol=1e-5)


def test_the_vocabulary_map_follows_speculators_convention():
    head = tiny_head(vocab=50, draft_vocab=5)
    head.set_vocabulary(torch.tensor([40, 3, 7, 0, 12]))
    assert head.target_ids.tolist() == [0, 3, 7, 12, 40]  # draft id d stands for d + d2t[d]
    assert head.d2t.tolist() == [0, 2, 5, 9, 36]
    assert head.t2d.nonzero().flatten().tolist() == [0, 3, 7, 12, 40]
    assert head.draft_ids(torch.tensor([7, 8, 40])).tolist() == [2, -1, 4]


def test_aux_layers_are_low_middle_and_high():
    assert default_aux_layers(30) == (2, 15, 27)  # SmolLM2-135M
    assert default_aux_layers(28) == (2, 14, 25)  # Qwen2.5-1.5B
    assert default_aux_layers(2) == (0, 1, 1)
