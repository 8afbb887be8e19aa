"""The EAGLE-3 head: training-time test computes exactly what drafting computes, and the vocabulary map."""

from __future__ import annotations

import copy

import torch

from depctl_runtime.model.eagle import default_aux_layers
from tests.driving import draft_step_by_step
from tests.tiny import tiny_head


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


def test_the_map_back_to_draft_ids_follows_every_change_of_vocabulary():
    head = tiny_head(vocab=50, draft_vocab=5)
    head.set_vocabulary(torch.tensor([40, 3, 7, 0, 12]))
    assert head.draft_ids(torch.tensor([7, 8])).tolist() == [2, -1]
    head.set_vocabulary(torch.tensor([1, 3, 8, 0, 12]))  # a new vocabulary
    assert head.draft_ids(torch.tensor([7, 8])).tolist() == [-1, 3]
    other = tiny_head(vocab=50, draft_vocab=5)
    other.set_vocabulary(torch.tensor([7, 9, 10, 11, 13]))
    head.load_state_dict(other.state_dict())  # a saved head's
    assert head.draft_ids(torch.tensor([7, 8])).tolist() == [0, -1]
    copied = copy.deepcopy(head)
    copied.set_vocabulary(torch.tensor([8, 9, 10, 11, 13]))  # a copy's change is its own
    assert copied.draft_ids(torch.tensor([7, 8])).tolist() == [-1, 0]
    assert head.draft_ids(torch.tensor([7, 8])).tolist() == [0, -1]


def test_aux_layers_are_low_middle_and_high():
    assert default_aux_layers(30) == (2, 15, 27)  # SmolLM2-135M
    assert default_aux_layers(28) == (2, 14, 25)  # Qwen2.5-1.5B
    assert default_aux_layers(2) == (0, 1, 1)


def test_a_bfloat16_head_keeps_its_queries_and_keys_in_bfloat16():
    """RoPE's frequencies stay float32: rotated queries must not be promoted (SDPA refuses float32 queries over the
    bfloat16 keys a GPU deployment's head keeps)."""
    head = tiny_head().to(torch.bfloat16)
    head.inv_freq = head.inv_freq.float()  # as loading leaves it
    q, k, v, _ = head._qkv(torch.tensor([1, 2]), torch.zeros(2, 32, dtype=torch.bfloat16), torch.tensor([3, 4]))
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16


def test_a_window_trained_after_the_one_before_it_sees_the_same_logits_as_the_whole_sequence():
    # a learning head trains a long answer a window at a time, each window attending to the keys the window before
    # it computed: the logits are those of one call over the whole answer (only the gradient stops at the window)
    head = tiny_head(seed=3)
    tokens = torch.randint(0, 50, (40,))
    features = torch.randn(39, 96)
    with torch.no_grad():
        whole = head.ttt_logits(tokens, features, 3, first=4)
        keys: list = []
        first = head.ttt_logits(tokens[:22], features[:21], 3, first=4, keys_out=keys)
        context = tuple(t[:, :20] for t in keys[0])
        second = head.ttt_logits(tokens, features, 3, first=20, context=context)
    for j in range(3):
        rows_first = first[j].shape[0]  # indices 4 .. 4 + rows_first - 1
        torch.testing.assert_close(first[j], whole[j][:rows_first])
        torch.testing.assert_close(second[j], whole[j][16:])  # indices 20 on
