"""A learning head's data: what the target computed for each served answer, kept privately within a disk budget."""

from __future__ import annotations

import stat

import pytest
import torch

from depctl.spec import DeploymentSpec, NgramSpeculation
from depctl_runtime.backends.loader import load_deployment
from depctl_runtime.model.eagle import layer_outputs
from depctl_runtime.speculation import GenerationParams, SamplingParams, Scheduler, SpeculativeEngine
from depctl_runtime.training import traffic
from depctl_runtime.training.traffic import HELD_OUT_EVERY, Answer, TrafficRecorder, TrafficStore, read_answer


def test_served_answers_are_kept_with_the_layer_outputs_of_every_position_read(tiny_model_dir, tmp_path):
    layers = (0, 1, 1)
    loaded = load_deployment(
        DeploymentSpec(
            id="t",
            model=str(tiny_model_dir),
            device="cpu",
            dtype="float32",
            compile=False,
            max_batch_size=2,
            speculation=NgramSpeculation(ngram_length=2, num_draft_tokens=4),
        ),
        calibrate=False,
        features=layers,
    )
    store = TrafficStore(tmp_path / "traffic", 1 << 30)
    recorder = TrafficRecorder(store, torch.float32)
    engine = SpeculativeEngine(loaded.engine.target, loaded.engine.proposer, loaded.engine.config, observer=recorder)
    assert engine.prefix is None  # a cached prompt block keeps no features: prompts are read whole
    engine.policy.adaptive = False  # draft every step: timed pass costs on a busy machine may advise plain steps
    prompts = [list(range(40, 60)) * 2, [7, 8, 9], [1, 2]]
    params = [
        GenerationParams(max_tokens=24, ignore_eos=True),  # n-gram drafts accepted: several positions a step
        GenerationParams(max_tokens=12, ignore_eos=True, sampling=SamplingParams(temperature=0.9, seed=1)),
        GenerationParams(max_tokens=3, ignore_eos=True),  # too short to teach anything: not kept
    ]
    seqs = [engine.new_sequence(p, q) for p, q in zip(prompts, params)]
    scheduler = Scheduler(engine, 2, prefill_chunk=8)  # prompts in chunks, beside another row's steps
    for seq in seqs:
        scheduler.add(seq)
    while scheduler.has_work():
        scheduler.step()
    assert engine.stats.num_accepted_tokens > 0
    while store.flush_one() is not None:
        pass
    answers = [read_answer(p) for p in sorted(store.folder.glob("*.safetensors"), key=traffic._number)]
    assert len(answers) == 2
    for answer, seq in zip(sorted(answers, key=lambda a: -len(a.tokens)), seqs[:2]):
        assert answer.tokens.tolist() == seq.tokens and answer.prompt_len == seq.prompt_len
        assert answer.features.shape[0] == len(seq.tokens) - 1  # position i's features predict token i + 1
        with torch.no_grad():
            _, expected = layer_outputs(loaded.target.model, torch.tensor([seq.tokens]), layers)
        torch.testing.assert_close(answer.features, expected[:-1], atol=1e-4, rtol=1e-4)
        assert answer.top is None  # served answers are labelled by their tokens: no logits are taken while serving


def test_an_answer_ends_at_its_stop_token_and_faulted_or_cancelled_ones_are_dropped(tmp_path):
    store = TrafficStore(tmp_path / "t", 1 << 30)
    recorder = TrafficRecorder(store, torch.float32)

    class Seq:
        def __init__(self, id, tokens, prompt_len, finish, fault=None):
            self.id, self.tokens, self.prompt_len = id, tokens, prompt_len
            self.finish_reason, self.fault = finish, fault
            self.answered = next((i + 1 for i in range(prompt_len, len(tokens)) if tokens[i] == 0), len(tokens))

    for seq in (
        Seq(1, list(range(1, 30)) + [0, 5, 6], 10, "stop"),  # drafts accepted past the stop token
        Seq(2, list(range(1, 30)), 10, "cancelled"),
        Seq(3, list(range(1, 30)), 10, "error", fault=object()),
    ):
        recorder.prefilled(seq, 0, torch.randn(seq.prompt_len, 6))
        recorder.accepted(seq, seq.prompt_len + 1, [], None, torch.randn(len(seq.tokens) - 1 - seq.prompt_len, 6))
        recorder.finished(seq)
    path = store.flush_one()
    assert store.flush_one() is None
    answer = read_answer(path)
    assert answer.tokens.tolist() == list(range(1, 30)) + [0]
    assert answer.features.shape == (29, 6)


def answer(n: int = 50, width: int = 1024, prompt: int = 0) -> Answer:
    tokens = torch.arange(n, dtype=torch.int32)
    tokens[0] = prompt  # the prompt's first token tells prompts apart
    return Answer(tokens, torch.zeros(n - 1, width, dtype=torch.bfloat16), 10)


HELD = [p for p in range(2000) if answer(prompt=p).held_out]
TRAINED = [p for p in range(2000) if not answer(prompt=p).held_out]


def test_the_store_is_private_holds_prompts_out_and_keeps_within_its_budget(tmp_path):
    one = len(answer().features.flatten()) * 2
    store = TrafficStore(tmp_path / "learning" / "traffic", budget=int(one * 10.5))
    for i in range(24):
        store.put(answer(prompt=HELD[i] if i in (15, 23) else TRAINED[i]))
    while store.flush_one() is not None:
        pass
    assert stat.S_IMODE(store.folder.stat().st_mode) == 0o700
    files = sorted(store.folder.iterdir())
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)
    assert len(files) == 10 and store.bytes <= store.budget  # the oldest went first
    assert store.counts()["dropped"] == 14
    assert [p.name for p in store.held_out_files()] == [f"held-{n}.safetensors" for n in (15, 23)]
    assert all(not read_answer(p).held_out for p in store.training_files())
    again = TrafficStore(store.folder, store.budget)  # a restart numbers on from the files there
    again.put(answer(prompt=TRAINED[0]))
    assert again.flush_one().name == "train-24.safetensors"


def test_every_answer_to_a_held_out_prompt_is_held_out(tmp_path):
    # a prompt asked again (a retry, a sampled answer, a shipped prompt a client also sends) answers as before: held
    # out by answer, a head was measured on answers it had trained on under other numbers
    assert 0.7 < len(HELD) / 2000 * HELD_OUT_EVERY < 1.3  # about one prompt in HELD_OUT_EVERY
    store = TrafficStore(tmp_path / "traffic", budget=1 << 30)
    for n in (30, 40, 50):  # three answers to each of two prompts, one of them held out
        store.put(answer(n, 8, prompt=HELD[0]))
        store.put(answer(n, 8, prompt=TRAINED[0]))
    while store.flush_one() is not None:
        pass
    assert len(store.held_out_files()) == 3 and len(store.training_files()) == 3
    assert {read_answer(p).tokens[0].item() for p in store.held_out_files()} == {HELD[0]}
    assert {read_answer(p).tokens[0].item() for p in store.training_files()} == {TRAINED[0]}


def test_answers_waiting_for_idle_time_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(traffic, "PENDING_BYTES", 3 * answer().nbytes)
    store = TrafficStore(tmp_path / "t", 1 << 30)
    for _ in range(5):
        store.put(answer())
    assert store.counts()["waiting"] == 3 and store.dropped == 2


@pytest.mark.parametrize("cut", [10, 0])
def test_a_file_cut_short_or_gone_reads_as_none(tmp_path, cut):
    store = TrafficStore(tmp_path / "t", 1 << 30)
    store.put(answer())
    path = store.flush_one()
    if cut:
        path.write_bytes(path.read_bytes()[:cut])
    else:
        path.unlink()
    assert read_answer(path) is None


def test_idle_answers_beyond_their_share_replace_the_oldest_idle_ones_and_never_traffic(tmp_path):
    one = answer().nbytes + 200  # an answer's file: its tensors and the header
    store = TrafficStore(tmp_path / "t", budget=20 * one, idle_share=0.5)  # about ten idle answers
    traffic_prompts = TRAINED[:5]
    for i in range(30):
        if i % 6 == 0:
            store.put(answer(prompt=traffic_prompts[i // 6]))  # a served answer now and then
        store.put(Answer(answer(prompt=TRAINED[100 + i]).tokens, answer().features, 10, idle=True))
    while store.flush_one() is not None:
        pass
    files = store.training_files() + store.held_out_files()
    idle = [p for p in files if p.stem.endswith("-idle")]
    served = [read_answer(p).tokens[0].item() for p in files if p not in idle]
    assert sorted(served) == sorted(traffic_prompts)  # every served answer kept
    assert 8 <= len(idle) <= 10 and store.idle_bytes <= 0.5 * store.budget
    kept = sorted(read_answer(p).tokens[0].item() for p in idle)
    assert kept == sorted(TRAINED[100 + 30 - len(idle) : 130])  # the newest idle answers
    again = TrafficStore(store.folder, store.budget, idle_share=0.5)  # a restart counts them again
    assert again.idle_bytes == store.idle_bytes and read_answer(idle[0]).idle
