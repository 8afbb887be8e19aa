"""The prefix cache in the engine: a request that starts from stored prompt blocks gets exactly what reading its
whole prompt gives, under every speculation method, greedy and seeded, alone and batched; a block is found only by
the same tenant and cache salt; the store keeps to its budget."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from depctl_runtime.backends.precision import surgery_for
from depctl_runtime.speculation import GenerationParams, SamplingParams
from depctl_runtime.speculation.engine import SpeculativeEngine
from depctl_runtime.speculation.params import Tenant
from depctl_runtime.speculation.scheduler import Scheduler
from tests.driving import engine_for
from tests.tiny import tiny_llama

BLOCK = 8
SHARED = [(7 * i + 3) % 200 + 10 for i in range(29)]  # 3 whole blocks and 5 tokens
TAILS = [[41, 42, 43], [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60], [9]]
GREEDY = GenerationParams(max_tokens=24, ignore_eos=True)
SEEDED = GenerationParams(max_tokens=24, ignore_eos=True, sampling=SamplingParams(temperature=0.9, seed=7))


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    return tiny_llama(seed=0), tiny_llama(seed=1, layers=1)


@pytest.fixture(scope="module")
def cut_anywhere():
    """A target whose prompt passes give the same bits wherever a prompt is cut (the loader's row-invariant products,
    depctl's own forward), and the draft: prompts resume mid-block."""
    torch.manual_seed(0)
    return surgery_for(tiny_llama(seed=0), "float32", exact=True), tiny_llama(seed=1, layers=1)


def _engine(models, method: str, rows: int, cache_bytes: int) -> SpeculativeEngine:
    target, draft = models
    engine = engine_for(target, method, rows, draft, prefix_cache_bytes=cache_bytes, prefix_block=BLOCK)
    engine.calibrate(context=16, repeats=0)  # the cache's tensors exist from here, as after a deployment's load
    return engine


def _run(engine, prompts, params, chunk: int = BLOCK) -> tuple[list[list[int]], list[int]]:
    """Every prompt at once; each one's output tokens and its prompt tokens read from the prefix cache."""
    scheduler = Scheduler(engine, engine.max_rows, prefill_chunk=chunk)
    seqs = [engine.new_sequence(p, params) for p in prompts]
    got, cached = {s.id: [] for s in seqs}, {s.id: 0 for s in seqs}
    for s in seqs:
        scheduler.add(s)
    while scheduler.has_work():
        for s, o in scheduler.step():
            got[s.id] += o.token_ids
            cached[s.id] += o.cached_tokens
    return [got[s.id] for s in seqs], [cached[s.id] for s in seqs]


@pytest.mark.parametrize("method", ["plain", "ngram", "suffix", "draft"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_prompt_from_cached_blocks_gives_what_reading_it_all_gives(models, method, params):
    prompts = [SHARED + tail for tail in TAILS]
    plain, _ = _run(_engine(models, method, 3, 0), prompts, params)
    cached_engine = _engine(models, method, 3, 1 << 30)
    first, cached = _run(cached_engine, prompts[:1], params)  # reads the shared blocks, and keeps them
    assert cached == [0] and first == plain[:1]
    again, cached = _run(cached_engine, prompts, params)  # a batch of three, each starting from them
    assert again == plain
    assert cached == [3 * BLOCK] * 3, "each found the shared prefix's 3 whole blocks"
    stats = cached_engine.prefix.stats()
    assert stats["hits"] == 9 * BLOCK and stats["queries"] == sum(len(p) for p in prompts[:1] + prompts)


def test_a_conversation_reads_only_what_is_new_each_turn(models):
    engine = _engine(models, "ngram", 1, 1 << 30)
    reference = _engine(models, "ngram", 1, 0)
    prompt, expected_cached = list(SHARED), 0
    for turn in range(4):
        (out,), (cached,) = _run(engine, [prompt], GREEDY)
        (want,), _ = _run(reference, [prompt], GREEDY)
        assert out == want and cached == expected_cached, turn
        expected_cached = (len(prompt) // BLOCK) * BLOCK  # the whole blocks of this turn's prompt
        prompt = prompt + out + [60 + turn, 61, 62]  # the next turn: this one, its answer, a new message


def test_blocks_are_found_only_by_the_same_tenant_and_salt(models):
    engine = _engine(models, "plain", 1, 1 << 30)
    prompt = SHARED + [1, 2]
    alice = dataclasses.replace(GREEDY, tenant=Tenant(key="alice-key"))
    _run(engine, [prompt], alice)
    hits = engine.prefix.stats()["hits"]
    for other in (
        dataclasses.replace(GREEDY, tenant=Tenant(key="bob-key")),
        dataclasses.replace(GREEDY, tenant=Tenant(key="alice-key", user="someone")),
        dataclasses.replace(alice, cache_salt="private"),
    ):
        _, (cached,) = _run(engine, [prompt], other)
        assert cached == 0 and engine.prefix.stats()["hits"] == hits, other
    _, (cached,) = _run(engine, [prompt], alice)
    assert cached == 3 * BLOCK


def test_a_deployment_that_shares_its_cache_keeps_only_salts_apart(models):
    engine = _engine(models, "plain", 1, 1 << 30)
    prompt = SHARED + [1, 2]
    shared = dataclasses.replace(GREEDY, cache_shared=True)
    _run(engine, [prompt], dataclasses.replace(shared, tenant=Tenant(key="alice-key")))
    _, (cached,) = _run(engine, [prompt], dataclasses.replace(shared, tenant=Tenant(key="bob-key", user="b")))
    assert cached == 3 * BLOCK
    _, (cached,) = _run(engine, [prompt], dataclasses.replace(shared, cache_salt="private"))
    assert cached == 0


def test_the_store_keeps_to_its_budget_evicting_the_least_recently_used(models):
    engine = _engine(models, "plain", 1, 1)
    _run(engine, [SHARED], GREEDY)
    assert engine.prefix.stats()["blocks"] == 0, "a budget smaller than a block keeps none"
    per_block = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in _a_block(engine))
    engine = _engine(models, "plain", 1, 5 * per_block)
    scheduler = Scheduler(engine, 1, prefill_chunk=BLOCK)
    for i in range(17):  # 17 distinct prompts of 3 whole blocks each, their answers read while idle: 10x the budget
        _turn(scheduler, [i + 1] * 25, GREEDY)
        assert engine.prefix.stats()["bytes"] <= 5 * per_block
        while scheduler.has_idle_work():
            scheduler.idle()
            assert engine.prefix.stats()["bytes"] <= 5 * per_block
    stats = engine.prefix.stats()
    assert stats["from_answers"] == 17 * 3  # each answer's 24 tokens end the 4th block and fill the 5th and 6th
    assert stats["blocks"] == 5 and stats["blocks"] + stats["evictions"] == 17 * 6
    _, (cached,) = _run(engine, [[17] * 25], GREEDY)  # the most recent prompt's blocks are still there
    assert cached == 3 * BLOCK
    _, (cached,) = _run(engine, [[1] * 25], GREEDY)  # the oldest's are gone
    assert cached == 0


def _a_block(engine):
    engine.target.prefill(0, SHARED[:BLOCK])
    try:
        return engine.target.read_block(0, 0, BLOCK)
    finally:
        engine.target.set_length(0, 0)


def test_a_prompt_read_in_other_chunks_never_starts_from_the_blocks(models):
    """Blocks hold what 8-token chunks wrote; a prompt read 4 tokens at a time would have written other bits (the
    products of a chunk round by its size), so it reads its whole prompt and keeps nothing."""
    engine = _engine(models, "plain", 1, 1 << 30)
    prompt = SHARED + [1, 2]
    _run(engine, [prompt], GREEDY)
    stored = engine.prefix.stats()["blocks"]
    (out,), (cached,) = _run(engine, [prompt], GREEDY, chunk=4)
    assert cached == 0 and engine.prefix.stats()["blocks"] == stored
    assert out == _run(_engine(models, "plain", 1, 0), [prompt], GREEDY, chunk=4)[0][0]


def _turn(scheduler, prompt, params) -> tuple[list[int], int]:
    """One request through a scheduler that lives across turns: its output tokens and prompt tokens found cached."""
    seq = scheduler.engine.new_sequence(prompt, params)
    scheduler.add(seq)
    got, cached = [], 0
    while scheduler.has_work():
        for s, o in scheduler.step():
            got += o.token_ids
            cached += o.cached_tokens
    return got, cached


@pytest.mark.parametrize("method", ["plain", "ngram", "draft"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_idle_time_reads_each_answer_so_the_next_turn_starts_after_it(fused_target, models, method, params):
    models = (fused_target, models[1])  # depctl's own forward: its passes stop within layers
    engine, reference = _engine(models, method, 2, 1 << 30), _engine(models, method, 1, 0)
    scheduler = Scheduler(engine, 2, prefill_chunk=BLOCK)
    prompt, expected_cached = list(SHARED), 0
    for turn in range(4):
        out, cached = _turn(scheduler, prompt, params)
        (want,), _ = _run(reference, [prompt], params)
        assert out == want and cached == expected_cached, turn
        slices = 0
        while scheduler.has_idle_work():  # slices of no time: each stops after one part of a layer
            scheduler.idle(seconds=0)
            slices += 1
        assert slices > 2 * len(models[0].model.layers)
        answered = prompt + out
        expected_cached = (len(answered) // BLOCK) * BLOCK  # the answer's whole blocks too, not only the prompt's
        prompt = answered + [60 + turn, 61, 62]
    assert engine.prefix.stats()["from_answers"] > 0


def test_a_request_arriving_while_an_answer_is_read_takes_the_row_back(fused_target, models):
    models = (fused_target, models[1])
    engine, reference = _engine(models, "ngram", 1, 1 << 30), _engine(models, "ngram", 1, 0)
    scheduler = Scheduler(engine, 1, prefill_chunk=BLOCK)
    first, _ = _turn(scheduler, SHARED, GREEDY)
    scheduler.idle(seconds=0)  # half-way through the first block that is not stored
    assert engine._reading is not None
    for prompt in (SHARED + first + [60, 61], [5, 6, 7]):  # the conversation's next turn, and another request
        out, _ = _turn(scheduler, prompt, GREEDY)
        (want,), _ = _run(reference, [prompt], GREEDY)
        assert out == want
    assert all(length == 0 for length in engine.target.cache.lengths)


@pytest.mark.parametrize("method", ["plain", "ngram", "suffix", "draft"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_prompt_resumes_mid_block_where_a_stored_prompt_ended(cut_anywhere, method, params):
    engine = _engine(cut_anywhere, method, 3, 1 << 30)
    assert engine.prefix_mid_block
    prompts = [SHARED + tail for tail in TAILS]
    plain, _ = _run(_engine(cut_anywhere, method, 3, 0), prompts, params)
    _, cached = _run(engine, [SHARED], params)  # 3 whole blocks and a tail of 5 tokens kept
    assert cached == [0]
    again, cached = _run(engine, prompts, params)
    assert again == plain and cached == [len(SHARED)] * 3, "each went on from the tail"
    # a prompt that leaves a stored block half-way starts from the block's first positions
    diverging = SHARED[:20] + [99, 98, 97, 96]
    (out,), (cached,) = _run(engine, [diverging], params)
    assert cached == 20 and out == _run(_engine(cut_anywhere, method, 1, 0), [diverging], params)[0][0]
    # the very prompt again: all of it but its last token, whose logits give the first output token
    (out,), (cached,) = _run(engine, [prompts[1]], params)
    assert out == plain[1] and cached == len(prompts[1]) - 1


@pytest.mark.parametrize("idle", [False, True], ids=["at-once", "after-idle"])
def test_each_turn_reads_only_its_new_message(cut_anywhere, idle):
    """An agent's next call comes at once (its prompt's own tail is there); a person's after a pause, in which the
    answer is read too."""
    engine, reference = _engine(cut_anywhere, "ngram", 2, 1 << 30), _engine(cut_anywhere, "ngram", 1, 0)
    scheduler = Scheduler(engine, 2, prefill_chunk=BLOCK)
    prompt, expected_cached = list(SHARED), 0
    for turn in range(4):
        out, cached = _turn(scheduler, prompt, GREEDY)
        (want,), _ = _run(reference, [prompt], GREEDY)
        assert out == want and cached == expected_cached, turn
        while idle and scheduler.has_idle_work():
            scheduler.idle(seconds=0)
        expected_cached = len(prompt) + (len(out) if idle else 0)
        prompt = prompt + out + [60 + turn, 61, 62]
