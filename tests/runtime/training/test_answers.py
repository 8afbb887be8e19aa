"""A learning head's data while traffic is short: the target's answers to the shipped prompts, then to requests it
writes itself, generated in idle time through a runner of their own, so requests in between are served exactly as
without them."""

from __future__ import annotations

import time

import pytest
import torch

from depctl.spec import DeploymentSpec
from depctl_runtime.backends import learning
from depctl_runtime.backends.loader import load_deployment
from depctl_runtime.model.compiled import CompiledPass
from depctl_runtime.model.eagle import layer_outputs
from depctl_runtime.model.runner import ModelRunner
from depctl_runtime.speculation import GenerationParams, Scheduler
from depctl_runtime.speculation.eagle import EagleProposer
from depctl_runtime.training import traffic
from depctl_runtime.training.answers import MAX_CHUNK, MAX_WRITTEN, MIN_CHUNK, IdleAnswers
from depctl_runtime.training.eagle import TokenCounts
from depctl_runtime.training.online import VOCABULARY_GROWTH
from depctl_runtime.training.traffic import read_answer
from tests.driving import drive
from tests.runtime.training.test_online import idle, prompts, quick, spec

TOKENS = 24


def answers_for(loaded, batch, **kw) -> IdleAnswers:
    model, learner = loaded.target.model, loaded.learner

    def make_runner(rows: int, context: int) -> ModelRunner:
        return ModelRunner(model, loaded.engine.target.vocab_size, rows, context, features=learner.config.aux_layers)

    kw = {"stop_ids": set(), "dtype": torch.float32, "max_tokens": TOKENS, **kw}
    return IdleAnswers(make_runner, batch, **kw)


def greedy(model_dir, batch) -> dict[tuple, list[int]]:
    """Each prompt's greedy answer from a plain deployment of the same weights (a learning one records what it
    serves)."""
    plain = load_deployment(
        DeploymentSpec(
            id="plain", model=str(model_dir), device="cpu", dtype="float32", compile=False, max_batch_size=2
        ),
        calibrate=False,
    )
    params = GenerationParams(max_tokens=TOKENS, ignore_eos=True, speculate=False)
    got, _ = drive(Scheduler(plain.engine, 2), [(0, p, params) for p in batch])
    plain.release()
    return {tuple(p): got[i] for i, p in enumerate(batch)}


def test_with_no_traffic_idle_time_answers_the_shipped_prompts_and_a_first_head_learns_from_them(tiny_model_dir):
    loaded = load_deployment(spec(tiny_model_dir), calibrate=False)
    learner = loaded.learner
    assert learner.answers is not None and learner.answers.remaining > 200  # the tiny model has a chat template
    # its passes compute every position's logits: idle answers keep the target's distribution (tested below)
    assert learner.answers.top and learner.options.soft_labels
    quick(learner)  # (which leaves the traffic alone to learn from: here, the prompts below)
    batch = [p * 4 for p in prompts(12, offset=5)]  # 48 tokens: a prompt is read in chunks
    expected = greedy(tiny_model_dir, batch)
    learner.answer(answers_for(loaded, batch, top=True))
    scheduler = Scheduler(loaded.engine, 2, background=learner)
    assert scheduler.has_idle_work()  # no request has been served: there is something to learn from all the same
    assert "answering depctl's prompts" in learner.status()["training"]["state"]
    idle(learner, 120)
    assert learner.answers.remaining == 0
    files = learner.store.training_files() + learner.store.held_out_files()
    assert len(files) == len(batch) and learner.store.held_out_files()
    for path in files:
        answer = read_answer(path)
        tokens = answer.tokens.tolist()
        prompt = tuple(tokens[: answer.prompt_len])
        assert tokens[answer.prompt_len :] == expected[prompt]  # the target's own greedy answer
        with torch.no_grad():  # and the layer outputs it computed at every position but the last
            _, reference = layer_outputs(loaded.target.model, answer.tokens[None].long(), learner.config.aux_layers)
        torch.testing.assert_close(answer.features, reference[:-1], atol=1e-4, rtol=1e-4)
        # the target's distribution at each answer position, written with it (test_then_..., below, checks its values)
        assert answer.top.first == answer.prompt_len - 1
        assert answer.top.ids.shape == answer.top.logp.shape == (len(tokens) - answer.prompt_len, 16)
    status = learner.status()
    assert status["training"]["shipped_prompts"] == {"answered": len(batch), "total": len(batch)}
    assert status["generation"] >= 1 and isinstance(loaded.engine.draft_model, EagleProposer)
    loaded.release()


OPENING, CLOSING = [5, 6, 7, 8], [9, 10]  # a user turn's template around the request, as the tiny model's tokens


def test_then_the_target_writes_requests_in_its_user_turn_and_answers_each_greedily(tiny_model_dir):
    loaded = load_deployment(spec(tiny_model_dir), calibrate=False)
    shipped = prompts(1, offset=3)
    answers = answers_for(loaded, shipped, user_turn=(OPENING, CLOSING), rows=3, top=True)
    got = []
    for _ in range(2000):
        got += answers.piece()
        if len(got) >= 5:
            break
    assert answers.done == 1 and answers.written >= 4  # the shipped prompt first, then requests written
    written = [a for a in got if a.tokens[: len(OPENING)].tolist() == OPENING]
    assert len(written) == len(got) - 1
    requests = []
    for a in written:
        tokens = a.tokens.tolist()
        assert tokens[a.prompt_len - len(CLOSING) : a.prompt_len] == CLOSING  # the template closed the turn
        requests.append(tuple(tokens[len(OPENING) : a.prompt_len - len(CLOSING)]))
        assert 8 <= len(requests[-1]) < MAX_WRITTEN
    assert len(set(requests)) == len(requests)  # sampled: each request differs
    expected = greedy(tiny_model_dir, [a.tokens[: a.prompt_len].tolist() for a in got])
    for a in got:  # answered as the deployment answers: greedy, with every position's layer outputs
        tokens = a.tokens.tolist()
        assert tokens[a.prompt_len :] == expected[tuple(tokens[: a.prompt_len])]
        with torch.no_grad():
            logits, reference = layer_outputs(
                loaded.target.model, a.tokens[None].long(), loaded.learner.config.aux_layers
            )
        torch.testing.assert_close(a.features, reference[:-1], atol=1e-4, rtol=1e-4)
        # and the target's distribution at each answer position, from the prompt's last on
        top = torch.log_softmax(logits[0, a.prompt_len - 1 : -1], dim=-1).topk(16)
        assert a.top.first == a.prompt_len - 1 and torch.equal(a.top.ids[:, 0].long(), top.indices[:, 0])
        torch.testing.assert_close(a.top.logp.float(), top.values, atol=2e-2, rtol=1e-2)
    loaded.release()


def test_a_request_closed_at_once_teaches_only_the_template_and_is_not_kept(tiny_model_dir):
    loaded = load_deployment(spec(tiny_model_dir), calibrate=False)
    every = set(range(loaded.engine.target.vocab_size))  # whatever it samples ends the turn
    answers = answers_for(loaded, [], user_turn=(OPENING, CLOSING), stop_ids=every, rows=2)
    got = [a for _ in range(20) for a in answers.piece()]
    assert got == [] and answers.written >= 4 and answers.answered_written >= 4
    loaded.release()


def writing(model_dir, epochs: float, max_requests: int):
    """A learning deployment whose idle time writes requests and answers them, training ``epochs`` passes over them."""
    loaded = load_deployment(spec(model_dir), calibrate=False)
    quick(loaded.learner)
    loaded.learner.options.epochs = epochs
    loaded.learner.answer(answers_for(loaded, [], user_turn=(OPENING, CLOSING), max_requests=max_requests))
    return loaded


def test_requests_written_go_on_past_their_disk_share_replacing_the_oldest_and_stop_at_their_count(tiny_model_dir):
    loaded = writing(tiny_model_dir, epochs=2, max_requests=60)
    learner = loaded.learner
    while not learner.store.training_files():
        learner.work()
    one = learner.store.bytes / len(learner.store.training_files() + learner.store.held_out_files())
    learner.store.budget = int(40 * one)  # room for about 20 written answers
    assert "answering requests the target writes" in learner.status()["training"]["state"]
    idle(learner, 600)
    assert not learner.has_work()  # idle time ends: every request written, and trained on what was written
    status = learner.status()["training"]
    assert status["requests_written"] == 60
    files = learner.store.training_files() + learner.store.held_out_files()
    assert 15 <= len(files) <= 21 and learner.store.bytes <= 0.5 * learner.store.budget
    numbers = sorted(traffic._number(p) for p in files)  # the newest kept: the oldest made room for them
    assert numbers == list(range(numbers[-1] + 1 - len(files), numbers[-1] + 1)) and numbers[0] >= 20
    assert learner.trainer.rows >= 2 * learner.rows_recorded and learner.generation >= 1
    assert status["state"].startswith("caught up")
    loaded.release()


def test_while_training_could_run_answering_gets_its_share_of_idle_time_and_training_the_rest(tiny_model_dir):
    loaded = writing(tiny_model_dir, epochs=10_000, max_requests=100_000)  # training never catches up with them
    learner = loaded.learner
    while learner.trainer is None or not learner.trainer.steps:  # answering alone until there is enough to train on
        learner.work()
    answered, trained = learner._answering_seconds, learner._training_seconds
    idle(learner, 5)
    answered, trained = learner._answering_seconds - answered, learner._training_seconds - trained
    assert learner.answers.has_work() and trained > 0  # both wanted the time throughout
    assert answered / (answered + trained) == pytest.approx(learner.options.answer_share, abs=0.08)
    loaded.release()


def test_the_draft_vocabulary_is_chosen_again_from_every_answer_as_they_grow_and_a_restart_keeps_it(tiny_model_dir):
    loaded = writing(tiny_model_dir, epochs=10_000, max_requests=100_000)
    learner = loaded.learner
    while learner.trainer is None:  # training starts from the first answers: its vocabulary chosen from them
        learner.work()
    first = learner.trainer.vocabulary_answers
    assert first == len(learner.store.training_files()) >= learner.options.min_answers
    end = time.monotonic() + 120
    while learner.trainer.vocabulary_answers == first and time.monotonic() < end:
        learner.work()
    trainer = learner.trainer
    chosen = trainer.vocabulary_answers
    assert chosen >= VOCABULARY_GROWTH * first
    counts = TokenCounts()  # what every answer then on disk uses most
    for answer in map(read_answer, learner.store.training_files()[:chosen]):
        counts.add(answer.tokens, answer.prompt_len)
    expected = counts.vocabulary(learner.config.draft_vocab_size, learner.config.vocab_size).tolist()
    assert trainer.head.target_ids.tolist() == trainer.average.target_ids.tolist() == expected
    assert learner.status()["training"]["vocabulary_answers"] == chosen
    loaded.release()
    again = load_deployment(spec(tiny_model_dir), calibrate=False)
    quick(again.learner)
    while again.learner.trainer is None:
        again.learner.work()
    assert again.learner.trainer.vocabulary_answers == chosen
    assert again.learner.trainer.head.target_ids.tolist() == expected
    again.release()


def test_a_piece_reads_fewer_prompt_tokens_a_row_where_passes_overran_their_time(tiny_model_dir):
    loaded = load_deployment(spec(tiny_model_dir), calibrate=False)
    batch = [p * 8 for p in prompts(4, offset=7)]  # 96-token prompts, read a chunk a pass
    hurried = answers_for(loaded, batch, slice_seconds=1e-6)
    leisurely = answers_for(loaded, batch, slice_seconds=100.0)
    for _ in range(6):
        hurried.piece()
        leisurely.piece()
    assert hurried.chunk == MIN_CHUNK and leisurely.chunk == MAX_CHUNK
    assert sum(r.read for r in leisurely.rows) > sum(r.read for r in hurried.rows)
    loaded.release()


def test_a_request_arriving_mid_answer_is_served_as_without_it_and_the_answer_goes_on(tiny_model_dir):
    loaded = load_deployment(spec(tiny_model_dir), calibrate=False)
    learner = loaded.learner
    batch = prompts(2, offset=9)
    requests = prompts(3, offset=31)
    plain = greedy(tiny_model_dir, batch + requests)
    learner.answer(answers_for(loaded, batch, top=True))
    scheduler = Scheduler(loaded.engine, 2, background=learner)
    for _ in range(TOKENS // 2):  # half of the first answer, a pass per piece
        learner.work(seconds=0.0)
    assert learner.answers.done == 0 and learner.answers.rows
    params = GenerationParams(max_tokens=TOKENS, ignore_eos=True, speculate=False)
    got, _ = drive(scheduler, [(0, p, params) for p in requests])
    assert [got[i] for i in range(len(requests))] == [plain[tuple(p)] for p in requests]
    idle(learner, 60)
    assert learner.answers.remaining == 0
    for path in learner.store.training_files() + learner.store.held_out_files():
        answer = read_answer(path)
        tokens = answer.tokens.tolist()
        assert tokens[answer.prompt_len :] == plain[tuple(tokens[: answer.prompt_len])]
    loaded.release()


def test_answering_resumes_where_a_restart_left_off(tiny_model_dir):
    loaded = load_deployment(spec(tiny_model_dir), calibrate=False)
    learner = loaded.learner
    quick(learner)
    batch = prompts(12, offset=2)
    learner.answer(answers_for(loaded, batch))
    idle(learner, 120)  # every prompt answered, and training started on them
    assert learner.trainer is not None
    learner.answers.user_turn = (OPENING, CLOSING)
    while learner.answers.written < 3:  # requests written, their sampling seeded by their number
        learner.answers.piece()
    written = learner.answers.written
    loaded.release()
    again = load_deployment(spec(tiny_model_dir), calibrate=False)
    again.learner.answer(answers_for(again, batch, user_turn=(OPENING, CLOSING)))
    assert again.learner.answers.remaining == 0  # not answered twice
    assert again.learner.answers.written == written  # and the next request written is a new one
    again.release()


def test_a_model_with_a_chat_template_answers_the_shipped_prompts_through_it(tiny_model_dir):
    from depctl_runtime.training.data import load_conversations

    class Templated:
        chat_template = "{{ messages }}"

        def apply_chat_template(self, conversation, add_generation_prompt, tokenize):
            return "<user>" + conversation[-1]["content"] + "<assistant>"

        def __call__(self, text, add_special_tokens):
            return {"input_ids": [min(ord(c), 250) for c in text]}

    loaded = load_deployment(spec(tiny_model_dir), calibrate=False)
    vocab = loaded.engine.target.vocab_size
    answers = learning.idle_answers(loaded.learner, loaded.target.model, Templated(), vocab, (0,))
    conversations = load_conversations(None)
    assert len(answers.prompts) == len(conversations) and answers.stop_ids == {0}
    first = "<user>" + conversations[0][-1]["content"] + "<assistant>"
    assert [min(ord(c), 250) for c in first] in answers.prompts
    # the turn the target writes requests in: the template's text before and after a request
    assert answers.user_turn == ([min(ord(c), 250) for c in "<user>"], [min(ord(c), 250) for c in "<assistant>"])
    loaded.release()


@pytest.mark.slow  # builds the tiny model's library: tens of seconds
def test_where_the_deployment_compiled_its_passes_idle_answers_run_through_an_instance_of_their_own(tiny_model_dir):
    loaded = load_deployment(spec(tiny_model_dir).model_copy(update={"compile": True}), calibrate=False)
    assert loaded.engine.target.fast_pass is not None, loaded.compiled_status
    answers = loaded.learner.answers  # as the loader made them
    batch = prompts(3, offset=11)
    expected = greedy(tiny_model_dir, batch)
    answers.prompts, answers.user_turn, answers.stop_ids, answers.max_tokens = batch, None, set(), TOKENS
    got = []
    while answers.has_work():
        got += answers.piece()
    runner = answers.runner
    assert isinstance(runner.fast_pass, CompiledPass) and runner.fast_pass is not loaded.engine.target.fast_pass
    assert runner.cache is not loaded.engine.target.cache
    assert len(got) == len(batch)
    for a in got:  # the target's greedy answers
        tokens = a.tokens.tolist()
        assert tokens[a.prompt_len :] == expected[tuple(tokens[: a.prompt_len])]
    loaded.release()
