"""Driving the engine in tests: prompts, engines of each method over a tiny model, a scheduler run to its end with
arrivals and cancels, and the reference checks several test modules share."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.nn import functional as F

from depctl_runtime.model.runner import ModelRunner
from depctl_runtime.speculation import (
    DraftModelProposer,
    EngineConfig,
    GenerationParams,
    NgramProposer,
    Scheduler,
    SpeculativeEngine,
    SuffixProposer,
    generate,
)

if TYPE_CHECKING:
    from depctl_runtime.model.eagle import EagleHead

PROMPTS = [
    [5, 17, 42, 99, 3, 17, 42, 99, 3, 8],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
    [200, 201, 200, 201, 200, 201, 200],
    [77],
    list(range(30, 60)) + list(range(30, 45)),
]
# and three more for batches: a run of one token, a long count, a short cycle (8 in all)
BATCH_PROMPTS = PROMPTS + [[9, 9, 9, 9, 9, 9], list(range(100, 140)), [64, 65, 66, 64, 65, 66, 64]]
GREEDY = GenerationParams(max_tokens=30, ignore_eos=True)


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


def assert_speculation_is_exact(runner: ModelRunner) -> None:
    """n-gram speculation through ``runner`` (3 rows) gives what plain decoding through it gives, one request at a
    time and batched, with drafts verified and accepted."""
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 8, 5, 6, 7], [40, 41, 42, 43, 44]]
    params = GenerationParams(max_tokens=24)

    def engine(proposer=None, k=0):
        for row in range(runner.max_rows):
            runner.set_length(row, 0)
        return SpeculativeEngine(runner, proposer, EngineConfig(num_draft_tokens=k, adaptive=False))

    plain = [[t for o in generate(engine(), p, params) for t in o.token_ids] for p in prompts]
    spec = engine(NgramProposer(2), 4)
    assert [[t for o in generate(spec, p, params) for t in o.token_ids] for p in prompts] == plain
    assert spec.stats.num_draft_tokens > 0 and spec.stats.num_accepted_tokens > 0
    assert Scheduler(engine(NgramProposer(2), 4), max_batch_size=3).run_all(prompts, params) == plain


def engine_for(target, method, rows, draft=None, k=4, adaptive=False, **config):
    """An engine of ``method`` over ``rows`` rows; ``config``: more EngineConfig fields (a prefix cache, say)."""
    proposer = {
        "plain": lambda: None,
        "ngram": lambda: NgramProposer(2),
        "suffix": lambda: SuffixProposer(4096),
        "draft": lambda: DraftModelProposer(ModelRunner(draft, max_rows=rows, max_context=512)),
    }[method]()
    return SpeculativeEngine(
        ModelRunner(target, max_rows=rows, max_context=512),
        proposer,
        EngineConfig(num_draft_tokens=k if proposer else 0, max_context=512, adaptive=adaptive, **config),
    )


def solo(target, prompt, params):
    engine = engine_for(target, "plain", 1)
    return [t for o in generate(engine, prompt, params) for t in o.token_ids]


def drive(scheduler, arrivals, cancel_at=None, on_iteration=None):
    """Run to the end. ``arrivals``: (iteration, prompt, params); ``cancel_at``: {index: iteration};
    ``on_iteration(it)`` runs before each iteration's step."""
    engine = scheduler.engine
    seqs, got, finish, it = {}, {}, {}, 0
    pending = sorted(enumerate(arrivals), key=lambda x: x[1][0])
    while pending or scheduler.has_work():
        while pending and pending[0][1][0] <= it:
            i, (_, prompt, params) = pending.pop(0)
            seqs[i] = engine.new_sequence(prompt, params)
            got[i] = []
            scheduler.add(seqs[i])
        for i, when in (cancel_at or {}).items():
            if when == it and i in seqs:
                scheduler.cancel(seqs[i])
        if on_iteration is not None:
            on_iteration(it)
        by_id = {s.id: i for i, s in seqs.items()}
        for seq, out in scheduler.step():
            got[by_id[seq.id]] += out.token_ids
            if out.finish_reason:
                finish[by_id[seq.id]] = out.finish_reason
        it += 1
    return got, finish
