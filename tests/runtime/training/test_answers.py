"""A learning head's first data: the target's answers to the shipped prompts, generated in the idle time training
cannot use, through a runner of their own, so requests in between are served exactly as without them."""

from __future__ import annotations

import torch

from depctl.spec import DeploymentSpec
from depctl_runtime.backends.loader import load_deployment
from depctl_runtime.model.eagle import layer_outputs
from depctl_runtime.model.runner import ModelRunner
from depctl_runtime.speculation import GenerationParams, Scheduler
from depctl_runtime.speculation.eagle import EagleProposer
from depctl_runtime.training.shipped import ShippedAnswers
from depctl_runtime.training.traffic import read_answer
from tests.driving import drive
from tests.runtime.training.test_online import idle, prompts, quick, spec

TOKENS = 24


def shipped_for(loaded, batch, **kw) -> ShippedAnswers:
    model, learner = loaded.target.model, loaded.learner

    def make_runner(context: int) -> ModelRunner:
        return ModelRunner(model, loaded.engine.target.vocab_size, 1, context, features=learner.config.aux_layers)

    return ShippedAnswers(make_runner, batch, stop_ids=set(), dtype=torch.float32, max_tokens=TOKENS, **kw)


def greedy(model_dir, batch) -> dict[tuple, list[int]]:
    """Each prompt's greedy answer from a plain deployment of the same weights (a learning one records what it
    serves)."""
    plain = load_deployment(
        DeploymentSpec(id="plain", model=str(model_dir), device="cpu", compile=False, max_batch_size=2),
        calibrate=False,
    )
    params = GenerationParams(max_tokens=TOKENS, ignore_eos=True, speculate=False)
    got, _ = drive(Scheduler(plain.engine, 2), [(0, p, params) for p in batch])
    plain.release()
    return {tuple(p): got[i] for i, p in enumerate(batch)}


def test_with_no_traffic_idle_time_answers_the_shipped_prompts_and_a_first_head_learns_from_them(tiny_model_dir):
    loaded = load_deployment(spec(tiny_model_dir), calibrate=False)
    learner = loaded.learner
    assert learner.shipped is not None and learner.shipped.remaining > 200  # the tiny model has a chat template
    quick(learner)  # (which leaves the traffic alone to learn from: here, the prompts below)
    batch = [p * 4 for p in prompts(12, offset=5)]  # 48 tokens: a prompt is read in chunks
    expected = greedy(tiny_model_dir, batch)
    learner.answer(shipped_for(loaded, batch))
    scheduler = Scheduler(loaded.engine, 2, background=learner)
    assert scheduler.has_idle_work()  # no request has been served: there is something to learn from all the same
    assert "answering depctl's prompts" in learner.status()["training"]["state"]
    idle(learner, 120)
    assert learner.shipped.remaining == 0
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
    status = learner.status()
    assert status["training"]["shipped_prompts"] == {"answered": len(batch), "total": len(batch)}
    assert status["generation"] >= 1 and isinstance(loaded.engine.draft_model, EagleProposer)
    loaded.release()


def test_a_request_arriving_mid_answer_is_served_as_without_it_and_the_answer_goes_on(tiny_model_dir):
    loaded = load_deployment(spec(tiny_model_dir), calibrate=False)
    learner = loaded.learner
    batch = prompts(2, offset=9)
    requests = prompts(3, offset=31)
    plain = greedy(tiny_model_dir, batch + requests)
    learner.answer(shipped_for(loaded, batch))
    scheduler = Scheduler(loaded.engine, 2, background=learner)
    for _ in range(TOKENS // 2):  # half of the first answer, a pass per piece
        learner.work(seconds=0.0)
    assert learner.shipped.done == 0 and learner.shipped._tokens
    params = GenerationParams(max_tokens=TOKENS, ignore_eos=True, speculate=False)
    got, _ = drive(scheduler, [(0, p, params) for p in requests])
    assert [got[i] for i in range(len(requests))] == [plain[tuple(p)] for p in requests]
    idle(learner, 60)
    assert learner.shipped.remaining == 0
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
    learner.answer(shipped_for(loaded, batch))
    idle(learner, 120)  # every prompt answered, and training started on them
    assert learner.trainer is not None
    loaded.release()
    again = load_deployment(spec(tiny_model_dir), calibrate=False)
    again.learner.answer(shipped_for(again, batch))
    assert again.learner.shipped.remaining == 0  # not answered twice
    again.release()


def test_a_model_with_a_chat_template_answers_the_shipped_prompts_through_it(tiny_model_dir):
    from depctl_runtime.backends import learning
    from depctl_runtime.training.data import load_conversations

    class Templated:
        chat_template = "{{ messages }}"

        def apply_chat_template(self, conversation, add_generation_prompt, tokenize):
            return "<user>" + conversation[-1]["content"] + "<assistant>"

        def __call__(self, text, add_special_tokens):
            return {"input_ids": [min(ord(c), 250) for c in text]}

    loaded = load_deployment(spec(tiny_model_dir), calibrate=False)
    vocab = loaded.engine.target.vocab_size
    shipped = learning.shipped_answers(loaded.learner, loaded.target.model, Templated(), vocab, (0,))
    conversations = load_conversations(None)
    assert len(shipped.prompts) == len(conversations) and shipped.stop_ids == {0}
    first = "<user>" + conversations[0][-1]["content"] + "<assistant>"
    assert [min(ord(c), 250) for c in first] in shipped.prompts
    loaded.release()
