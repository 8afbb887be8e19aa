"""A head that learns from the deployment's own traffic: it trains in idle time, serves once it drafts better, never
changes an output, and goes on where it was after a restart."""

from __future__ import annotations

import stat
import time
from types import SimpleNamespace

import pytest
import torch

from depctl import learning
from depctl.spec import DeploymentSpec, LearnDraftHead, NgramSpeculation
from depctl_runtime.backends.loader import load_deployment
from depctl_runtime.speculation import GenerationParams, NgramProposer, Scheduler
from depctl_runtime.speculation.eagle import EagleProposer
from depctl_runtime.speculation.policy import rate_for_mean_accepted
from depctl_runtime.training.eagle import acceptance, reach, window_loss
from depctl_runtime.training.online import WARMUP_ROWS, HeadLearner, LearnOptions, _Trainer, trainable_copy
from depctl_runtime.training.traffic import Answer, Top, read_answer
from tests.driving import drive
from tests.tiny import tiny_head

GREEDY = GenerationParams(max_tokens=40, ignore_eos=True)


def spec(model_dir, **kw) -> DeploymentSpec:
    """float32 unless told: the learning tests compare recorded features and heads with float32 references."""
    return DeploymentSpec(
        id="learns",
        model=str(model_dir),
        device="cpu",
        compile=False,
        max_batch_size=2,
        speculation=NgramSpeculation(ngram_length=3, num_draft_tokens=4),
        prefix_cache_bytes=0,
        **{"dtype": "float32", "learn_draft_head": LearnDraftHead(), **kw},
    )


def quick(learner) -> None:
    """Comparisons after a fraction of a second, and any first head that drafts at all may serve; it learns from the
    traffic alone (the tiny model's chat template would have it answer prompts of its own too: test_answers)."""
    learner.answers = None
    o = learner.options
    o.min_answers, o.first_comparison, o.compare_every, o.first_head_min, o.epochs = 8, 0.5, 1.0, 1.0, 30


def prompts(n: int, offset: int = 0) -> list[list[int]]:
    return [[(7 * i + 3 * j + offset) % 200 + 30 for j in range(12)] for i in range(n)]


def idle(learner, seconds: float) -> None:
    end = time.monotonic() + seconds
    while learner.has_work() and time.monotonic() < end:
        learner.work()


@pytest.fixture
def plain_outputs(tiny_model_dir):
    plain = load_deployment(
        DeploymentSpec(
            id="plain", model=str(tiny_model_dir), device="cpu", dtype="float32", compile=False, max_batch_size=2
        ),
        calibrate=False,
    )
    cache = {}

    def outputs(batch):
        key = tuple(map(tuple, batch))
        if key not in cache:
            cache[key], _ = drive(Scheduler(plain.engine, 2), [(0, p, GREEDY) for p in batch])
        return cache[key]

    return outputs


@pytest.mark.slow  # a whole learning deployment: half a minute (engine-level swaps: tests/runtime/speculation)
def test_a_learning_deployment_trains_in_idle_time_swaps_in_a_better_head_and_stays_exact(
    tiny_model_dir, plain_outputs
):
    loaded = load_deployment(spec(tiny_model_dir), calibrate=False)
    learner, engine = loaded.learner, loaded.engine
    quick(learner)
    assert engine.observer is learner.recorder and isinstance(engine.proposer, NgramProposer)
    assert engine.prefix is None  # prompts are read whole: every position's features are kept
    scheduler = Scheduler(engine, 2, background=learner)
    assert not scheduler.has_idle_work()  # nothing recorded yet
    first = prompts(48)
    got, _ = drive(scheduler, [(i // 2, p, GREEDY) for i, p in enumerate(first)])
    assert got == plain_outputs(first)
    assert learner.store.counts()["waiting"] == 48 and learner.store.counts()["answers"] == 0  # written when idle
    idle(learner, 60)
    status = learner.status()
    assert status["generation"] >= 1 and status["drafting"] == "head", status
    trained = [p for n, p in learner.trainer.head.named_parameters() if not n.startswith("embed_tokens")]
    # in the deployment's memory: the head in training with AdamW's two moments, and the serving generation
    assert learner.memory_bytes() >= 4 * sum(p.numel() * p.element_size() for p in trained)
    assert isinstance(engine.draft_model, EagleProposer)
    assert isinstance(engine.free, NgramProposer)  # its matches still draft first
    history = learner.history
    assert history[0]["promoted"] and history[0]["serving"] is None  # the first head replaced the n-gram index
    assert all(h["candidate"] >= h["serving"] + 0.02 for h in history[1:] if h["promoted"])

    # the training taught it the target's answers: better than the same head untrained, on held-out answers
    held = [read_answer(p).example() for p in learner.store.held_out_files()]
    steps = learner.options.steps
    fresh = _Trainer(learner._new_head(), learner.options, learner.trainer.head.target_ids - 0, learner._final_norm())

    def score(head):
        reached, positions = [0] * steps, 0
        for example in held:
            r, n = reach(head, example, steps)
            reached, positions = [a + b for a, b in zip(reached, r)], positions + n
        return acceptance(reached, positions)["mean_accepted"]

    assert score(learner.serving) > score(fresh.head) + 0.2

    # served by the head now: the same output as plain decoding, and the head drafts (every step: a tiny target's
    # pass costs about what a head's step does, so the policy would rightly draft rarely)
    engine.policy.adaptive = False
    drafted = engine.stats.num_draft_tokens
    later = prompts(6, offset=11)
    got, _ = drive(scheduler, [(0, p, GREEDY) for p in later])
    assert got == plain_outputs(later)
    assert engine.stats.num_draft_tokens > drafted
    assert learner.status()["live"]["drafted"] > 0

    # everything it learned is private to its owner, under the deployment's own folder
    folder = learning.path("learns")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for path in folder.rglob("*"):
        if path.is_file():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path

    # a restart serves the last generation at once and goes on training from where it was
    generation, rows = learner.generation, learner.trainer.rows
    loaded.release()
    again = load_deployment(spec(tiny_model_dir), calibrate=False)
    assert isinstance(again.engine.draft_model, EagleProposer) and isinstance(again.engine.free, NgramProposer)
    assert again.learner.generation == generation
    # its drafts start from the rate its last held-out score gives, as when it was swapped in, not a default
    score = learner.serving_mean_accepted()
    assert score is not None and score == again.learner.serving_mean_accepted()
    assert again.engine.policy.model_rate == pytest.approx(rate_for_mean_accepted(score, learner.options.steps))
    assert again.learner.trainer.rows == rows and again.learner.history == learner.history
    got, _ = drive(Scheduler(again.engine, 2), [(0, p, GREEDY) for p in later])
    assert got == plain_outputs(later)
    again.release()


def test_a_learning_deployment_started_from_a_trained_head_serves_it_at_once_and_trains_on_from_it(
    tiny_model_dir, plain_outputs, tmp_path
):
    from depctl_runtime.model import eagle_format
    from depctl_runtime.training.eagle import DRAFT_VOCAB
    from tests.tiny import save_tiny_head

    seed = save_tiny_head(tmp_path / "seed", tiny_model_dir, draft_vocab=DRAFT_VOCAB, extra={"examples": 500})
    eagle_format.save(*_with_score(seed, 1.6))
    loaded = load_deployment(spec(tiny_model_dir, learn_draft_head=LearnDraftHead(start_from=str(seed))), False)
    learner, engine = loaded.learner, loaded.engine
    # it drafts from the first request, beside the index, from the rate its recorded score gives
    assert isinstance(engine.draft_model, EagleProposer) and isinstance(engine.free, NgramProposer)
    status = learner.status()
    assert status["generation"] == 1 and status["drafting"] == "head" and status["started_from"] == str(seed)
    assert engine.policy.model_rate == pytest.approx(rate_for_mean_accepted(1.6, 4))
    given, _ = eagle_format.load(seed, learner._embeddings())
    assert torch.equal(learner.serving.fc.weight, given.fc.weight)
    quick(learner)
    scheduler = Scheduler(engine, 2, background=learner)
    engine.policy.adaptive = False  # the head drafts every step: its drafts never change the output
    batch = prompts(24)
    got, _ = drive(scheduler, [(i // 2, p, GREEDY) for i, p in enumerate(batch)])
    assert got == plain_outputs(batch)
    assert learner.status()["live"]["drafted"] > 0
    while learner.trainer is None:  # training goes on from the head it was given: its weights and vocabulary
        assert learner._unit()
    assert torch.equal(learner.trainer.head.fc.weight, given.fc.weight)
    assert torch.equal(learner.trainer.head.target_ids, given.target_ids)
    assert learner.trainer.vocabulary_answers == 500  # chosen from its own answers: not chosen again for a while
    assert learner.trainer.continued and learner.trainer.lr == learner.options.continued_lr
    idle(learner, 20)
    assert learner.history and learner.history[0]["serving"] is not None  # a candidate must beat the given head
    loaded.release()
    # a restart serves what it has, the given head or a generation learned from it, whether or not the folder stays
    for path in seed.iterdir():
        path.unlink()
    again = load_deployment(spec(tiny_model_dir, learn_draft_head=LearnDraftHead(start_from=str(seed))), False)
    assert again.learner.generation == learner.generation and again.learner.started_from == str(seed)
    assert isinstance(again.engine.draft_model, EagleProposer)
    again.release()


def _with_score(folder, mean_accepted: float):
    """``eagle_format.save``'s arguments to write the head in ``folder`` again with a held-out score recorded."""
    from depctl_runtime.model import eagle_format

    config = eagle_format.read_config(folder)
    head, _ = eagle_format.load(folder, torch.zeros(config["transformer_layer_config"]["vocab_size"], 64))
    extra = {**config["depctl"], "history": [{"mean_accepted": mean_accepted}]}
    return head, folder, config["speculators_config"]["verifier"], 4, extra


@pytest.mark.parametrize(
    "draft_vocab,other_target,error",
    [(4096, True, "trained for.*another model"), (96, False, "drafts within 96 tokens.*--draft-vocab 260")],
)
def test_a_head_to_start_from_that_does_not_fit_is_refused_naming_the_flag(
    tiny_model_dir, tiny_draft_dir, tmp_path, draft_vocab, other_target, error
):
    from depctl_runtime.backends.weights import LoadError
    from tests.tiny import save_tiny_head

    target = tiny_draft_dir if other_target else tiny_model_dir
    seed = save_tiny_head(tmp_path / "seed", target, draft_vocab=draft_vocab)
    learn = LearnDraftHead(start_from=str(seed))
    with pytest.raises(LoadError, match=f"--learn-draft-head-from '{seed}'.*{error}"):
        load_deployment(spec(tiny_model_dir, learn_draft_head=learn), calibrate=False)
    assert not (learning.path("learns") / "head").exists()


def test_training_waits_for_idle_time_and_a_failure_stops_learning_not_serving(tiny_model_dir, plain_outputs):
    loaded = load_deployment(spec(tiny_model_dir), calibrate=False)
    learner = loaded.learner
    quick(learner)
    scheduler = Scheduler(loaded.engine, 2, background=learner)
    batch = prompts(20)
    calls = []
    work = learner.work
    learner.work = lambda: (calls.append(scheduler.has_work()), work())[1]
    got, _ = drive(scheduler, [(0, p, GREEDY) for p in batch])
    scheduler.add(loaded.engine.new_sequence(batch[0], GREEDY))
    assert scheduler.has_idle_work()
    scheduler.idle()  # a request waits: idle work waits for it
    assert calls == []
    while scheduler.has_work():
        scheduler.step()
    while scheduler.has_idle_work():
        scheduler.idle()
        if learner.trainer is not None and learner.trainer.rows:
            break
    assert calls and not any(calls)

    def broken(*_):
        raise RuntimeError("disk on fire")

    learner.trainer.train_window = broken
    learner.work()
    assert learner.status()["training"]["state"] == "failed" and "disk on fire" in learner.status()["error"]
    assert not learner.has_work()
    got, _ = drive(scheduler, [(0, p, GREEDY) for p in batch[:4]])
    assert got == plain_outputs(batch[:4])
    loaded.release()


def test_a_learning_deployment_is_refused_for_a_model_its_head_cannot_read(tmp_path):
    from depctl_runtime.backends.weights import LoadError
    from tests.tiny import tiny_qwen2_sliding

    model = tiny_qwen2_sliding()
    model.save_pretrained(tmp_path / "m")
    from tests.tiny import byte_tokenizer

    byte_tokenizer().save_pretrained(tmp_path / "m")
    with pytest.raises(LoadError, match="--learn-draft-head"):
        load_deployment(spec(tmp_path / "m"), calibrate=False)


def test_deleting_the_deployment_deletes_what_it_learned(tiny_model_dir):
    from depctl.store import SpecStore

    store = SpecStore()
    store.create(spec(tiny_model_dir))
    folder = learning.path("learns")
    (folder / "traffic").mkdir(parents=True)
    (folder / "traffic" / "train-0.safetensors").write_bytes(b"x")
    store.delete("learns")
    assert not folder.exists()


def test_resumed_training_state_is_refused_for_another_target(tiny_model_dir, tiny_draft_dir):
    loaded = load_deployment(spec(tiny_model_dir), calibrate=False)
    quick(loaded.learner)
    drive(Scheduler(loaded.engine, 2), [(0, p, GREEDY) for p in prompts(20)])
    idle(loaded.learner, 20)
    assert loaded.learner.generation >= 1
    loaded.release()
    other = load_deployment(spec(tiny_draft_dir), calibrate=False)  # same id, other weights: starts over
    assert other.learner.generation == 0 and other.learner.trainer is None
    assert isinstance(other.engine.proposer, NgramProposer)
    other.release()


@pytest.mark.parametrize("steps,train_steps,chained", [(4, 2, 2), (4, 8, 4), (1, 2, 1)])
def test_the_head_trains_its_chained_steps_up_to_train_steps_and_is_measured_at_k(steps, train_steps, chained):
    head = tiny_head(vocab=50, draft_vocab=40)
    trainer = _Trainer(head, LearnOptions(steps=steps, train_steps=train_steps))
    asked = []
    ttt = head.ttt_logits
    head.ttt_logits = lambda tokens, features, n, **kw: asked.append(n) or ttt(tokens, features, n, **kw)
    answer = Answer(torch.randint(0, 50, (30,)), torch.randn(29, 3 * 32), prompt_len=10)
    trainer.train_window(lambda: answer, 1.0)
    assert asked == [chained] and trainer.rows > 0


def test_the_candidate_is_the_running_average_of_the_weights_and_the_state_keeps_it():
    head = tiny_head(vocab=50, draft_vocab=40)
    trainer = _Trainer(head, LearnOptions(steps=4, batch_rows=4, average=0.9))
    assert trainer.candidate is trainer.average and trainer.average.embed_tokens is head.embed_tokens  # shared
    answer = Answer(torch.randint(0, 50, (30,)), torch.randn(29, 3 * 32), prompt_len=10)
    names = [n for n, _ in head.named_parameters() if not n.startswith("embed_tokens")]
    for step in (1, 2):
        kept = {n: p.detach().clone() for n, p in trainer.average.named_parameters()}
        trainer.train_window(lambda: answer, 1.0)  # a window of more than 4 positions: one optimizer step
        assert trainer.steps == step
        weights = dict(head.named_parameters())
        decay = min(0.9, (1 + step) / (10 + step))
        for n, p in trainer.average.named_parameters():
            if n in names:
                torch.testing.assert_close(p, decay * kept[n] + (1 - decay) * weights[n])
    assert any(not torch.equal(dict(trainer.average.named_parameters())[n], weights[n]) for n in names)

    again = _Trainer(tiny_head(vocab=50, draft_vocab=40), LearnOptions(steps=4, average=0.9))
    again.restore(trainer.state(), trainer.optimizer.state_dict(), trainer.info())
    for which in ("head", "average"):
        saved, restored = getattr(trainer, which).state_dict(), getattr(again, which).state_dict()
        assert all(torch.equal(saved[k], restored[k]) for k in saved if k != "embed_tokens.weight"), which
    # a state kept before averaging: the average starts from the weights
    older = {k: v for k, v in trainer.state().items() if not k.startswith("average.")}
    again.restore(older, trainer.optimizer.state_dict(), trainer.info())
    assert all(torch.equal(again.average.state_dict()[k], v) for k, v in older.items())
    # no averaging: the weights as trained are the candidate
    plain = _Trainer(tiny_head(vocab=50, draft_vocab=40), LearnOptions(steps=4, average=0.0))
    assert plain.average is None and plain.candidate is plain.head and "average." not in "".join(plain.state())


@pytest.mark.parametrize("full_memory", [True, False])
def test_training_on_from_a_trained_head_takes_its_own_rate_and_average_memory_and_keeps_them_across_a_restore(
    full_memory,
):
    options = LearnOptions(
        steps=4, batch_rows=4, average=0.9, lr=1e-2, continued_lr=1e-3, continued_full_memory=full_memory
    )
    trainer = _Trainer(tiny_head(vocab=50, draft_vocab=40), options, continued=True)
    answer = Answer(torch.randint(0, 50, (30,)), torch.randn(29, 3 * 32), prompt_len=10)
    kept = {n: p.detach().clone() for n, p in trainer.average.named_parameters()}
    trainer.train_window(lambda: answer, 1.0)  # one optimizer step
    assert trainer.steps == 1
    ramp = min(1.0, trainer.rows / WARMUP_ROWS)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * ramp)  # the continued rate, not 1e-2
    weights = dict(trainer.head.named_parameters())
    decay = 0.9 if full_memory else 2 / 11  # a trained head's first weights are worth the full memory
    name = "fc.weight"
    torch.testing.assert_close(
        dict(trainer.average.named_parameters())[name], decay * kept[name] + (1 - decay) * weights[name]
    )
    again = _Trainer(tiny_head(vocab=50, draft_vocab=40), options)
    again.restore(trainer.state(), trainer.optimizer.state_dict(), trainer.info())
    assert again.continued and again.lr == 1e-3
    assert not _Trainer(tiny_head(vocab=50, draft_vocab=40), options).continued  # a new head: options.lr


def test_a_serving_heads_trainable_copy_trains_and_leaves_the_serving_head_as_it_was():
    serving = tiny_head(vocab=50, draft_vocab=40).eval().requires_grad_(False)  # as a head read to serve is
    before = {k: v.clone() for k, v in serving.state_dict().items()}
    copied = trainable_copy(serving)
    assert copied.embed_tokens.weight is serving.embed_tokens.weight and not copied.embed_tokens.weight.requires_grad
    trainer = _Trainer(copied, LearnOptions(steps=4, batch_rows=4), continued=True)
    answer = Answer(torch.randint(0, 50, (30,)), torch.randn(29, 3 * 32), prompt_len=10)
    trainer.train_window(lambda: answer, 1.0)
    assert trainer.steps == 1 and not torch.equal(copied.fc.weight, before["fc.weight"])
    assert all(torch.equal(v, before[k]) for k, v in serving.state_dict().items())


def test_a_new_draft_vocabulary_keeps_the_rows_of_the_tokens_it_keeps_and_starts_new_ones_as_a_new_head_does():
    head = tiny_head(vocab=50, draft_vocab=40)  # drafts tokens 0..39
    trainer = _Trainer(head, LearnOptions(steps=4, batch_rows=4, average=0.9))
    answer = Answer(torch.randint(0, 50, (30,)), torch.randn(29, 3 * 32), prompt_len=10)
    for _ in range(2):
        trainer.train_window(lambda: answer, 1.0)
    rows = {m: getattr(trainer, m).lm_head.weight.detach().clone() for m in ("head", "average")}
    moments = {k: v.clone() for k, v in trainer.optimizer.state[head.lm_head.weight].items() if k != "step"}
    trainer.revocabulary(torch.arange(10, 50))  # tokens 10..39 kept, 40..49 new
    for m in ("head", "average"):
        model = getattr(trainer, m)
        assert model.target_ids.tolist() == list(range(10, 50)), m
        torch.testing.assert_close(model.lm_head.weight[:30], rows[m][10:])  # draft ids 0..29 are tokens 10..39
        torch.testing.assert_close(model.lm_head.weight[30:], head.embed_tokens.weight[40:50])  # the target's rows
    state = trainer.optimizer.state[head.lm_head.weight]
    torch.testing.assert_close(state["exp_avg"][:30], moments["exp_avg"][10:])
    assert not state["exp_avg"][30:].any()
    torch.testing.assert_close(state["exp_avg_sq"][:30], moments["exp_avg_sq"][10:])
    torch.testing.assert_close(state["exp_avg_sq"][30:], moments["exp_avg_sq"][10:].mean(0).expand(10, -1))
    trained = head.lm_head.weight[30:].detach().clone()
    trainer.train_window(lambda: answer, 1.0)  # training goes on, the new tokens' rows with it
    assert trainer.steps == 3 and not torch.equal(head.lm_head.weight[30:], trained)
    trainer.vocabulary_answers = 12
    again = _Trainer(tiny_head(vocab=50, draft_vocab=40), LearnOptions(steps=4, average=0.9))
    again.restore(trainer.state(), trainer.optimizer.state_dict(), trainer.info())
    assert again.vocabulary_answers == 12
    assert again.head.target_ids.tolist() == again.average.target_ids.tolist() == list(range(10, 50))


def test_answer_positions_learn_the_targets_distribution_where_it_was_kept_and_prompt_positions_its_tokens():
    torch.manual_seed(0)
    head = tiny_head(vocab=50, draft_vocab=40)  # drafts tokens 0..39
    tokens, features, prompt_len = torch.randint(0, 40, (30,)), torch.randn(29, 3 * 32), 10
    n = len(tokens) - prompt_len  # the answer's distributions: positions prompt_len - 1 .. 28

    def top(ids, logp) -> Top:
        return Top(ids.to(torch.int32), logp.to(torch.float16), prompt_len - 1)

    def loss(kept: Top | None):
        return window_loss(head, tokens.long(), features, 0, 2, 2, top=kept)

    hard, counted = loss(None)
    assert counted == 28  # every index whose next-but-one token exists
    # each answer position's distribution all on the token the target chose: the same loss
    one_hot = top(torch.stack([tokens[prompt_len:], (tokens[prompt_len:] + 1) % 40], 1), torch.tensor([0.0, -30.0]))
    same, counted_again = loss(one_hot)
    torch.testing.assert_close(same, hard, rtol=1e-3, atol=1e-3)
    assert counted_again == counted
    # spread over two tokens: a different loss, the prompt's positions unchanged
    spread = top(one_hot.ids, torch.tensor([0.5, 0.5]).log().expand(n, 2))
    changed, _ = loss(spread)
    assert abs(float(changed.detach()) - float(hard.detach())) > 1e-3
    prompt = tokens[:prompt_len].long(), features[: prompt_len - 1], 0, 2, 2  # labels up to the prompt's last token
    torch.testing.assert_close(window_loss(head, *prompt, top=spread)[0], window_loss(head, *prompt)[0])
    # a distribution whose likely tokens are never drafted (ids 40..49) teaches nothing at its position
    outside = top(torch.full((n, 2), 45), torch.tensor([0.0, -30.0]).expand(n, 2))
    _, counted_outside = loss(outside)
    assert counted_outside == counted - n  # step 0's rows labelled at positions prompt_len - 1 .. 28 drop out
    trainer = _Trainer(head, LearnOptions(steps=4, batch_rows=1 << 20))
    trainer.train_window(lambda: Answer(tokens, features, prompt_len, top=outside), 1.0)
    assert trainer.rows == counted_outside  # the trainer passes what the answer kept
    trainer = _Trainer(tiny_head(vocab=50, draft_vocab=40), LearnOptions(steps=4, soft_labels=False))
    trainer.train_window(lambda: Answer(tokens, features, prompt_len, top=outside), 1.0)
    assert trainer.rows == counted  # ... unless told to learn the tokens alone


@pytest.mark.parametrize("prompt_positions", [True, False])
def test_bf16_windows_start_at_a_bucket_and_the_last_is_padded_counting_the_same_positions(
    monkeypatch, prompt_positions
):
    """In bf16 on a CPU every window's shapes come from a few dozen (oneDNN builds its bf16 products once a shape): a
    window starts at a multiple of ``SHAPE_BUCKET`` and spans a multiple of it, the answer's last one padded; the
    padding is never counted, so float32 and bf16 train on the same positions."""
    from depctl_runtime.training import online
    from depctl_runtime.training.eagle import SHAPE_BUCKET

    answer = Answer(torch.randint(0, 50, (75,)), torch.randn(74, 3 * 32), prompt_len=10)
    seen = {}
    for dtype in ("float32", "bfloat16"):
        calls = seen[dtype] = []

        def spy(head, tokens, features, first, *args, **kw):
            calls.append((first, len(tokens), features.shape[0], kw.get("labelled_until")))
            return window_loss(head, tokens, features, first, *args, **kw)

        monkeypatch.setattr(online, "window_loss", spy)
        options = LearnOptions(steps=4, batch_rows=1 << 20, prompt_positions=prompt_positions, train_dtype=dtype)
        trainer = _Trainer(tiny_head(vocab=50, draft_vocab=40), options)
        fed = []
        while len(fed) < 2:  # the whole answer, then the first window of the next
            trainer.train_window(lambda: fed.append(answer) or answer, 1.0)
        calls.pop()
        seen[dtype] = (calls, trainer.rows)
    calls, rows = seen["bfloat16"]
    assert all(first % SHAPE_BUCKET == 0 and (length - 2 - first) % SHAPE_BUCKET == 0 for first, length, _, _ in calls)
    assert all(features == length - 1 for _, length, features, _ in calls)
    assert calls[-1][1] > 75 and calls[-1][3] == 75  # the last window padded; its labels end with the answer
    assert rows == seen["float32"][1]
    assert seen["float32"][0][-1][1] == 75  # float32 windows are not padded


@pytest.mark.parametrize(
    "history,since,caught_up,owed",
    [
        ([], 0.1, False, False),  # the first comparison waits for its seconds of training
        ([], 0.1, True, False),  # ... even when training caught up with a few answers
        ([], 30.0, False, True),
        ([{}], 0.1, True, False),  # caught up on a trickle of new answers: not a comparison after every one
        ([{}], 30.0, True, True),  # caught up after as much training as a first head got: measured without waiting
        ([{}], 60.0, False, False),  # training on: every COMPARE_EVERY seconds
        ([{}], 120.0, False, True),
    ],
)
def test_a_comparison_is_owed_after_enough_training_not_after_every_answer_once_training_caught_up(
    history, since, caught_up, owed
):
    options = LearnOptions(steps=4)
    recorded = 1_000
    rows = options.epochs * recorded + (0 if caught_up else -1)
    learner = SimpleNamespace(
        trainer=SimpleNamespace(steps=10, rows=rows),
        options=options,
        history=history,
        rows_recorded=recorded,
        _since_comparison=since,
    )
    assert HeadLearner._owes_comparison(learner) is owed
