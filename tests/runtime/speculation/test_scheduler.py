"""Continuous batching: a request's output does not depend on what else is in the batch (tiny models, CPU)."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from depctl_runtime.backends.precision import surgery_for
from depctl_runtime.model.runner import ModelRunner
from depctl_runtime.speculation import (
    EngineConfig,
    GenerationParams,
    NgramProposer,
    SamplingParams,
    Scheduler,
    SpeculativeEngine,
)
from tests.driving import BATCH_PROMPTS as PROMPTS
from tests.driving import GREEDY, drive, engine_for, solo
from tests.tiny import tiny_llama


@pytest.mark.parametrize("batch", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("method", ["plain", "ngram", "suffix", "draft"])
def test_greedy_output_does_not_depend_on_the_batch(target, draft, method, batch):
    # different prompt lengths, and max_tokens that make requests leave at different steps
    arrivals = [(0, PROMPTS[i], GenerationParams(max_tokens=12 + 5 * i, ignore_eos=True)) for i in range(batch)]
    got, finish = drive(Scheduler(engine_for(target, method, batch, draft), batch, prefill_chunk=8), arrivals)
    for i, (_, prompt, params) in enumerate(arrivals):
        assert got[i] == solo(target, prompt, params), (method, batch, i)
        assert finish[i] == "length"


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft"])
def test_requests_join_and_leave_mid_flight(target, draft, method):
    # 8 requests through 3 rows: the rest wait, join as rows free up, and prefill in chunks of 4 while others decode
    arrivals = [(3 * i, PROMPTS[i], GenerationParams(max_tokens=8 + 3 * i, ignore_eos=True)) for i in range(8)]
    scheduler = Scheduler(engine_for(target, method, 3, draft, adaptive=True), 3, prefill_chunk=4)
    got, _ = drive(scheduler, arrivals)
    for i, (_, prompt, params) in enumerate(arrivals):
        assert got[i] == solo(target, prompt, params), i


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft"])
def test_mixed_requests_in_one_batch(target, draft, method):
    # plain (speculate=false), the deployment's proposer, a predicted output (right and wrong), side by side
    right = tuple(solo(target, PROMPTS[2], GREEDY))
    wrong = tuple((t + 3) % 256 for t in solo(target, PROMPTS[3], GREEDY))
    arrivals = [
        (0, PROMPTS[0], GenerationParams(max_tokens=30, ignore_eos=True, speculate=False)),
        (0, PROMPTS[1], GREEDY),
        (1, PROMPTS[2], GenerationParams(max_tokens=30, ignore_eos=True, prediction=right)),
        (2, PROMPTS[3], GenerationParams(max_tokens=30, ignore_eos=True, prediction=wrong)),
        (2, PROMPTS[4], GREEDY),
    ]
    got, _ = drive(Scheduler(engine_for(target, method, 5, draft), 5, prefill_chunk=8), arrivals)
    for i, (_, prompt, params) in enumerate(arrivals):
        assert got[i] == solo(target, prompt, GREEDY), i


def test_a_cancelled_neighbour_leaves_the_others_exact(target):
    arrivals = [(0, PROMPTS[i], GREEDY) for i in range(4)]
    scheduler = Scheduler(engine_for(target, "ngram", 4), 4, prefill_chunk=8)
    got, finish = drive(scheduler, arrivals, cancel_at={1: 5, 3: 0})
    assert finish[1] == "cancelled" and finish[3] == "cancelled"
    assert len(got[1]) < 30
    for i in (0, 2):
        assert got[i] == solo(target, PROMPTS[i], GREEDY)
    assert all(length == 0 for length in scheduler.engine.target.cache.lengths)  # every row was given back


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft"])
def test_seeded_sampling_is_reproducible_whatever_the_neighbours(target, draft, method):
    seeded = GenerationParams(
        max_tokens=30, ignore_eos=True, sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    )
    alone = solo(target, PROMPTS[1], seeded)  # plain decoding, batch of one
    noisy = GenerationParams(max_tokens=25, ignore_eos=True, sampling=SamplingParams(temperature=1.0))
    arrivals = [(0, PROMPTS[0], noisy), (1, PROMPTS[1], seeded), (2, PROMPTS[2], GREEDY), (4, PROMPTS[4], noisy)]
    for adaptive in (False, True):  # draft lengths chosen by measured costs must not matter either
        got, _ = drive(Scheduler(engine_for(target, method, 4, draft, adaptive=adaptive), 4, prefill_chunk=8), arrivals)
        assert got[1] == alone
    other = GenerationParams(
        max_tokens=30, ignore_eos=True, sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=8)
    )
    assert solo(target, PROMPTS[1], other) != alone


def test_rollback_leaves_each_row_at_its_accepted_length(target):
    # one batch step with three rows: all drafts accepted, the first draft rejected, and no draft (k_i = 0)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    plain = [solo(target, p, GenerationParams(max_tokens=20, ignore_eos=True)) for p in prompts]

    class Oracle:
        """Row 0 gets the true continuation, row 1 a wrong first draft, row 2 nothing."""

        name = "oracle"

        def propose(self, seq, k):
            tokens = seq.tokens
            b = next(i for i, p in enumerate(prompts) if list(tokens[: len(p)]) == p)
            truth = plain[b][len(tokens) - len(prompts[b]) :][:k]
            return [truth, [(truth[0] + 1) % 256] + truth[1:], []][b]

        def finish(self, seq):
            pass

    engine = SpeculativeEngine(
        ModelRunner(target, max_rows=3, max_context=512),
        Oracle(),
        EngineConfig(num_draft_tokens=4, max_context=512, adaptive=False),
    )
    seqs = [engine.new_sequence(p, GenerationParams(max_tokens=20, ignore_eos=True)) for p in prompts]
    for row, s in enumerate(seqs):  # what the scheduler does on admission: a row each, the prompt prefilled
        s.row = row
        engine.prefill(s, s.prompt_len)
    lengths_before = [len(s.tokens) for s in seqs]
    outs = dict((s.id, o) for s, o in zip(seqs, engine.step(seqs)))
    emitted = [len(outs[s.id].token_ids) for s in seqs]
    assert [outs[s.id].accepted for s in seqs] == [4, 0, 0] and emitted == [5, 1, 1]
    for b, s in enumerate(seqs):
        assert s.tokens[s.prompt_len :] == plain[b][: len(s.tokens) - s.prompt_len]
        assert engine.target.length(s.row) == lengths_before[b] + emitted[b] - 1


def test_a_row_in_a_batch_samples_from_the_target(target):
    # the rejection sampler sees its own row of the batch's logits: its first token follows the target's
    # distribution, not the draft's, and not a neighbour's
    vocab, trials = 6, 20_000
    engine = engine_for(target, "plain", 3)
    target_p = torch.tensor([0.05, 0.40, 0.05, 0.30, 0.10, 0.10])
    neighbour = torch.tensor([0.40, 0.05, 0.30, 0.05, 0.10, 0.10])
    # the pass's stream: a neighbour's 2 tokens, this row's 2 (rows 2:4), another neighbour's 2
    stream = torch.cat([neighbour.log().expand(2, -1), target_p.log().expand(2, -1), neighbour.log().expand(2, -1)])
    draft_q = neighbour  # the draft proposes from the neighbour's distribution
    seq = engine.new_sequence([1, 2], GenerationParams(sampling=SamplingParams(temperature=1.0)))
    seq.generator.manual_seed(3)
    counts = torch.zeros(vocab)
    for _ in range(trials):
        d = int(torch.multinomial(draft_q, 1, generator=seq.generator))
        n, token = engine._accept(seq, [d], draft_q[None], lambda rows: stream[rows], slice(2, 4), [])
        counts[d if n else token] += 1
    tv = 0.5 * float((counts / trials - target_p).abs().sum())
    assert tv < 0.02


def bf16_engines(target, speculate):
    """A factory of engines (``rows`` -> engine) over one bf16 copy of ``target`` with the loader's exact surgery."""
    from depctl_runtime.backends.precision import surgery_for

    model = surgery_for(copy.deepcopy(target).to(torch.bfloat16), "bfloat16", exact=True)

    def engine(rows):
        return SpeculativeEngine(
            ModelRunner(model, max_rows=rows),
            NgramProposer(2) if speculate else None,
            EngineConfig(num_draft_tokens=4 if speculate else 0, max_context=512, adaptive=False),
        )

    return engine


@pytest.mark.parametrize("speculate", [False, True])
def test_half_precision_rows_are_the_same_alone_and_in_a_batch(target, speculate):
    # bf16 on a CPU: a batched decode step once gave a row other bits than the same row alone (one of eight prompts
    # diverged); rows are now attended each as in a batch of one, and linears are row-invariant (split-K)
    engine = bf16_engines(target, speculate)
    prompts = [list((f"prompt number {i} " * (i % 3 + 1)).encode()) for i in range(8)]
    params = GenerationParams(max_tokens=40, ignore_eos=True)
    solo = [Scheduler(engine(1), 1).run_all([p], params)[0] for p in prompts]
    assert Scheduler(engine(8), 8).run_all(prompts, params) == solo


def _prefill_chunks(engine):
    """Record every prefill pass's (sequence id, first prompt position, tokens) on ``engine``."""
    calls, prefill = [], engine.prefill

    def spy(seq, budget, more=None):
        before = seq.prefilled
        out = prefill(seq, budget, more)
        if seq.prefilled != before or out is not None:  # a chunk's pass ran to its last layer
            calls.append((seq.id, before, seq.prefilled - before))
        return out

    engine.prefill = spy
    return calls


def test_a_prompt_is_cut_into_the_same_chunks_alone_and_under_load(target):
    # a prompt read in one go when the deployment is idle and in 128-token chunks when it is busy had different
    # bits in its cache (bf16, SmolLM2: one of 21 benchmark prompts decoded differently in a batch of 8)
    long_prompt = list(range(20, 90))  # 70 tokens: 4 chunks of 16 and one of 6
    alone = engine_for(target, "plain", 4)
    alone_calls = _prefill_chunks(alone)
    Scheduler(alone, 4, prefill_chunk=16).run_all([long_prompt], GREEDY)
    busy = engine_for(target, "plain", 4)
    busy_calls = _prefill_chunks(busy)
    drive(Scheduler(busy, 4, prefill_chunk=16), [(0, [5, 6, 7], GREEDY), (2, long_prompt, GREEDY)])
    cut = [(start, n) for _, start, n in alone_calls]
    assert cut == [(0, 16), (16, 16), (32, 16), (48, 16), (64, 6)]
    assert [(start, n) for _, start, n in busy_calls if n > 3 or start] == cut


@pytest.mark.parametrize("speculate", [False, True])
def test_half_precision_long_prompts_are_the_same_alone_and_arriving_under_load(target, speculate):
    # prompts longer than a chunk, arriving while others decode, decode as they do alone (see the test above)
    engine = bf16_engines(target, speculate)
    prompts = [list((f"a longer prompt, number {i}, read in chunks; " * (i % 3 + 2)).encode()) for i in range(6)]
    params = GenerationParams(max_tokens=40, ignore_eos=True)
    solo = [Scheduler(engine(1), 1, prefill_chunk=32).run_all([p], params)[0] for p in prompts]
    got, _ = drive(Scheduler(engine(4), 4, prefill_chunk=32), [(3 * i, p, params) for i, p in enumerate(prompts)])
    assert [got[i] for i in range(len(prompts))] == solo


@pytest.mark.parametrize("method", ["plain", "ngram", "draft"])
def test_a_prompt_read_a_layer_at_a_time_beside_running_streams_is_exact(fused_target, draft, method):
    # prefill_share=0 and no floor: every iteration runs half a layer of the prompt's chunk, then the batch's step;
    # streams leave (their rows move, the half-read one with them) and one is cancelled while a chunk is half-way
    # through
    engine = engine_for(fused_target, method, 3, draft)
    scheduler = Scheduler(engine, 3, prefill_chunk=16, prefill_share=0.0, prefill_floor=0.0)
    long_prompts = [list(range(30, 100)), list(range(140, 180))]
    arrivals = [
        (0, PROMPTS[0], GenerationParams(max_tokens=6, ignore_eos=True)),
        (0, PROMPTS[1], GenerationParams(max_tokens=40, ignore_eos=True)),
        (1, long_prompts[0], GenerationParams(max_tokens=12, ignore_eos=True)),
        (2, PROMPTS[2], GenerationParams(max_tokens=9, ignore_eos=True)),
        (3, long_prompts[1], GenerationParams(max_tokens=12, ignore_eos=True)),
        (4, PROMPTS[3], GenerationParams(max_tokens=30, ignore_eos=True)),
    ]
    half_read = []
    step = scheduler.step

    def watched():
        out = step()
        half_read.append(engine._reading is not None)
        return out

    scheduler.step = watched
    got, finish = drive(scheduler, arrivals)
    for i, (_, prompt, params) in enumerate(arrivals):
        assert got[i] == solo(fused_target, prompt, params), i
    assert sum(half_read) >= 2 * len(fused_target.model.layers)  # chunks did stop within layers
    cancelled = engine_for(fused_target, method, 3, draft)
    scheduler = Scheduler(cancelled, 3, prefill_chunk=16, prefill_share=0.0, prefill_floor=0.0)
    got, finish = drive(scheduler, arrivals[:3] + arrivals[4:], cancel_at={2: 3})
    assert finish[2] == "cancelled" and cancelled._reading is None
    assert got[3] == solo(fused_target, long_prompts[1], arrivals[4][2])
    assert all(length == 0 for length in cancelled.target.cache.lengths)


@pytest.mark.parametrize("method", ["plain", "ngram", "draft"])
def test_a_prompt_read_in_narrower_chunks_beside_running_streams_is_exact(draft, method):
    """Where any cut within a block leaves the same bits (row-invariant products), a prompt read beside streams
    takes narrower chunks while a part of a layer outlasts the iteration's share (prefill_share=0: always), and
    never crosses a block's end."""
    target = surgery_for(tiny_llama(3, layers=2, max_positions=1024), "float32", exact=True)
    engine = engine_for(target, method, 3, draft)
    assert engine.cuts_exact
    calls = _prefill_chunks(engine)
    scheduler = Scheduler(engine, 3, prefill_share=0.0, prefill_floor=0.0)
    long_prompt = [(7 * i) % 200 + 20 for i in range(300)]
    arrivals = [
        (0, PROMPTS[0], GenerationParams(max_tokens=200, ignore_eos=True)),
        (1, long_prompt, GenerationParams(max_tokens=12, ignore_eos=True)),
        (2, PROMPTS[1], GenerationParams(max_tokens=8, ignore_eos=True)),
    ]
    got, _ = drive(scheduler, arrivals)
    for i, (_, prompt, params) in enumerate(arrivals):
        assert got[i] == solo(target, prompt, params), i
    chunks = [(start, n) for _, start, n in calls]
    assert 16 in {n for _, n in chunks} and all(start // 128 == (start + n - 1) // 128 for start, n in chunks)


@pytest.mark.parametrize("method", ["plain", "ngram"])
def test_prompts_waiting_beside_streams_are_read_while_the_iterations_share_lasts(target, method):
    # a short prompt takes a sliver of a step's time: one prompt an iteration left the share unused and capped how
    # fast a busy batch refilled, so at 32 clients with short answers the queue held a third of the clients
    engine = engine_for(target, method, 4)
    step = engine.step

    def slow_step(batch):  # a step of a large model: the share it gives prompts dwarfs a tiny prompt's pass
        time.sleep(0.1)
        return step(batch)

    engine.step = slow_step
    scheduler = Scheduler(engine, 4, prefill_share=1.0)
    running = []
    iterate = scheduler.step

    def counted():
        out = iterate()
        running.append(len(scheduler.running))
        return out

    scheduler.step = counted
    params = GenerationParams(max_tokens=8, ignore_eos=True)
    arrivals = [(0, PROMPTS[0], GenerationParams(max_tokens=20, ignore_eos=True))] + [
        (2, prompt, params) for prompt in PROMPTS[1:4]
    ]
    got, _ = drive(scheduler, arrivals)
    assert running[:3] == [1, 1, 4]  # all three read in the iteration they arrived in
    for i, (_, prompt, p) in enumerate(arrivals):
        assert got[i] == solo(target, prompt, p), i


def test_a_burst_of_prompts_beside_a_short_step_gets_a_floor_of_prompt_time():
    # a burst at an idle deployment: the first prompt joins and its one-row step takes a sliver of time, so a share of
    # that step alone read the rest a part of a layer an iteration, the queue waiting dozens of steps of one row
    # a prompt's pass stops between parts of layers; row-invariant products: a row's bits whatever joins the batch
    target = surgery_for(tiny_llama(3, layers=2), "float32", exact=True)

    def iterations_to_join_all(floor: float) -> tuple[int, list]:
        engine = engine_for(target, "ngram", len(PROMPTS))
        prefill = engine.prefill

        def slow_parts(seq, budget, more=None):  # each part of a layer of a large model's prompt pass: 10 ms
            if more is None:
                return prefill(seq, budget)

            def slowly():
                time.sleep(0.01)
                return more()

            return prefill(seq, budget, more=slowly)

        engine.prefill = slow_parts
        scheduler = Scheduler(engine, len(PROMPTS), prefill_floor=floor)
        seqs = [engine.new_sequence(p, GenerationParams(max_tokens=64, ignore_eos=True)) for p in PROMPTS]
        for seq in seqs:
            scheduler.add(seq)
        got = {s.id: [] for s in seqs}
        iterations = 0
        while not all(got.values()):  # until every request has its first token
            for s, o in scheduler.step():
                got[s.id] += o.token_ids
            iterations += 1
        while scheduler.has_work():
            for s, o in scheduler.step():
                got[s.id] += o.token_ids
        return iterations, [got[s.id] for s in seqs]

    without, out_without = iterations_to_join_all(0.0)
    floored, out_floored = iterations_to_join_all(0.1)
    # steps between the burst's arrival and its last first token: the floor holds while the queue outnumbers the rows
    assert floored <= 0.75 * without, (floored, without)
    params = GenerationParams(max_tokens=64, ignore_eos=True)
    assert out_floored == out_without == [solo(target, p, params) for p in PROMPTS]
