"""Drafting from an EAGLE-3 head: what it drafts is what training trained, and the output stays the target's."""

from __future__ import annotations

import copy

import pytest
import torch

from depctl_runtime.model import decoder
from depctl_runtime.model.eagle import EagleConfig, EagleHead, layer_outputs
from depctl_runtime.model.runner import ModelRunner
from depctl_runtime.speculation import EngineConfig, GenerationParams, SamplingParams, Scheduler, SpeculativeEngine
from depctl_runtime.speculation.eagle import EagleProposer
from depctl_runtime.speculation.policy import rate_for_mean_accepted
from tests.driving import BATCH_PROMPTS as PROMPTS
from tests.driving import GREEDY, draft_step_by_step, drive


@pytest.fixture(scope="module")
def fused(target):
    model = copy.deepcopy(target)
    assert decoder.fuse_projections(model)
    return model


def make_head(model, seed: int = 0, draft_vocab: int = 96) -> EagleHead:
    config = EagleConfig.for_target(model.config, draft_vocab)
    head = EagleHead(config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name != "embed_tokens.weight":
                p.normal_(0, 0.3)
    head.embed_tokens.weight.data = model.get_input_embeddings().weight.data
    head.set_vocabulary(torch.arange(0, 2 * draft_vocab, 2))  # every other byte: some of the target's tokens
    return head.eval()


def engine(model, head, rows=1, k=4, adaptive=False, **cfg):
    runner = ModelRunner(model, max_rows=rows, max_context=512, features=head.config.aux_layers if head else ())
    proposer = EagleProposer(head, rows, runner.vocab_size or model.config.vocab_size) if head else None
    return SpeculativeEngine(
        runner, proposer, EngineConfig(num_draft_tokens=k if head else 0, max_context=512, adaptive=adaptive, **cfg)
    )


def reference_drafts(model, head, tokens: list[int], width: int) -> list[int]:
    """The head's greedy drafts after ``tokens``, computed as training computes them: the target's layer outputs
    from transformers' own forward, and the step-by-step drafting loop the training-time test is checked against."""
    with torch.no_grad():
        _, features = layer_outputs(model, torch.tensor([tokens]), head.config.aux_layers)  # [n, 3 * hidden]
    p = len(tokens) - 2  # the last index with a next token
    chain = list(tokens)
    for step in range(1, width + 1):
        logits = draft_step_by_step(head, torch.tensor(chain), features, p, step)[-1]
        chain.append(int(head.target_ids[logits.argmax()]))
    return chain[len(tokens) :]


def test_drafts_are_what_the_training_time_test_trains(fused):
    head = make_head(fused)
    eng = engine(fused, head, rows=2)
    seqs = [eng.new_sequence(PROMPTS[i], GREEDY) for i in (4, 0)]
    for row, seq in enumerate(seqs):
        seq.row = row
        while eng.prefill(seq, 7) is None:  # in chunks, as the scheduler reads a prompt
            pass
    drafts = eng.draft_model.propose(seqs, 4)
    for seq, got in zip(seqs, drafts.tokens):
        assert got == reference_drafts(fused, head, seq.tokens, 4)
    # after a verify step the head catches up on the accepted tokens and drafts from there again
    eng.step(seqs)
    drafts = eng.draft_model.propose(seqs, 3)
    for seq, got in zip(seqs, drafts.tokens):
        assert got == reference_drafts(fused, head, seq.tokens, 3)


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_greedy_output_equals_plain_decoding_as_rows_join_and_leave(fused, batch):
    head = make_head(fused)
    arrivals = [(2 * i, PROMPTS[i], GenerationParams(max_tokens=10 + 4 * i, ignore_eos=True)) for i in range(8)]
    plain, _ = drive(Scheduler(engine(fused, None, batch), batch, prefill_chunk=8), arrivals)
    eng = engine(fused, head, batch)
    got, _ = drive(Scheduler(eng, batch, prefill_chunk=8), arrivals)
    assert got == plain
    assert eng.stats.num_draft_tokens > 0


def test_mixed_rows_sampled_plain_and_greedy_stay_exact_and_seeded_rows_reproduce(fused):
    head = make_head(fused)
    sampled = GenerationParams(max_tokens=20, ignore_eos=True, sampling=SamplingParams(temperature=0.8, seed=5))
    arrivals = [
        (0, PROMPTS[0], GenerationParams(max_tokens=20, ignore_eos=True, speculate=False)),
        (0, PROMPTS[1], GREEDY),
        (1, PROMPTS[2], sampled),
        (3, PROMPTS[4], GREEDY),
        # a predicted output drafts first; where the output leaves it, the head drafts
        (4, PROMPTS[5], GenerationParams(max_tokens=20, ignore_eos=True, prediction=(9, 9, 9, 1, 2, 3))),
    ]
    got, _ = drive(Scheduler(engine(fused, head, 4), 4, prefill_chunk=8), arrivals)
    plain, _ = drive(Scheduler(engine(fused, None, 4), 4, prefill_chunk=8), arrivals)
    for i in (0, 1, 3, 4):
        assert got[i] == plain[i], i
    again, _ = drive(Scheduler(engine(fused, head, 4), 4, prefill_chunk=8), arrivals)
    assert again[2] == got[2]


def test_a_head_whose_unsure_drafts_are_not_verified_decodes_as_plain_decoding(fused):
    head = make_head(fused)
    arrivals = [(i, PROMPTS[i], GenerationParams(max_tokens=16 + 2 * i, ignore_eos=True)) for i in range(6)]
    plain, _ = drive(Scheduler(engine(fused, None, 3), 3, prefill_chunk=8), arrivals)
    eng = engine(fused, head, 3, adaptive=True, cut_unsure_drafts=True)
    eng.policy.width = lambda plans, **_: (4, {"model": 1.0})  # every step asks for four
    eng.policy.draft_threshold = lambda batch: 0.05  # a random head is rarely sure
    kept = []
    propose = eng.draft_model.propose
    eng.draft_model.propose = lambda batch, width, sure: (
        (made := propose(batch, width, sure)) and (kept.extend(made.confident) or made)
    )
    seen = []  # what the policy learns the head's confidence is worth from: each verified chain and its outcome
    eng.policy.observe_confidence = lambda chain, accepted: seen.append((chain, accepted))
    got, _ = drive(Scheduler(eng, 3, prefill_chunk=8), arrivals)
    assert got == plain
    assert 0 in kept and max(kept) > 0, kept  # some drafts cut, some verified
    assert sum(len(chain) for chain, _ in seen) == eng.stats.num_draft_tokens  # every verified draft, once
    for chain, accepted in seen:
        assert 1 >= chain[0] and all(a >= b >= 0.05 for a, b in zip(chain, chain[1:])) and chain[-1] >= 0.05
        assert 0 <= accepted <= len(chain)


def test_sampled_drafts_carry_the_heads_distribution_over_the_target_vocabulary(fused):
    head = make_head(fused, draft_vocab=40)
    eng = engine(fused, head)
    seq = eng.new_sequence(PROMPTS[1], GenerationParams(sampling=SamplingParams(temperature=0.7)))
    seq.row = 0
    while eng.prefill(seq, 64) is None:
        pass
    drafts = eng.draft_model.propose([seq], 3)
    q = drafts.probs[0]  # [3, vocab]
    assert q.shape == (3, eng.target.vocab_size or fused.config.vocab_size)
    torch.testing.assert_close(q.sum(-1), torch.ones(3))
    outside = torch.ones(q.shape[1], dtype=torch.bool)
    outside[head.target_ids] = False
    assert q[:, outside].sum() == 0  # only the head's vocabulary is ever drafted
    assert all(q[j, t] > 0 for j, t in enumerate(drafts.tokens[0]))


def test_rows_moved_and_cut_keep_the_head_in_step(fused):
    head = make_head(fused)
    eng = engine(fused, head, rows=2)
    proposer = eng.draft_model
    a = eng.new_sequence(PROMPTS[0], GREEDY)
    a.row = 1
    while eng.prefill(a, 64) is None:
        pass
    eng.move_row(1, 0)  # the scheduler compacts rows when one leaves
    a.row = 0
    assert proposer.waiting[1] is None and proposer.waiting[0].count == len(PROMPTS[0])
    assert proposer.propose([a], 2).tokens[0] == reference_drafts(fused, head, a.tokens, 2)
    eng.release_row(0)
    assert proposer.lengths[0] == 0 and proposer.waiting[0] is None


def test_a_row_that_decodes_plainly_for_long_drafts_from_every_feature_it_was_handed(fused):
    """Features wait while a row decodes plainly (the policy's choice at high load): past the buffer's first
    capacity they are appended, and a later draft catches up on all of them."""
    import dataclasses

    head = make_head(fused)
    eng = engine(fused, head)
    seq = eng.new_sequence(PROMPTS[3], GenerationParams(max_tokens=200, ignore_eos=True, speculate=False))
    seq.row = 0
    while eng.prefill(seq, 8) is None:
        pass
    for _ in range(80):
        eng.step([seq])
    held = eng.draft_model.waiting[0]
    assert held.count == len(seq.tokens) - 1 > 64 and held.buf.shape[0] >= held.count
    seq.params = dataclasses.replace(seq.params, speculate=True)
    assert eng.draft_model.propose([seq], 3).tokens[0] == reference_drafts(fused, head, seq.tokens, 3)
    eng.step([seq])
    assert eng.draft_model.propose([seq], 2).tokens[0] == reference_drafts(fused, head, seq.tokens, 2)


def test_heads_swapped_mid_stream_leave_greedy_and_seeded_output_unchanged(fused, tmp_path):
    """A learning deployment drafts with its n-gram index, then with each new head generation, swapped between steps
    while rows are under way: each row's next draft comes from the new head, caught up on the features the observer
    kept, and no row's output changes."""
    from depctl_runtime.speculation import NgramProposer
    from depctl_runtime.training.traffic import TrafficRecorder, TrafficStore

    seeded = GenerationParams(max_tokens=30, ignore_eos=True, sampling=SamplingParams(temperature=0.8, seed=3))
    arrivals = [(0, PROMPTS[0], GREEDY), (1, PROMPTS[1], seeded), (2, PROMPTS[2], GREEDY), (9, PROMPTS[3], seeded)]
    plain, _ = drive(Scheduler(engine(fused, None, 3), 3, prefill_chunk=8), arrivals)
    recorder = TrafficRecorder(TrafficStore(tmp_path / "traffic", 1 << 30), torch.float32)
    runner = ModelRunner(fused, max_rows=3, max_context=512, features=make_head(fused).config.aux_layers)
    eng = SpeculativeEngine(
        runner,
        NgramProposer(2),
        EngineConfig(num_draft_tokens=4, max_context=512, adaptive=False),
        observer=recorder,
    )
    scheduler = Scheduler(eng, 3, prefill_chunk=8)
    heads = {8: make_head(fused, seed=1), 20: make_head(fused, seed=2)}
    drafted_by_head = []
    kinds = []  # (heads swapped in so far, the step's kind as the policy's guard was told)
    observe = eng.policy.observe_step_time

    def observe_step_time(seconds, batch, emitted=None, kind=None):
        kinds.append((len(drafted_by_head), kind))
        observe(seconds, batch, emitted, kind)

    eng.policy.observe_step_time = observe_step_time

    def swap(it: int) -> None:
        if it in heads:
            before = eng.stats.num_draft_tokens
            proposer = EagleProposer(heads[it], 3, runner.vocab_size or fused.config.vocab_size)
            rows = scheduler.running + ([scheduler.prefilling] if scheduler.prefilling else [])
            eng.swap_proposer(proposer, rows, recorder.features, mean_accepted=1.5)
            assert eng.draft_model is proposer and scheduler.running
            # the head's held-out mean accepted length at K is its drafts' prior, apart from the n-gram index's
            assert eng.policy.model_rate == pytest.approx(rate_for_mean_accepted(1.5, 4))
            drafted_by_head.append(before)

    got, _ = drive(scheduler, arrivals, on_iteration=swap)
    assert got == plain
    assert eng.stats.num_draft_tokens > drafted_by_head[1] > drafted_by_head[0]  # each head drafted
    # the guard judges the head's steps apart from the index's copies, which go on beside it
    assert "model" not in {kind for swapped, kind in kinds if swapped == 0}
    assert {"free", "model"} <= {kind for swapped, kind in kinds if swapped > 0}


def test_where_the_heads_steps_are_turned_off_the_free_guesses_draft_without_it(fused):
    # a learning deployment's head measured a loss at this load while the n-gram index's copies gain: the policy
    # drafts the copies alone. The engine ran the head anyway, and verified its drafts beside the copies
    arrivals = [(i, PROMPTS[i], GenerationParams(max_tokens=24, ignore_eos=True)) for i in range(6)]
    plain, _ = drive(Scheduler(engine(fused, None, 3), 3, prefill_chunk=8), arrivals)
    eng = engine(fused, make_head(fused), 3, adaptive=True)
    eng.free = _EveryOtherRequest()  # the index finds a copy for some rows, the head drafts for the others
    eng.policy.verify_cost.samples.update({n: 0.010 + 0.0001 * n for n in (1, 2, 4, 8, 16)})  # drafts nearly free
    eng.policy.draft_cost.samples.update({1: 0.001, 3: 0.001})
    eng.policy.guard.allows = lambda batch, kind: kind != "model"
    eng.policy._perfect_drafts_pay = lambda rows: False  # and no probe of the head's acceptance either
    # the costs stay as set: passes timed on a busy machine (the suite's other worker) priced every draft out
    for cost in (eng.policy.verify_cost, eng.policy.draft_cost, eng.policy.draft_start_cost):
        cost.observe = lambda n, seconds: None
    ran = []
    propose = eng.draft_model.propose
    eng.draft_model.propose = lambda *a: ran.append(1) or propose(*a)
    got, _ = drive(Scheduler(eng, 3, prefill_chunk=8), arrivals)
    assert got == plain
    assert eng.stats.num_draft_tokens > 0 and eng.stats.num_model_drafts == 0
    assert not ran


class _EveryOtherRequest:
    """A free proposer with a guess for even-numbered requests only (the last token again, twice)."""

    name = "every-other"

    def propose(self, seq, k):
        return [seq.tokens[-1]] * min(k, 2) if seq.id % 2 == 0 else []

    def finish(self, seq):
        pass
