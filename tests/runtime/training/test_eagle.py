"""Training a draft head: the objective learns, the speculators format round-trips, bad data is refused by name, and
``python -m depctl_runtime.training`` runs end to end on a tiny model, stops and resumes."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from depctl_runtime.model import eagle_format
from depctl_runtime.training.data import DataError, load_conversations
from depctl_runtime.training.eagle import (
    _loss,
    adamw,
    average_step,
    averaged,
    evaluate,
    noisy,
    trainable,
    window_loss,
)
from depctl_runtime.training.state import load_rows
from depctl_runtime.training.traffic import Top
from tests.pickles import plant
from tests.tiny import tiny_head

ROOT = Path(__file__).resolve().parents[3]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests need one")


def patterned_examples(n: int, length: int = 40) -> list[dict]:
    """Token sequences that follow a rule the head can learn (each token is the previous one plus a step that the
    features announce), with features that carry the step."""
    out = []
    gen = torch.Generator().manual_seed(0)
    for _ in range(n):
        step = int(torch.randint(1, 4, (1,), generator=gen))
        start = int(torch.randint(0, 10, (1,), generator=gen))
        tokens = torch.tensor([(start + i * step) % 40 for i in range(length)])
        features = torch.randn(length, 96, generator=gen) * 0.1
        features[:, step] += 3.0
        # the "target" is sure of each next token: it leads the distribution kept from the prompt's last position on
        start = 4
        top_ids = torch.randint(0, 40, (length - start, 4), generator=gen)
        top_ids[:, 0] = tokens[start:]
        top_logp = torch.tensor([0.0, -20.0, -20.0, -20.0]).expand(length - start, 4)
        out.append({"tokens": tokens, "features": features, "start": start, "top_ids": top_ids, "top_logp": top_logp})
    return out


def test_training_lowers_the_loss_and_raises_acceptance():
    head = tiny_head(vocab=50, draft_vocab=40)
    head.set_vocabulary(torch.arange(40))
    head.train()
    train, heldout = patterned_examples(24), patterned_examples(4)

    def mean_loss(example):
        loss, counted = _loss(head, example, 3)
        return loss / counted

    with torch.no_grad():
        before_loss = sum(float(mean_loss(e)) for e in heldout)
    before = evaluate(head, heldout, 3)
    params = [p for n, p in head.named_parameters() if not n.startswith("embed_tokens")]
    optimizer = torch.optim.Adam(params, lr=3e-3)
    for epoch in range(6):
        for example in train:
            loss = mean_loss(example)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    with torch.no_grad():
        after_loss = sum(float(mean_loss(e)) for e in heldout)
    after = evaluate(head, heldout, 3)
    assert after_loss < 0.5 * before_loss, (before_loss, after_loss)
    assert after["mean_accepted"] > before["mean_accepted"] + 0.5, (before, after)
    assert after["acceptance"] == sorted(after["acceptance"], reverse=True)  # a later step needs every earlier one


@pytest.mark.parametrize("freeze_output", [False, True])
def test_a_frozen_output_layer_and_norm_stay_the_targets_while_the_rest_trains(freeze_output):
    head = tiny_head(vocab=50, draft_vocab=40)
    head.set_vocabulary(torch.arange(40))
    head.train()
    before = {n: p.detach().clone() for n, p in head.named_parameters()}
    optimizer = torch.optim.Adam(trainable(head, freeze_output), lr=1e-2)
    for example in patterned_examples(4):
        loss, counted = _loss(head, example, 2)
        optimizer.zero_grad()
        (loss / counted).backward()
        optimizer.step()
    moved = {n for n, p in head.named_parameters() if not torch.equal(p, before[n])}
    kept = {"embed_tokens.weight"} | ({"lm_head.weight", "norm.weight"} if freeze_output else set())
    assert moved == set(before) - kept


def test_the_running_average_follows_the_weights_with_a_short_memory_at_first():
    head = tiny_head(vocab=50, draft_vocab=40)
    average = averaged(head)
    assert average.embed_tokens is head.embed_tokens and not any(p.requires_grad for p in average.parameters())
    kept, weight = average.fc.weight, head.fc.weight
    start = kept.detach().clone()
    with torch.no_grad():
        weight.add_(1.0)
    average_step([(kept, weight)], 0.998, steps=1)  # the first step: decay (1 + 1) / (10 + 1)
    assert torch.allclose(kept, start + 9 / 11, atol=1e-5)
    later = kept.detach().clone()
    with torch.no_grad():
        weight.add_(1.0)
    average_step([(kept, weight)], 0.998, steps=10_000)  # (weight is later + 2 - 9/11) now: 0.2% of the way there
    assert torch.allclose(kept, later + 0.002 * (2 - 9 / 11), atol=1e-5)


def test_feature_noise_is_sized_by_each_layers_states_and_reaches_the_loss():
    gen = torch.Generator().manual_seed(0)
    sizes = torch.tensor([1.0, 100.0, 0.01])  # the aux layers' states differ by orders of magnitude
    features = (torch.randn(4000, 3, 32, generator=gen) * sizes[:, None]).flatten(-2)
    torch.manual_seed(0)
    added = (noisy(features, 0.1, 3) - features).unflatten(-1, (3, 32))
    spread = added.pow(2).mean((0, 2)).sqrt()
    torch.testing.assert_close(spread, 0.1 * sizes, rtol=0.05, atol=0)
    head = tiny_head(vocab=50, draft_vocab=40)
    head.set_vocabulary(torch.arange(40))
    example = patterned_examples(1)[0]
    plain, _ = _loss(head, example, 2)
    assert torch.equal(plain, _loss(head, example, 2)[0])  # no noise asked: none added
    assert not torch.equal(plain, _loss(head, example, 2, noise=0.1)[0])


def test_weight_decay_shrinks_weights_a_step_whatever_their_gradient():
    weight = torch.nn.Parameter(torch.ones(4))
    weight.grad = torch.zeros(4)
    adamw([weight], lr=0.1, weight_decay=0.5).step()  # decoupled: each weight times 1 - lr * decay
    torch.testing.assert_close(weight.detach(), torch.full((4,), 0.95))
    still = torch.nn.Parameter(torch.ones(4))
    still.grad = torch.zeros(4)
    adamw([still], lr=0.1).step()  # none by default
    assert torch.equal(still.detach(), torch.ones(4))


def test_an_answer_padded_to_a_bucket_counts_no_padding():
    """Padding (bf16 on a CPU) computes rows past the answer's end and counts none of them; starting at a multiple of
    the bucket also trains the chained steps of the prompt's last indices whose drafts land in the answer."""
    head = tiny_head(vocab=50, draft_vocab=40)
    head.set_vocabulary(torch.arange(40))
    for example in patterned_examples(3, length=37):
        example["start"] = 21  # the answer's first index is not a multiple of the bucket
        example["top_ids"], example["top_logp"] = example["top_ids"][17:], example["top_logp"][17:]
        top = Top(example["top_ids"], example["top_logp"], 20)
        _, counted = _loss(head, example, 3)
        for bucket in (8, 32):
            padded, counted_padded = _loss(head, example, 3, bucket)
            assert counted_padded == counted  # the first drafts counted: the answer's
            first = 19 // bucket * bucket
            unpadded, _ = window_loss(head, example["tokens"], example["features"], first, 3, 21, top=top)
            torch.testing.assert_close(padded, unpadded)


def test_prompt_positions_are_labelled_by_the_prompts_own_tokens_from_where_asked():
    """With ``labelled_from`` the prompt's tokens from there on count too, hard-labelled (the target's distribution is
    kept from the prompt's last position only); the answer's positions are labelled as before."""
    head = tiny_head(vocab=50, draft_vocab=40)
    head.set_vocabulary(torch.arange(40))
    example = patterned_examples(1, length=37)[0]
    example["start"] = 21
    example["top_ids"], example["top_logp"] = example["top_ids"][17:], example["top_logp"][17:]
    top = Top(example["top_ids"], example["top_logp"], 20)
    answer_loss, answer_rows = _loss(head, example, 3)
    loss, rows = _loss(head, example, 3, labelled_from=6)
    assert rows == answer_rows + (21 - 6)  # step 0's rows: one a labelled token
    expected, _ = window_loss(head, example["tokens"], example["features"], 4, 3, 6, top=top)
    torch.testing.assert_close(loss, expected)
    assert float(loss) > float(answer_loss)


def test_a_head_round_trips_through_the_speculators_format(tmp_path):
    head = tiny_head()
    verifier = {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"], "fingerprint": "abc"}
    eagle_format.save(head, tmp_path, verifier, speculative_tokens=4)
    config = json.loads((tmp_path / "config.json").read_text())
    # what vLLM's speculators loader reads
    assert config["speculators_model_type"] == "eagle3"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert config["speculators_config"]["verifier"]["name_or_path"] == "tiny"
    assert config["transformer_layer_config"]["hidden_size"] == 32 and config["draft_vocab_size"] == 20
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert eagle_format.is_head(tmp_path)
    loaded, _ = eagle_format.load(tmp_path, head.embed_tokens.weight.detach().clone())
    tokens, features = torch.randint(0, 50, (10,)), torch.randn(10, 96)
    for a, b in zip(head.ttt_logits(tokens, features, 3), loaded.ttt_logits(tokens, features, 3)):
        torch.testing.assert_close(a, b)
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
    with pytest.raises(eagle_format.HeadError, match="expects embeddings of 50 x 32"):
        eagle_format.load(tmp_path, torch.zeros(60, 32))


@pytest.mark.parametrize(
    "lines, message",
    [
        (["not json"], "line 1: not JSON"),
        (['{"prompt": "ok"}', '{"text": "what"}'], "line 2: expected"),
        (['{"messages": [{"role": "assistant", "content": "hi"}]}'], "no user turn"),
        (['{"messages": [{"role": "robot", "content": "hi"}]}'], "each message needs a role"),
        ([], "no examples"),
    ],
)
def test_a_data_file_that_cannot_be_trained_on_is_refused_by_line(tmp_path, lines, message):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines))
    with pytest.raises(DataError, match=message):
        load_conversations(path)


def test_conversations_end_at_the_last_user_turn_and_the_shipped_set_loads(tmp_path):
    path = tmp_path / "conversation.jsonl"
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "the answer the target will regenerate"},
    ]
    path.write_text(json.dumps({"messages": messages}) + "\n")
    assert load_conversations(path) == [messages[:3]]
    shipped = load_conversations(None)
    assert len(shipped) >= 200 and all(c[-1]["role"] == "user" for c in shipped)


def _train(model: Path, out: Path, data: Path, *extra: str) -> tuple[int, list[dict]]:
    run = subprocess.run(
        [sys.executable, "-m", "depctl_runtime.training", str(model), "--out", str(out), "--data", str(data)]
        + ["--max-tokens", "24", "--batch", "4", "--draft-vocab", "64", "--steps", "3", "--no-compile", *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    return run.returncode, events


@pytest.mark.slow
def test_train_runs_end_to_end_then_resumes(tiny_model_dir, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"question {i}: what comes next?"}) + "\n" for i in range(12)))
    out = tmp_path / "head"
    code, events = _train(tiny_model_dir, out, data, "--minutes", "0.4", "--samples", "3")
    assert code == 0, events
    kinds = [e["event"] for e in events]
    assert "answers" in kinds and kinds[-1] == "done"
    shards = [row for shard in sorted((out / ".train").glob("answers-*.safetensors")) for row in load_rows(shard)]
    # a greedy and two sampled answers a prompt, each with the features it was read with; the held-out prompt (a
    # tenth of 12) only its greedy one, the answer acceptance is measured on; then requests the target wrote
    given = [row for row in shards if row["index"] < 12]
    assert len(given) == 12 + 11 * 2
    assert sorted(Counter(row["index"] for row in given).values()) == [1] + [3] * 11
    assert all(row["features"].shape == (len(row["tokens"]) - 1, 3 * 64) for row in shards)
    assert all(row["top_ids"].shape == (len(row["tokens"]) - row["start"], 16) for row in shards)
    done = events[-1]
    assert len(done["acceptance"]) == 3 and done["mean_accepted"] >= 1.0
    assert eagle_format.is_head(out) and (out / "model.safetensors").exists()
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(tiny_model_dir)
    assert config["depctl"]["history"]
    assert config["depctl"]["train_steps"] == 2  # two chained steps trained by default, measured at --steps 3
    # the same command again: nothing is regenerated, and the budget is already spent; pickles planted where older
    # versions kept the state are never read (one of them ran a shell command when it was)
    marker = tmp_path / "ran"
    plant(out / ".train" / "state.pt", marker)
    plant(out / ".train" / "answers-99.pt", marker)
    code, events = _train(tiny_model_dir, out, data, "--minutes", "0.4", "--samples", "3")
    assert code == 0 and "answers" not in [e["event"] for e in events]
    assert any(e["event"] == "resumed" for e in events)
    assert not marker.exists()


@pytest.mark.slow
def test_with_a_running_average_the_average_is_measured_saved_and_resumed(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    from depctl_runtime.training.state import load_state

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"question {i}: what comes next?"}) + "\n" for i in range(12)))
    out = tmp_path / "head"
    code, events = _train(tiny_model_dir, out, data, "--minutes", "0.3", "--samples", "2", "--average", "0.9")
    assert code == 0, events
    tensors, _, info = load_state(out / ".train", "cpu")
    assert info["optimizer_steps"] > 0
    served = load_file(str(out / "model.safetensors"))
    for name in ("fc.weight", "midlayer.mlp.down_proj.weight", "lm_head.weight"):
        assert torch.equal(served[name], tensors[f"average.{name}"])  # the head written is the average
        assert not torch.equal(tensors[name], tensors[f"average.{name}"])  # which is not the weights as trained
    code, events = _train(tiny_model_dir, out, data, "--minutes", "0.4", "--samples", "2", "--average", "0.9")
    assert code == 0 and any(e["event"] == "resumed" for e in events)
    resumed, _, again = load_state(out / ".train", "cpu")
    assert again["optimizer_steps"] > info["optimizer_steps"]
    assert not torch.equal(resumed["average.fc.weight"], tensors["average.fc.weight"])


@pytest.mark.slow
def test_ctrl_c_before_any_training_step_says_so_without_a_traceback(tiny_model_dir, tmp_path):
    """SIGINT while the target is still answering: the answers so far are kept, the trainer says nothing was trained
    and exits 130, and its log holds no KeyboardInterrupt traceback."""
    import signal

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"question {i}: what comes next?"}) + "\n" for i in range(12)))
    out = tmp_path / "head"
    command = [sys.executable, "-m", "depctl_runtime.training", str(tiny_model_dir), "--out", str(out)]
    command += ["--data", str(data), "--max-tokens", "3000", "--batch", "2", "--no-compile", "--minutes", "5"]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    events = []
    for line in proc.stdout:
        events.append(json.loads(line))
        if events[-1]["event"] == "answers":  # answering: no training step has run
            proc.send_signal(signal.SIGINT)
            break
    rest, log = proc.communicate(timeout=120)
    events += [json.loads(line) for line in rest.splitlines() if line.startswith("{")]
    assert proc.returncode == 130, log[-2000:]
    assert events[-1] == {"event": "stopped", "trained": False}
    assert "Traceback" not in log and "KeyboardInterrupt" not in log
    assert not (out / "model.safetensors").exists()
    assert list((out / ".train").glob("answers-*.safetensors")), "the answers finished before Ctrl-C are kept"


@pytest.mark.slow
def test_train_refuses_a_target_without_a_chat_template(tmp_path):
    from tests.tiny import save_tiny

    model = save_tiny(tmp_path / "no-template", seed=0, chat_template=None)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(12)))
    code, events = _train(model, tmp_path / "head", data, "--minutes", "0.2")
    assert code == 2 and events[-1]["event"] == "error" and "no chat template" in events[-1]["message"], events


@pytest.mark.gpu
@cuda
def test_train_runs_on_a_gpu(tiny_model_dir, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(12)))
    code, events = _train(tiny_model_dir, tmp_path / "head", data, "--minutes", "0.3", "--device", "cuda")
    assert code == 0 and events[-1]["event"] == "done", events


def test_a_load_slower_than_the_answering_budget_still_answers_enough_to_train_on(tiny_model_dir, tmp_path):
    """The budget cuts answers once enough are done or under way, never all of them: on a busy machine loading the
    target alone can take longer than a short ``--minutes`` gives answering."""
    import time

    from transformers import AutoTokenizer

    from depctl_runtime.training.eagle import MIN_EXAMPLES, TrainOptions, _answers

    conversations = [[{"role": "user", "content": f"question {i}"}] for i in range(12)]
    opts = TrainOptions(target=str(tiny_model_dir), out=tmp_path, max_tokens=8, compile=False, device="cpu")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    # the budget was spent before the first answer starts (started an hour ago, a minute's limit)
    examples = _answers(opts, tokenizer, conversations, (0, 1, 1), tmp_path, time.monotonic() - 3600, 60.0, set())
    assert MIN_EXAMPLES <= len(examples) < 12 * opts.samples


@pytest.mark.parametrize("written", [True, False])
def test_time_left_after_the_given_prompts_answers_requests_the_target_writes(tiny_model_dir, tmp_path, written):
    """Once every given prompt's answers are under way, the answering share's time left goes to requests the target
    writes in its template's user turn, each answered greedily; they are never held out, and ``--no-written`` stops
    them."""
    import time

    from transformers import AutoTokenizer

    from depctl_runtime.training.answers import user_turn
    from depctl_runtime.training.eagle import TrainOptions, _answers

    conversations = [[{"role": "user", "content": f"question {i}"}] for i in range(12)]
    opts = TrainOptions(
        target=str(tiny_model_dir), out=tmp_path, max_tokens=8, samples=2, compile=False, device="cpu", written=written
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    opening, closing = user_turn(tokenizer, lambda text: tokenizer(text, add_special_tokens=False)["input_ids"])
    examples = _answers(opts, tokenizer, conversations, (0, 1, 1), tmp_path, time.monotonic(), 4.0, {0})
    given = [e for e in examples if e["index"] < 12]
    assert sorted(Counter(e["index"] for e in given).values()) == [1] + [2] * 11  # held-out prompt 0: greedy only
    own = [e for e in examples if e["index"] >= 12]
    assert bool(own) == written
    assert len({e["index"] for e in own}) == len(own) and all(e["sample"] == 0 for e in own)
    for e in own:
        prompt = e["tokens"][: e["start"]].tolist()
        assert prompt[: len(opening)] == opening and prompt[-len(closing) :] == closing
        assert len(prompt) - len(opening) - len(closing) >= 8  # a request with text in it
        assert e["features"].shape[0] == len(e["tokens"]) - 1
