"""``depctl draft train``: the command starts the trainer, draws its progress and reports the head it wrote."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from depctl import recordings
from depctl.cli import app
from depctl.spec import DeploymentSpec
from depctl.store import SpecStore

pytestmark = pytest.mark.slow  # draft training runs in processes of their own


def run(*args: str):
    return CliRunner().invoke(app, list(args))


def test_a_missing_data_file_is_refused_before_anything_runs(tmp_path):
    result = run("draft", "train", "smollm2-135m-instruct", "--out", str(tmp_path / "h"), "--data", "nope.jsonl")
    assert result.exit_code == 2 and "--data nope.jsonl: no such file" in result.output
    assert not (tmp_path / "h").exists()


def test_train_writes_a_head_and_says_how_to_serve_it(tiny_model_dir, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"tell me about {i}"}) + "\n" for i in range(12)))
    out = tmp_path / "head"
    args = ["draft", "train", str(tiny_model_dir), "--out", str(out), "--data", str(data), "--minutes", "0.25"]
    result = run(*args, "--max-tokens", "16", "--draft-vocab", "64", "--steps", "2", "--no-compile")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert f"Trained {out}" in text and "mean accepted length" in text
    assert f"depctl deployment create {tiny_model_dir} --draft-model {out} --draft-token-count 2" in text
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()


def test_no_written_requests_answers_the_given_prompts_only(tiny_model_dir, tmp_path):
    from depctl_runtime.training.state import load_rows

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"tell me about {i}"}) + "\n" for i in range(12)))
    out = tmp_path / "head"
    args = ["draft", "train", str(tiny_model_dir), "--out", str(out), "--data", str(data), "--minutes", "0.25"]
    result = run(*args, "--max-tokens", "8", "--samples", "1", "--no-written-requests", "--no-compile")
    assert result.exit_code == 0, result.output
    rows = [row for shard in (out / ".train").glob("answers-*.safetensors") for row in load_rows(shard)]
    assert sorted(row["index"] for row in rows) == list(range(12))


def test_more_train_steps_than_steps_is_refused_before_anything_runs(tmp_path):
    out = tmp_path / "h"
    result = run("draft", "train", "smollm2-135m-instruct", "--out", str(out), "--steps", "2", "--train-steps", "3")
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "--train-steps 3 is more than --steps 2" in text, result.output
    assert "give --train-steps 2 or fewer" in text and not out.exists()


def test_a_trainer_error_is_shown_as_the_commands_error(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "only one"}\n')
    result = run("draft", "train", "smollm2-135m-instruct", "--out", str(tmp_path / "h"), "--data", str(data))
    assert result.exit_code == 2 and "too few to hold some out" in " ".join(result.output.split()), result.output


def test_from_deployment_trains_on_what_it_recorded_and_says_what_is_missing(depctl_home, tiny_model_dir, tmp_path):
    store = SpecStore()
    store.create(DeploymentSpec(id="served", model=str(tiny_model_dir)))
    out = tmp_path / "head"
    args = ["draft", "train", str(tiny_model_dir), "--out", str(out), "--from-deployment", "served"]
    result = run(*args)
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "does not record prompts" in text and "depctl deployment update served --record-prompts" in text
    result = run("draft", "train", "smollm2-135m-instruct", "--out", str(out), "--from-deployment", "served")
    assert result.exit_code == 2 and "serves" in result.output and "not smollm2-135m-instruct" in result.output
    for i in range(12):
        recordings.record("served", {"messages": [{"role": "user", "content": f"tell me about {i}"}]})
    fast = ["--minutes", "0.25", "--max-tokens", "16", "--draft-vocab", "64", "--steps", "2", "--no-compile"]
    result = run(*args, *fast)
    assert result.exit_code == 0, result.output
    assert f"Trained {out}" in " ".join(result.output.split())
    assert json.loads((out / "config.json").read_text())["depctl"]["target_quantization"] == "none"


def test_the_target_answers_at_the_recorded_deployments_quantization(depctl_home, tiny_model_dir, tmp_path):
    """A head reads the features of the target as it serves: an int4 deployment's head is trained on int4 answers."""
    SpecStore().create(DeploymentSpec(id="q", model=str(tiny_model_dir), device="cpu", quantization="int4"))
    for i in range(12):
        recordings.record("q", {"messages": [{"role": "user", "content": f"tell me about {i}"}]})
    out = tmp_path / "head"
    fast = ["--minutes", "0.25", "--max-tokens", "16", "--draft-vocab", "64", "--steps", "2", "--no-compile"]
    result = run("draft", "train", str(tiny_model_dir), "--out", str(out), "--from-deployment", "q", *fast)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["depctl"]["target_quantization"] == "int4"


def test_a_bad_quantization_is_refused_naming_the_choices(tmp_path):
    result = run("draft", "train", "smollm2-135m-instruct", "--out", str(tmp_path / "h"), "--quantization", "int3")
    assert result.exit_code == 2 and "--quantization 'int3' is not one of none, int8, int4" in result.output
    result = run(
        "draft",
        "train",
        "smollm2-135m-instruct",
        "--out",
        str(tmp_path / "h"),
        "--quantization",
        "int4",
        "--device",
        "cuda",
    )
    assert result.exit_code == 2 and "no CUDA kernel" in " ".join(result.output.split())
    assert not (tmp_path / "h").exists()


def test_out_is_checked_before_anything_is_written(tiny_model_dir, tmp_path):
    # the bugs: pointed at a model directory, training replaced its config.json and model.safetensors; with a bad
    # --data it created OUT/.train/train.log before refusing; a file as --out was an "unexpected NotADirectoryError"
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    before = {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()}
    result = run("draft", "train", str(tiny_model_dir), "--out", str(model))
    assert result.exit_code == 2 and "holds no draft head" in " ".join(result.output.split()), result.output
    assert {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()} == before
    assert not (model / ".train").exists()

    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    result = run("draft", "train", str(tiny_model_dir), "--out", str(tmp_path / "new"), "--data", str(bad))
    assert result.exit_code == 2 and f"--data {bad}" in " ".join(result.output.split()), result.output
    assert not (tmp_path / "new").exists()

    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    result = run("draft", "train", str(tiny_model_dir), "--out", str(a_file))
    assert result.exit_code == 2 and "is a file" in result.output

    result = run("draft", "train", str(tiny_model_dir), "--out", "/proc")
    assert result.exit_code == 2 and "holds no draft head" in " ".join(result.output.split())


def test_out_holding_a_head_of_another_target_is_refused_naming_both(tmp_path):
    out = tmp_path / "head"
    out.mkdir()
    config = {"speculators_model_type": "eagle3", "speculators_config": {"verifier": {"name_or_path": "other-model"}}}
    (out / "config.json").write_text(json.dumps(config))
    result = run("draft", "train", "smollm2-135m-instruct", "--out", str(out))
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "'other-model'" in text and "'smollm2-135m-instruct'" in text, text


def test_ctrl_c_says_whether_anything_was_trained(tmp_path):
    from depctl.cli.draft import _Run

    run = _Run()
    run.hear('{"event": "stage", "name": "compiling: the decode and verify passes"}')
    assert run.stopped_message(tmp_path).startswith("Stopped before any training step: nothing was trained.")
    run.hear('{"event": "answers", "done": 40, "total": 600, "tokens": 9000}')
    assert "the 40 answers generated so far are kept" in run.stopped_message(tmp_path)
    run.hear('{"event": "answers", "done": 600, "total": 600, "written": 25, "tokens": 99000}')
    assert "the 625 answers generated so far are kept" in run.stopped_message(tmp_path)  # written requests' too
    run.hear('{"event": "progress", "minutes": 0.4, "total_minutes": 2.0, "loss": 5.1}')
    assert run.stopped_message(tmp_path).startswith("Stopped after 0.4 min of training")
    run.hear('{"event": "train", "minutes": 1.5, "total_minutes": 2.0, "acceptance": [0.1], "mean_accepted": 1.1}')
    assert run.stopped_message(tmp_path) == (
        f"Stopped after 1.5 min of training; the head so far is in {tmp_path}. Run the same command to resume."
    )
