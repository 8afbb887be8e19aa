"""The speculative engine on tiny random models: exactness, acceptance, stops and cache rollback."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from depctl_runtime.backends.precision import QUANTIZED, quantize_int8, surgery_for
from depctl_runtime.model.runner import ModelRunner
from depctl_runtime.speculation import (
    DraftModelProposer,
    EngineConfig,
    GenerationParams,
    NgramProposer,
    SamplingParams,
    Scheduler,
    SpeculativeEngine,
    SuffixProposer,
    generate,
)
from depctl_runtime.speculation.engine import DraftSource
from tests.driving import PROMPTS
from tests.runtime.speculation.test_policy import turn_off

EOS = 258
# prompts with repeats (the n-gram proposer hits) and without (it misses)


def make(model, proposer=None, k=0, rows=1, **cfg):
    return SpeculativeEngine(
        ModelRunner(model, max_rows=rows), proposer, EngineConfig(num_draft_tokens=k, max_context=512, **cfg)
    )


def run(engine, prompt, max_tokens=40, **kw):
    tokens, finish = [], None
    for out in generate(engine, prompt, GenerationParams(max_tokens=max_tokens, **kw)):
        tokens += out.token_ids
        finish = out.finish_reason or finish
    return tokens, finish


def test_plain_engine_matches_transformers_generate(target):
    for prompt in PROMPTS[:3]:
        ours, _ = run(make(target), prompt, ignore_eos=True)
        hf = target.generate(
            torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
        assert ours == hf


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("method", ["ngram", "suffix", "draft", "int8 draft", "self"])
def test_greedy_output_equals_plain_decoding(target, draft, method, k):
    proposer = {
        "ngram": lambda: NgramProposer(2),
        "suffix": lambda: SuffixProposer(4096),  # one engine for every prompt: later prompts draft from earlier ones
        "draft": lambda: DraftModelProposer(ModelRunner(draft)),
        # the draft's numerics never reach the output: an int8 copy of the target drafts, the fp32 target decides
        "int8 draft": lambda: DraftModelProposer(ModelRunner(quantize_int8(copy.deepcopy(target)))),
        "self": lambda: DraftModelProposer(ModelRunner(target)),
    }[method]()
    engine = make(target, proposer, k, adaptive=False)  # adaptive off: always draft K, the hardest case
    for prompt in PROMPTS:
        plain, _ = run(make(target), prompt, ignore_eos=True)
        spec, _ = run(engine, prompt, ignore_eos=True)
        assert spec == plain, (method, k, prompt)
    assert engine.stats.num_draft_tokens > 0


@pytest.mark.usefixtures("native_ops")
@pytest.mark.parametrize("quantization", ["int4", "int8"])
@pytest.mark.parametrize("method", ["ngram", "float32 draft"])
def test_a_quantized_target_speculating_decodes_as_it_does_plainly_alone_and_batched(target, quantization, method):
    quantized = surgery_for(copy.deepcopy(target), QUANTIZED[quantization], exact=True)

    def speculative(rows=1):
        # the float32 model it was quantized from drafts: close, so most drafts pass and some do not
        proposer = NgramProposer(2) if method == "ngram" else DraftModelProposer(ModelRunner(target, max_rows=rows))
        return make(quantized, proposer, 4, rows, adaptive=False)

    plain = [run(make(quantized), prompt, ignore_eos=True)[0] for prompt in PROMPTS]
    engine = speculative()
    assert [run(engine, prompt, ignore_eos=True)[0] for prompt in PROMPTS] == plain
    assert 0 < engine.stats.num_accepted_tokens
    batched = Scheduler(speculative(rows=3), max_batch_size=3).run_all(
        PROMPTS, GenerationParams(max_tokens=40, ignore_eos=True)
    )
    assert batched == plain


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_self_draft_accepts_everything(target, k):
    engine = make(target, DraftModelProposer(ModelRunner(target)), k, adaptive=False)
    # the first token comes from the prefill; then 5 steps of k + 1 tokens, none clamped by max_tokens
    run(engine, PROMPTS[0], max_tokens=1 + (k + 1) * 5, ignore_eos=True)
    assert engine.stats.acceptance_rate == 1.0
    assert engine.stats.mean_acceptance_length == k + 1
    assert engine.stats.accepted_per_position == engine.stats.drafted_per_position == [5] * k
    assert engine.stats.to_dict()["acceptance_per_position"] == [1.0] * k


def test_ngram_hits_on_repetitive_prompt(target):
    plain, _ = run(make(target), PROMPTS[2], ignore_eos=True)
    engine = make(target, NgramProposer(3), 4, adaptive=False)
    tokens, _ = run(engine, PROMPTS[2], ignore_eos=True)
    stats = engine.stats
    assert tokens == plain  # what it accepted is what plain decoding wrote
    # it drafted every step, some of it was right, and the counters agree with each other and with the output
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.num_draft_tokens == sum(stats.drafted_per_position) and len(stats.drafted_per_position) == 4
    assert stats.num_accepted_tokens == sum(stats.accepted_per_position)
    assert stats.num_generated_tokens == len(tokens) == 40
    # each step wrote its accepted drafts and one token of the target's: fewer passes than tokens
    assert stats.num_steps == len(tokens) - 1 - stats.num_accepted_tokens


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft"])
def test_seeded_sampling_is_reproducible(target, draft, method):
    def once(seed):
        proposer = {
            "ngram": lambda: NgramProposer(2),
            "suffix": lambda: SuffixProposer(4096),
            "draft": lambda: DraftModelProposer(ModelRunner(draft)),
        }[method]()
        return run(
            make(target, proposer, 4),
            PROMPTS[0],
            sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=seed),
            ignore_eos=True,
        )[0]

    assert once(7) == once(7)
    assert once(7) != once(8)


def test_temperature_zero_is_plain_decoding_every_time(target, draft):
    # greedy output is a function of the prompt alone: the same from plain decoding, from a fresh engine of every
    # method, and from an engine that has run before (its proposer's and policy's state carried over)
    plain, _ = run(make(target), PROMPTS[1])
    for proposer in (NgramProposer(2), SuffixProposer(4096), DraftModelProposer(ModelRunner(draft))):
        engine = make(target, proposer, 4)
        assert run(engine, PROMPTS[1])[0] == plain, type(proposer).__name__
        assert run(engine, PROMPTS[4])[0] == run(make(target), PROMPTS[4])[0]
        assert run(engine, PROMPTS[1])[0] == plain, type(proposer).__name__


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 9, 17])
def test_max_tokens_is_exact_even_mid_draft(target, max_tokens):
    engine = make(target, DraftModelProposer(ModelRunner(target)), 8, adaptive=False)
    tokens, finish = run(engine, PROMPTS[0], max_tokens=max_tokens, ignore_eos=True)
    assert len(tokens) == max_tokens and finish == "length"


def test_eos_stops_and_is_not_emitted(target):
    plain, _ = run(make(target), PROMPTS[0], max_tokens=40, ignore_eos=True)
    stop_at = plain[6]  # make the 7th token a stop token: output ends right before it
    engine = make(target, DraftModelProposer(ModelRunner(target)), 4, adaptive=False)
    tokens, finish = run(engine, PROMPTS[0], max_tokens=40, stop_token_ids=(stop_at,))
    assert tokens == plain[: plain.index(stop_at)] and finish == "stop"


def test_context_limit_caps_output(target):
    engine = SpeculativeEngine(ModelRunner(target), NgramProposer(2), EngineConfig(num_draft_tokens=4, max_context=16))
    tokens, finish = run(engine, PROMPTS[1], max_tokens=100, ignore_eos=True)
    assert len(PROMPTS[1]) + len(tokens) == 16 and finish == "length"
    with pytest.raises(ValueError, match="context holds 16"):
        run(engine, list(range(16)))


class _FixedProposer:
    """A free proposer with a fixed continuation, so a test chooses between the all-accepted and first-rejected
    paths."""

    name = "fixed"

    def __init__(self, drafts):
        self.drafts = drafts

    def propose(self, seq, k):
        return self.drafts[:k]

    def finish(self, seq):
        pass


def test_a_batch_whose_band_drafts_no_free_guesses_looks_for_none(target):
    # a lookup for every row, refused after: 2-4% of a 4-bit step at 8 rows, in bands where drafting measured a loss
    params = GenerationParams(max_tokens=12, ignore_eos=True)
    plain = Scheduler(make(target, rows=3), 3).run_all(PROMPTS[:3], params)
    for off in (False, True):
        looked, sizes = [], []
        proposer = _FixedProposer([1, 2, 3])
        proposer.propose = lambda seq, k: looked.append(sizes[-1]) or [1, 2, 3][:k]
        engine = make(target, proposer, 4, rows=3)
        step = engine.step
        engine.step = lambda batch: sizes.append(len(batch)) or step(batch)
        if off:
            turn_off(engine.policy.guard, 2)  # the band of 2 and 3 rows
        assert Scheduler(engine, 3).run_all(PROMPTS[:3], params) == plain
        assert any(size > 1 for size in sizes)
        assert all(size == 1 for size in looked) == off


@pytest.mark.parametrize("path", ["all_accepted", "first_rejected"])
def test_rollback_leaves_the_cache_row_at_the_accepted_length(target, path):
    prompt = PROMPTS[0]
    plain, _ = run(make(target), prompt, max_tokens=8, ignore_eos=True)
    # the prefill gives plain[0]; the first step then verifies drafts for plain[1:5]
    drafts = plain[1:5] if path == "all_accepted" else [(plain[1] + 1) % 256] + plain[2:5]
    engine = make(target, _FixedProposer(drafts), 4, adaptive=False)
    steps = generate(engine, prompt, GenerationParams(max_tokens=8, ignore_eos=True))
    assert next(steps).token_ids == plain[:1]
    step = next(steps)
    expected = plain[1:6] if path == "all_accepted" else plain[1:2]  # 4 accepted + bonus, or just the recovery
    assert step.token_ids == expected
    # the row holds the prompt and the accepted tokens, minus the last one (the next step's input); the rejected
    # drafts' positions are past it, to be overwritten
    assert engine.target.length(0) == len(prompt) + 1 + len(expected) - 1
    steps.close()


def test_draft_model_cache_catches_up_after_full_accept(target):
    runner = ModelRunner(target)
    engine = make(target, DraftModelProposer(runner), 3, adaptive=False)
    prompt = PROMPTS[1]
    gen = generate(engine, prompt, GenerationParams(max_tokens=20, ignore_eos=True))
    assert len(next(gen).token_ids) == 1  # the prefill's token
    first = next(gen)
    assert len(first.token_ids) == 4  # self-draft: all 3 accepted + bonus
    # the draft never fed d_k: its row is two tokens behind the sequence (d_k and the bonus)
    assert runner.length(0) == len(prompt) + 1 + 4 - 2
    second = next(gen)
    assert len(second.token_ids) == 4  # catch-up fed both, and drafting continued exactly
    gen.close()


def test_a_draft_model_catching_up_after_plain_steps_is_not_priced_as_its_drafting(target, draft):
    """After plain steps the draft model feeds every token it missed before it drafts (a prefill of them). Priced
    as that step's per-token draft cost, the catch-up once made a 0.5B draft look 10x dearer than it is, and the
    policy stopped drafting where drafting paid; only steps whose catch-up is the usual one or two tokens count."""
    engine = make(target, DraftModelProposer(ModelRunner(draft)), 3)
    widths = iter([0] * 6 + [3] * 6)
    engine.policy.width = lambda rows, **_: (next(widths), {"model": 1.0})
    seen = []
    engine.policy.draft_cost.observe = lambda n, seconds: seen.append(step)
    gen = generate(engine, PROMPTS[1], GenerationParams(max_tokens=40, ignore_eos=True))
    next(gen)  # the prefill
    for step in range(12):
        next(gen)
    gen.close()
    assert 6 not in seen  # the first drafting step fed seven tokens first
    assert seen and set(seen) <= set(range(7, 12))


def test_a_draft_models_row_that_does_not_draft_returns_towards_the_rate_it_started_from(target, draft):
    """A draft model's row has no free guess to check while it does not draft: its rate ages towards where the
    request started, or the misses before would hold it under what drafting needs for the rest of the request."""
    engine = make(target, DraftModelProposer(ModelRunner(draft)), 3)
    widths, rates = iter([3] * 4 + [0] * 8), []

    def width(rows, **_):
        rates.append(rows[0].acceptance.rate)
        return next(widths), {"model": 1.0}

    engine.policy.width = width
    gen = generate(engine, PROMPTS[1], GenerationParams(max_tokens=40, ignore_eos=True))
    next(gen)  # the prefill
    for _ in range(12):
        next(gen)
    gen.close()
    assert rates[4] < rates[0]  # an unrelated draft: its drafts missed
    assert all(a < b for a, b in zip(rates[4:], rates[5:]))
    assert rates[-1] <= rates[0]


def test_a_drafts_first_position_and_the_forwards_after_it_are_priced_apart(target, draft):
    """A step's first drafted position costs the draft's catch-up and the drafting around it; each later one costs a
    forward. Each is measured as what it is: a forward made slow here is priced slow, and the start is not."""
    import time

    runner = ModelRunner(draft)
    forward = runner.forward

    def slow_step(row, tokens, *args, **kwargs):
        if not kwargs.get("last_only"):  # a drafting step's forward (catch-up asks only for the last logits)
            time.sleep(0.05)
        return forward(row, tokens, *args, **kwargs)

    runner.forward = slow_step
    engine = make(target, DraftModelProposer(runner), 3)
    engine.policy.width = lambda rows, **_: (3, {"model": 1.0})
    starts, forwards = [], []
    engine.policy.draft_start_cost.observe = lambda n, seconds: starts.append(seconds)
    engine.policy.draft_cost.observe = lambda n, seconds: forwards.append(seconds)
    run(engine, PROMPTS[1], max_tokens=20, ignore_eos=True)
    assert forwards and min(forwards) >= 0.05
    assert starts and max(starts) < 0.05


def test_a_draft_model_reads_a_prompt_only_when_its_row_first_drafts(target, draft):
    """Where the policy does not draft (a batch too large for drafts to pay), the draft model costs nothing: it reads
    a row's prompt when the row first drafts, in prompt-sized chunks, and the output stays the target's."""
    plain, _ = run(make(target), PROMPTS[4], ignore_eos=True)
    runner = ModelRunner(draft)
    proposer = DraftModelProposer(runner)
    proposer.catch_up_chunk = 8
    engine = make(target, proposer, 3)
    widths = itertools.chain([0] * 5, itertools.repeat(3))
    engine.policy.width = lambda rows, **_: (next(widths), {"model": 1.0})
    passes = []
    forward = runner.forward
    runner.forward = lambda first, inputs, **kw: passes.append([len(x) for x in inputs]) or forward(first, inputs, **kw)
    gen = generate(engine, PROMPTS[4], GenerationParams(max_tokens=40, ignore_eos=True))
    tokens = [t for _ in range(6) for t in next(gen).token_ids]  # the prefill's token and five plain steps
    assert runner.length(0) == 0 and not passes
    tokens += [t for out in gen for t in out.token_ids]
    assert tokens == plain
    assert engine.stats.num_draft_tokens > 0
    assert max(w for p in passes for w in p) <= 8  # 51 tokens to catch up, read 8 at a time


def _spy_verify(engine) -> list[list[int]]:
    """Each step's tokens a row verified (1 + its drafts), recorded as the target scores them."""
    widths = []
    score = engine.target.score
    engine.target.score = lambda first, rows, **kw: widths.append([len(r) for r in rows]) or score(first, rows, **kw)
    return widths


def test_in_a_batch_each_row_verifies_only_as_many_guesses_as_the_policy_gave_it(target):
    """Free guesses in a batch: the policy gives each row its own count of drafts (``row_drafts``) and the pass
    verifies that many of a row's guesses, not the step's width, with the output still plain decoding's."""
    p = GenerationParams(max_tokens=40, ignore_eos=True)
    plain = Scheduler(make(target, rows=3), 3).run_all(PROMPTS, p)
    engine = make(target, NgramProposer(2), 4, rows=3, adaptive=False)
    width = engine.policy.width

    def first_row_only(plans, **kw):
        w, predicted = width(plans, **kw)
        engine.policy.row_drafts = [4] + [0] * (len(plans) - 1) if w else None
        return w, predicted

    engine.policy.width = first_row_only
    verified = _spy_verify(engine)
    assert Scheduler(engine, 3).run_all(PROMPTS, p) == plain
    batched = [step for step in verified if len(step) == 3]
    assert batched and all(n == 1 for step in batched for n in step[1:])  # the other rows verified no draft
    assert any(step[0] > 1 for step in batched)  # while the first row's guesses went into the pass


@pytest.mark.parametrize("rows", [1, 3])
def test_drafts_the_draft_model_is_unsure_of_are_not_verified_and_the_output_stays_the_targets(target, rows):
    near = _near(target)
    params = [
        GenerationParams(max_tokens=40, ignore_eos=True),
        GenerationParams(max_tokens=40, ignore_eos=True, sampling=SamplingParams(temperature=0.8, seed=11)),
    ]
    for p in params:
        plain = Scheduler(make(target, rows=rows), rows).run_all(PROMPTS, p)
        engine = make(target, DraftModelProposer(ModelRunner(near, max_rows=rows)), 4, rows, cut_unsure_drafts=True)
        engine.policy.width = lambda plans, **_: (4, {"model": 1.0})  # every step asks for four
        engine.policy.draft_threshold = lambda batch: 0.3
        verified = _spy_verify(engine)
        assert Scheduler(engine, rows).run_all(PROMPTS, p) == plain
        kept = [n - 1 for step in verified[1:] for n in step]  # (the first pass is a prompt's)
        assert 0 in kept and 4 in kept and any(0 < n < 4 for n in kept), kept


def test_a_step_whose_draft_model_kept_no_draft_is_judged_as_drafting_not_as_a_plain_step(target):
    """The draft model ran (its passes are the step's time) though no row verified a draft: the guard must see that
    cost as drafting's, or plain steps would look slower than they are and drafting better."""
    plain, _ = run(make(target), PROMPTS[1], ignore_eos=True)
    engine = make(target, DraftModelProposer(ModelRunner(_near(target))), 3, cut_unsure_drafts=True)
    engine.policy.width = lambda plans, **_: (3, {"model": 1.0})
    engine.policy.draft_threshold = lambda batch: 0.99  # (a tiny random draft is never this sure)
    kinds = []
    observe = engine.policy.observe_step_time
    engine.policy.observe_step_time = lambda seconds, batch, tokens, kind: (
        kinds.append(kind) or observe(seconds, batch, tokens, kind)
    )
    assert run(engine, PROMPTS[1], ignore_eos=True)[0] == plain
    assert engine.stats.num_drafts <= 2 < len(kinds)  # (a draft the tiny model is that sure of is rare)
    assert kinds[-1] is None  # the last step has room for one token: a plain step
    assert kinds[:-1] and set(kinds[:-1]) == {"model"}


def test_where_no_draft_could_pay_for_its_verify_the_draft_model_does_not_run(target):
    """At a threshold of 1 no draft is worth verifying, whatever the draft's probabilities: running the draft model
    anyway would cost its forwards and verify nothing."""
    plain, _ = run(make(target), PROMPTS[1], ignore_eos=True)
    proposer = DraftModelProposer(ModelRunner(_near(target)))
    engine = make(target, proposer, 3, cut_unsure_drafts=True)
    engine.policy.width = lambda plans, **_: (3, {"model": 1.0})
    engine.policy.draft_threshold = lambda batch: 1.0
    proposed = []
    propose = proposer.propose
    proposer.propose = lambda *a, **kw: proposed.append(1) or propose(*a, **kw)
    kinds = []
    observe = engine.policy.observe_step_time
    engine.policy.observe_step_time = lambda seconds, batch, tokens, kind: (
        kinds.append(kind) or observe(seconds, batch, tokens, kind)
    )
    assert run(engine, PROMPTS[1], ignore_eos=True)[0] == plain
    assert not proposed and engine.stats.num_draft_tokens == 0
    assert kinds and set(kinds) == {None}  # plain steps, as the guard sees them


def test_update_draft_count_in_place(target):
    engine = make(target, NgramProposer(2), 4)
    engine.set_num_draft_tokens(1)
    engine.policy.adaptive = False
    tokens, _ = run(engine, PROMPTS[2], ignore_eos=True)
    assert tokens == run(make(target), PROMPTS[2], ignore_eos=True)[0]
    # it drafted, one token a step: the new count, not the deployment's first 4
    assert len(engine.stats.drafted_per_position) == 1 and engine.stats.num_draft_tokens > 5


def test_prediction_drafts_and_stays_exact(target):
    plain, _ = run(make(target), PROMPTS[1], max_tokens=30, ignore_eos=True)
    engine = make(target)
    outs = list(generate(engine, PROMPTS[1], GenerationParams(max_tokens=30, ignore_eos=True, prediction=tuple(plain))))
    assert [t for o in outs for t in o.token_ids] == plain
    assert sum(o.prediction_accepted for o in outs) >= 25  # a right prediction is accepted nearly whole
    wrong = tuple((t + 1) % 256 for t in plain)
    outs = list(generate(engine, PROMPTS[1], GenerationParams(max_tokens=30, ignore_eos=True, prediction=wrong)))
    assert [t for o in outs for t in o.token_ids] == plain


def test_off_the_prediction_the_deployments_proposer_drafts_before_a_rejoin_guess(target):
    # where the output has left its prediction, n-gram lookup (a 2-token match against the text just written) drafts
    # before the tracker's guess at where the output rejoins (one agreeing token); with no n-gram match, the guess
    engine = make(target, NgramProposer(2), 4, adaptive=False)
    prompt, prediction = [1, 2, 3, 4, 5, 6, 10, 11, 12, 13], (20, 21, 22, 5, 30, 31, 32, 33)
    seq = engine.new_sequence(prompt, GenerationParams(max_tokens=30, prediction=prediction))
    seq.prediction.expected, seq.prediction.left_at = -1, 3  # it left the prediction at index 3
    seq.tokens += [4, 5]  # "4 5" is in the prompt; "5" is the prediction's index 3
    guess = engine._guess(seq)
    assert (guess.source, guess.tokens) == (DraftSource.FREE, [6, 10, 11, 12])
    assert guess.prediction_start == -1  # the unused rejoin guess is not judged
    assert seq.prediction.observe(guess.prediction_start, 0, 6) == 0 and seq.prediction.expected == -1
    seq.tokens[-2:] = [99, 5]  # no n-gram match: the output rejoins the prediction after its "5"
    guess = engine._guess(seq)
    assert (guess.source, guess.tokens, guess.prediction_start) == (DraftSource.PREDICTION, [30, 31, 32, 33], 4)


def test_suffix_drafts_a_repeated_request_from_the_first(target):
    engine = make(target, SuffixProposer(4096), 8, adaptive=False)
    first, _ = run(engine, PROMPTS[1], max_tokens=41, ignore_eos=True)
    before = engine.stats.num_accepted_tokens
    again, _ = run(engine, PROMPTS[1], max_tokens=41, ignore_eos=True)
    assert again == first
    # the answer is in the index: 40 tokens after the prefill's, in 5 fully accepted steps of 8 + 1... minus the
    # steps where the match is still shorter than 8 tokens (the draft length follows the match length)
    assert engine.stats.num_accepted_tokens - before >= 30
    assert engine.proposer.index.requests == 2


def test_a_request_can_turn_speculation_off_or_cap_its_drafts(target):
    plain, _ = run(make(target), PROMPTS[2], ignore_eos=True)
    engine = make(target, NgramProposer(2), 8, adaptive=False)
    off, _ = run(engine, PROMPTS[2], ignore_eos=True, speculate=False, prediction=tuple(plain))
    assert off == plain and engine.stats.num_draft_tokens == 0  # off means no drafts at all, a prediction included
    capped, _ = run(engine, PROMPTS[2], ignore_eos=True, max_draft_tokens=2)
    assert capped == plain and engine.stats.num_draft_tokens > 0
    assert len(engine.stats.accepted_per_position) <= 2
    uncapped, _ = run(engine, PROMPTS[2], ignore_eos=True)
    assert uncapped == plain and len(engine.stats.accepted_per_position) > 2  # the cap was what held it


def test_a_bad_calibration_does_not_switch_speculation_off_for_good(target):
    # calibration taken on a busy machine: long verifies look 100x dearer than they are
    engine = make(target, NgramProposer(2), 4)
    engine.calibrate()
    samples = engine.policy.verify_cost.samples
    for n in samples:
        if n > 1:
            samples[n] = 1000.0  # seconds: no draft could ever pay at that price
    run(engine, PROMPTS[2], max_tokens=120, ignore_eos=True)  # a repetitive prompt: the n-gram guesses hit
    assert engine.stats.num_draft_tokens > 0  # probes drafted...
    # ...and replaced a bad measurement with a real one (which widths depends on what the proposer found and on
    # timings, so only "some" is certain)
    assert min(v for n, v in samples.items() if n > 1) < 1000.0


def test_calibration_measures_every_pass_width_a_request_can_verify(target):
    """int8 weights are multiplied four rows at a time: SmolLM2's passes over 1-4 tokens cost ~8 ms, 5-8 ~12-15, 9
    ~20. Interpolating between powers of two hid those steps (5 tokens looked like 9.8 ms, 9 like 16), so the policy
    started out drafting widths dearer than it thought; every width up to K + 1 is measured instead."""
    for rows in (1, 4):  # in a deployment that batches too: widths were once folded into the batch's rows
        engine = SpeculativeEngine(
            ModelRunner(target, max_rows=rows), NgramProposer(2), EngineConfig(num_draft_tokens=8, max_context=512)
        )
        engine.calibrate()
        assert set(range(1, 10)) <= set(engine.policy.verify_cost.samples), rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_on_a_cpu_attends_verify_passes_per_position_and_stays_exact(target, dtype):
    # what --dtype bfloat16 (auto on CPUs with bf16 instructions) runs: the loader's split-K surgery, and the runner
    # attends a verify pass position by position; speculation gives exactly the plain tokens of the same model
    from depctl_runtime.backends.precision import surgery_for

    model = surgery_for(copy.deepcopy(target).to(dtype), str(dtype).removeprefix("torch."), exact=True)
    plain_engine = make(model)
    assert plain_engine.target.per_position
    for prompt in PROMPTS:
        plain, _ = run(plain_engine, prompt)
        spec = make(model, NgramProposer(2), k=4, adaptive=False)
        assert run(spec, prompt)[0] == plain
    assert spec.stats.num_draft_tokens > 0


def test_a_greedy_step_asks_for_no_rows_logits_unless_logprobs_are_wanted(target, monkeypatch):
    # a float32 target's screened head picks greedy tokens without the full output layer: asking a row for its
    # logits (as logprobs need) pays for that layer, so only requests that want logprobs may ask
    from depctl_runtime.model import runner

    asked = []
    logits = runner.Scores.logits
    monkeypatch.setattr(
        runner.Scores, "logits", lambda self, rows=slice(None): asked.append(rows) or logits(self, rows)
    )
    run(make(target, NgramProposer(2), k=4), PROMPTS[0], ignore_eos=True)
    assert all(rows == slice(None) for rows in asked)  # argmax() of an unscreened pass reads them all, no row alone
    run(make(target, NgramProposer(2), k=4), PROMPTS[0], ignore_eos=True, logprobs=0)
    assert any(rows != slice(None) for rows in asked)


def test_another_tenants_traffic_reaches_a_request_only_through_the_policys_aggregates(target):
    """What a tenant's counters depend on besides its own request: the draft-length policy's deployment-wide numbers
    (its acceptance prior, measured costs, the batch it shares), never another tenant's text. With the policy held
    fixed, a request drafts and counts exactly the same whether or not another tenant sent the same text before."""
    from depctl_runtime.speculation import Tenant

    def counted(engine, tenant):
        params = GenerationParams(max_tokens=41, ignore_eos=True, tenant=tenant)
        outs = list(generate(engine, PROMPTS[1], params))
        return [t for o in outs for t in o.token_ids], sum(o.drafted for o in outs), sum(o.accepted for o in outs)

    alice, bob = Tenant("k", "alice"), Tenant("k", "bob")
    fresh = make(target, SuffixProposer(4096, scope="user"), 8, adaptive=False)
    shared = make(target, SuffixProposer(4096, scope="user"), 8, adaptive=False)
    counted(shared, alice)  # alice sends the very text bob is about to
    assert counted(shared, bob) == counted(fresh, bob)
    again = counted(shared, alice)  # (while alice's own repeat drafts from her first request: the index holds it)
    assert again[2] > counted(fresh, alice)[2]


# ---- draft trees ----


def _near(target, noise: float = 0.6, seed: int = 3):
    """A draft that agrees with the target often, not always: its output layer perturbed."""
    model = copy.deepcopy(target)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        model.lm_head.weight.add_(torch.randn(model.lm_head.weight.shape, generator=gen) * noise)
    return model


@pytest.mark.parametrize("branches,k", [(2, 1), (2, 3), (3, 4)])
def test_a_draft_tree_decodes_as_plain_decoding_alone_and_batched_in_fewer_steps_than_a_chain(target, branches, k):
    near = _near(target)

    def speculative(tree_branches: int, rows: int = 1):
        proposer = DraftModelProposer(ModelRunner(near, max_rows=rows))
        return make(target, proposer, k, rows, adaptive=False, tree_branches=tree_branches)

    plain = [run(make(target), prompt, ignore_eos=True)[0] for prompt in PROMPTS]
    tree, chain = speculative(branches), speculative(1)
    assert [run(tree, prompt, ignore_eos=True)[0] for prompt in PROMPTS] == plain
    assert [run(chain, prompt, ignore_eos=True)[0] for prompt in PROMPTS] == plain
    # the same tokens in fewer target passes: the other branches caught first positions the chain's draft missed
    assert tree.stats.num_steps < chain.stats.num_steps
    caught = tree.policy.snapshot()["first_choice_misses_caught"]
    assert caught[branches - 2] > 0.05, caught
    batched = Scheduler(speculative(branches, rows=3), max_batch_size=3).run_all(
        PROMPTS, GenerationParams(max_tokens=40, ignore_eos=True)
    )
    assert batched == plain


def test_a_draft_tree_keeps_seeded_sampling_identical_and_sampling_within_the_vocabulary(target):
    near = _near(target)

    def sampled(tree_branches: int, seed: int | None):
        engine = make(target, DraftModelProposer(ModelRunner(near)), 3, adaptive=False, tree_branches=tree_branches)
        sampling = SamplingParams(temperature=0.8, seed=seed)
        return run(engine, PROMPTS[0], sampling=sampling, ignore_eos=True)[0]

    plain = run(make(target), PROMPTS[0], sampling=SamplingParams(temperature=0.8, seed=11), ignore_eos=True)[0]
    assert sampled(3, 11) == plain
    tokens = sampled(3, None)
    assert len(tokens) == 40 and all(0 <= t < target.config.vocab_size for t in tokens)


def test_calibration_prices_passes_over_trees_where_the_draft_can_grow_them(target):
    engine = make(target, DraftModelProposer(ModelRunner(_near(target), max_rows=2)), 3, rows=2)
    costs = engine.calibrate(context=16, repeats=0)
    # a row's tree of 2 or 4 branches, 1 or 3 deep, alone and in both rows: 3, 7, 5 and 13 tokens a row
    assert sorted(map(int, costs["tree_ms"])) == [3, 5, 6, 7, 10, 13, 14, 26]
    chains = make(target, DraftModelProposer(ModelRunner(_near(target), max_rows=2)), 3, rows=2, tree_branches=1)
    assert chains.calibrate(context=16, repeats=0)["tree_ms"] == {}


class _RoundsOtherwise:
    """A fast pass (as a compiled library is) that rounds otherwise than the eager pass: its logits are the eager
    ones nudged by a different amount at each position, enough to reorder near ties."""

    returns_hidden = False

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def fits(self, first, widths, keep) -> bool:
        return keep is None

    def __call__(self, input_ids, layout, cache, keep):
        logits = self.runner._forward(input_ids[None], cache.step.positions[None], layout, None).logits()
        nudge = torch.sin(torch.arange(logits.shape[-1], dtype=logits.dtype) * 0.37) * 0.5
        return logits + nudge * (1 + cache.step.positions[:, None].to(logits.dtype) % 3), None

    def set_widths(self, widths) -> None:
        pass


def test_a_target_with_a_fast_pass_drafts_chains_only_and_stays_exact(target):
    # seen with a compiled 4-bit Qwen target: a tree's pass ran eagerly beside compiled plain steps, rounded
    # otherwise, and the output drifted from plain decoding's
    def runner() -> ModelRunner:
        made = ModelRunner(target)
        made.fast_pass = _RoundsOtherwise(made)
        return made

    config = EngineConfig(num_draft_tokens=3, max_context=512, adaptive=False, tree_branches=2)
    plain = [
        t
        for o in generate(SpeculativeEngine(runner()), PROMPTS[0], GenerationParams(max_tokens=40))
        for t in o.token_ids
    ]
    engine = SpeculativeEngine(runner(), DraftModelProposer(ModelRunner(_near(target))), config)
    assert not engine.drafts_trees
    assert [t for o in generate(engine, PROMPTS[0], GenerationParams(max_tokens=40)) for t in o.token_ids] == plain
    eager = SpeculativeEngine(ModelRunner(target), DraftModelProposer(ModelRunner(_near(target))), config)
    assert eager.drafts_trees


def test_calibration_with_a_long_draft_prices_only_the_trees_a_row_can_hold(target):
    engine = make(target, DraftModelProposer(ModelRunner(_near(target))), 16)
    costs = engine.calibrate(context=64, repeats=0)  # 4 x 16 drafts would not fit: 2 x 16, and 1 deep
    assert sorted(map(int, costs["tree_ms"])) == [3, 5, 33]
