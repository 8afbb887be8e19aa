"""A fault in one row's own part of a step ends that row alone: the rest of the batch produces exactly what it would
have produced without it. A stand-in fault in each per-row part (grammar, free proposer, prediction, sampling, a
draft model's masked drafting), and one in the batch's shared pass, which ends only the requests in that step."""

from __future__ import annotations

import traceback

import pytest
import torch

from depctl_runtime.model.runner import ModelRunner
from depctl_runtime.speculation import (
    DraftModelProposer,
    EngineConfig,
    GenerationParams,
    NgramProposer,
    SamplingParams,
    Scheduler,
    SpeculativeEngine,
)
from depctl_runtime.speculation.grammar import GrammarCompiler, GrammarError
from depctl_runtime.speculation.proposers import PredictionTracker
from tests.driving import engine_for, solo
from tests.tiny import VOCAB, byte_tokenizer

EOS = 258
PROMPTS = [[5, 17, 42, 5, 17, 42, 5, 17], [100, 101, 102, 103], [64, 65, 66, 64, 65, 66, 64], [9, 9, 9, 9, 9]]
PLAIN = GenerationParams(max_tokens=24, ignore_eos=True)
SECRET = "the-other-tenants-secret-grammar"


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(byte_tokenizer(), VOCAB, [EOS])


def _run(scheduler: Scheduler, seqs, patch=None):
    """Step every sequence to its end; ``patch(seqs)`` plants the fault once they exist. {index: (tokens, last)}."""
    for seq in seqs:
        scheduler.add(seq)
    if patch is not None:
        patch(seqs)
    got = {i: [] for i in range(len(seqs))}
    last = {}
    index = {seq.id: i for i, seq in enumerate(seqs)}
    while scheduler.has_work():
        for seq, out in scheduler.step():
            got[index[seq.id]] += out.token_ids
            if out.finish_reason:
                last[index[seq.id]] = out
    return {i: (got[i], last[i]) for i in got}


def _assert_only(results, faulted: int, target, params_of, part: str, status: int, code: str):
    """Row ``faulted`` ended with its fault; every other row ran as it would alone."""
    for i, (tokens, last) in results.items():
        if i == faulted:
            assert last.finish_reason == "error" and last.error is not None, last
            assert (last.error.part, last.error.status, last.error.code) == (part, status, code)
            assert SECRET not in last.error.message and "<state>" not in last.error.message
        else:
            assert last.finish_reason == "length" and last.error is None
            assert tokens == solo(target, PROMPTS[i], params_of(i)), i


class _Faulty:
    """Raises on the ``after``-th call for the sequence it is planted in, then every time."""

    def __init__(self, real, after: int, exc: Exception):
        self.real, self.after, self.exc, self.calls = real, after, exc, 0
        self.raised_in: set[str] = set()  # the functions on the stack when it raised

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls >= self.after:
            self.raised_in |= {frame.name for frame in traceback.extract_stack()}
            raise self.exc
        return self.real(*args, **kwargs)


@pytest.mark.parametrize("method", ["plain", "ngram", "draft"])
def test_a_grammar_that_fails_mid_output_ends_its_row_alone(target, draft, compiler, method):
    # the bug: llguidance giving up on one request's grammar raised on the engine thread, and every request of the
    # deployment failed with that request's parser state as its error
    grammar = compiler.compile(compiler.from_regex("[a-z ]{1,60}"))
    params = [PLAIN, PLAIN, GenerationParams(max_tokens=24, grammar=grammar, stop_token_ids=(EOS,)), PLAIN]
    engine = engine_for(target, method, 4, draft)
    seqs = [engine.new_sequence(p, q) for p, q in zip(PROMPTS, params)]

    def plant(seqs):
        row = seqs[2].grammar
        error = GrammarError(f"lexer error: too many expressions constructed\n<state>{SECRET}</state>")
        row.advance = _Faulty(row.advance, 3, error)
        row._allowed = _Faulty(row._allowed, 6, error)

    results = _run(Scheduler(engine, 4, prefill_chunk=8), seqs, plant)
    _assert_only(results, 2, target, lambda i: PLAIN, "grammar", 400, "invalid_grammar")
    assert "too many expressions constructed" in results[2][1].error.message
    assert engine.stats.num_row_faults == 1


def test_a_free_proposer_that_fails_for_one_row_ends_that_row_alone(target):
    class Proposer(NgramProposer):
        def propose(self, seq, k):
            if seq.tokens[: len(PROMPTS[1])] == PROMPTS[1] and seq.produced > 3:
                raise IndexError(SECRET)
            return super().propose(seq, k)

    engine = SpeculativeEngine(
        ModelRunner(target, max_rows=4, max_context=512), Proposer(2), EngineConfig(4, 512, adaptive=False)
    )
    seqs = [engine.new_sequence(p, PLAIN) for p in PROMPTS]
    results = _run(Scheduler(engine, 4, prefill_chunk=8), seqs)
    _assert_only(results, 1, target, lambda i: PLAIN, "proposer", 500, "proposer_error")
    assert results[1][0] == solo(target, PROMPTS[1], PLAIN)[: len(results[1][0])]  # what it had was right


def test_a_prediction_tracker_that_fails_ends_its_row_alone(target):
    class Tracker(PredictionTracker):
        def propose(self, generated, k):
            if len(generated) > 2:
                raise KeyError(SECRET)
            return super().propose(generated, k)

    engine = SpeculativeEngine(
        ModelRunner(target, max_rows=4, max_context=512),
        NgramProposer(2),
        EngineConfig(4, 512, adaptive=False),
        Tracker,
    )
    params = [PLAIN, PLAIN, PLAIN, GenerationParams(max_tokens=24, ignore_eos=True, prediction=(1, 2, 3, 4, 5))]
    seqs = [engine.new_sequence(p, q) for p, q in zip(PROMPTS, params)]
    results = _run(Scheduler(engine, 4, prefill_chunk=8), seqs)
    _assert_only(results, 3, target, lambda i: PLAIN, "proposer", 500, "proposer_error")


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampling_that_fails_for_one_row_ends_that_row_alone(target, draft, method):
    sampled = GenerationParams(max_tokens=24, ignore_eos=True, sampling=SamplingParams(temperature=0.8))
    params = [PLAIN, sampled, PLAIN, PLAIN]
    engine = engine_for(target, method, 4, draft)
    seqs = [engine.new_sequence(p, q) for p, q in zip(PROMPTS, params)]

    def plant(seqs):
        seqs[1].generator = SECRET  # torch refuses it at the first draw: a stand-in for any sampling fault

    results = _run(Scheduler(engine, 4, prefill_chunk=8), seqs, plant)
    _assert_only(results, 1, target, lambda i: PLAIN, "sampling", 500, "sampling_error")


def test_a_fault_in_a_rows_first_token_ends_it_alone(target, compiler):
    grammar = compiler.compile(compiler.from_regex("[a-z]{1,30}"))
    engine = engine_for(target, "ngram", 4)
    params = [PLAIN, PLAIN, PLAIN, GenerationParams(max_tokens=24, grammar=grammar, stop_token_ids=(EOS,))]
    seqs = [engine.new_sequence(p, q) for p, q in zip(PROMPTS, params)]

    def plant(seqs):
        seqs[3].grammar.valid_prefix = _Faulty(seqs[3].grammar.valid_prefix, 1, GrammarError("lexer error: gave up"))

    results = _run(Scheduler(engine, 4, prefill_chunk=8), seqs, plant)
    _assert_only(results, 3, target, lambda i: PLAIN, "grammar", 400, "invalid_grammar")
    assert results[3][0] == []


def test_a_fault_in_the_shared_pass_ends_that_steps_requests_and_keeps_the_waiting(target):
    engine = engine_for(target, "ngram", 2)
    scheduler = Scheduler(engine, 2, prefill_chunk=8)
    seqs = [engine.new_sequence(p, PLAIN) for p in PROMPTS]
    for seq in seqs:
        scheduler.add(seq)
    while len(scheduler.running) < 2:  # two rows running, two waiting
        scheduler.step()
    score = engine.target.score
    engine.target.score = _Faulty(score, 1, RuntimeError(SECRET))
    with pytest.raises(RuntimeError):
        scheduler.step()
    engine.target.score = score
    finished = []  # what the engine lets go of a request (its policy share, its observer's features) must run
    engine.finish = lambda seq, finish=engine.finish: (finished.append(seq.id), finish(seq))
    ended = scheduler.abandon()
    assert [s.id for s in ended] == [seqs[0].id, seqs[1].id] == finished
    assert all(s.fault.code == "engine_error" and SECRET not in s.fault.message for s in ended)
    # the waiting requests run as they would have alone, in the rows the abandoned ones freed
    got = {seqs[2].id: [], seqs[3].id: []}
    while scheduler.has_work():
        for seq, out in scheduler.step():
            got[seq.id] += out.token_ids
    assert got[seqs[2].id] == solo(target, PROMPTS[2], PLAIN) and got[seqs[3].id] == solo(target, PROMPTS[3], PLAIN)


def test_a_draft_models_masked_drafting_that_fails_for_one_row_ends_it_alone(target, draft, compiler):
    grammar = compiler.compile(compiler.from_regex("[a-z ]{1,60}"))
    engine = SpeculativeEngine(
        ModelRunner(target, max_rows=4, max_context=512),
        DraftModelProposer(ModelRunner(draft, max_rows=4, max_context=512)),
        EngineConfig(4, 512, adaptive=False),
    )
    params = [PLAIN, GenerationParams(max_tokens=24, grammar=grammar, stop_token_ids=(EOS,)), PLAIN, PLAIN]
    seqs = [engine.new_sequence(p, q) for p, q in zip(PROMPTS, params)]

    faulty = {}

    def plant(seqs):
        row = seqs[1].grammar
        faulty["allowed"] = row.allowed = _Faulty(row.allowed, 2, GrammarError("lexer error: too many states"))

    results = _run(Scheduler(engine, 4, prefill_chunk=8), seqs, plant)
    _assert_only(results, 1, target, lambda i: PLAIN, "grammar", 400, "invalid_grammar")
    assert "draft_loop" in faulty["allowed"].raised_in  # the fault came while the draft model drafted the batch


def test_a_draft_models_sampling_that_fails_for_one_row_ends_it_alone(target, draft):
    engine = engine_for(target, "draft", 4, draft)
    sampled = GenerationParams(max_tokens=24, ignore_eos=True, sampling=SamplingParams(temperature=0.8))
    seqs = [engine.new_sequence(p, q) for p, q in zip(PROMPTS, [PLAIN, PLAIN, PLAIN, sampled])]
    multinomial = torch.multinomial
    calls = []

    def faulty(probs, n, generator=None):  # fails where the draft loop draws the sampling row's drafts
        caller = traceback.extract_stack()[-2].name
        if generator is seqs[3].generator and caller == "draft_loop":
            calls.append(caller)
            raise RuntimeError(SECRET)
        return multinomial(probs, n, generator=generator)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "multinomial", faulty)
        results = _run(Scheduler(engine, 4, prefill_chunk=8), seqs)
    assert "draft_loop" in calls
    _assert_only(results, 3, target, lambda i: PLAIN, "sampling", 500, "sampling_error")
