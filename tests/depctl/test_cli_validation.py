"""The flag rules of `depctl deployment create/update`, through Typer's CliRunner. Valid combinations use
--validate-only, and every invalid one must write nothing; one test (slow) starts a daemon to round-trip engine flags
through create, update and get."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from depctl.cli import app
from depctl.spec import DeploymentSpec, NgramSpeculation
from depctl.store import SpecStore

runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, list(args))


def spec_files(home) -> list:
    d = home / "deployments"
    return sorted(p.name for p in d.glob("*.yaml")) if d.exists() else []


@pytest.mark.parametrize(
    "flags, needle, model",
    [
        # both methods at once
        (
            ["--draft-model", "smollm2-135m-instruct", "--ngram-speculation-length", "3", "--draft-token-count", "4"],
            "--draft-model and --ngram-speculation-length cannot be used together",
            "smollm2-135m-instruct",
        ),
        # a count without a method
        (
            ["--draft-token-count", "4"],
            "--draft-token-count needs --draft-model, --ngram-speculation-length or --suffix-speculation",
            "smollm2-135m-instruct",
        ),
        # bounds and types: one line naming the flag, no traceback
        (
            ["--ngram-speculation-length", "3", "--draft-token-count", "0"],
            "--draft-token-count",
            "smollm2-135m-instruct",
        ),
        (
            ["--ngram-speculation-length", "3", "--draft-token-count", "-2"],
            "--draft-token-count",
            "smollm2-135m-instruct",
        ),
        (
            ["--ngram-speculation-length", "3", "--draft-token-count", "33"],
            "--draft-token-count",
            "smollm2-135m-instruct",
        ),
        (
            ["--ngram-speculation-length", "3", "--draft-token-count", "99999999999999999999"],
            "--draft-token-count",
            "smollm2-135m-instruct",
        ),
        (
            ["--ngram-speculation-length", "3", "--draft-token-count", "four"],
            "--draft-token-count",
            "smollm2-135m-instruct",
        ),
        (
            ["--ngram-speculation-length", "3", "--draft-token-count", "2.5"],
            "--draft-token-count",
            "smollm2-135m-instruct",
        ),
        (
            ["--ngram-speculation-length", "0", "--draft-token-count", "4"],
            "--ngram-speculation-length",
            "smollm2-135m-instruct",
        ),
        (
            ["--ngram-speculation-length", "17", "--draft-token-count", "4"],
            "--ngram-speculation-length",
            "smollm2-135m-instruct",
        ),
        # a draft model that does not resolve
        (
            ["--draft-model", "/nowhere/model", "--draft-token-count", "4"],
            "--draft-model '/nowhere/model' was not found",
            "smollm2-135m-instruct",
        ),
        # packaged models with different tokenizers: refused, with a suggestion
        (
            ["--draft-model", "smollm2-135m-instruct", "--draft-token-count", "4"],
            "must share a tokenizer",
            "qwen2.5-coder-1.5b-instruct",
        ),
        # the draft's precision belongs to a draft model
        (["--draft-precision", "int8"], "--draft-precision needs --draft-model", "smollm2-135m-instruct"),
        (
            ["--ngram-speculation-length", "3", "--draft-token-count", "4", "--draft-precision", "int8"],
            "--draft-precision applies to a draft model and cannot be used with --ngram-speculation-length",
            "smollm2-135m-instruct",
        ),
        (
            ["--draft-model", "qwen2.5-coder-0.5b-instruct", "--draft-token-count", "4", "--draft-precision", "int2"],
            "--draft-precision",
            "qwen2.5-coder-1.5b-instruct",
        ),
        # the batch size: bounded like the other flags
        (["--max-batch-size", "0"], "--max-batch-size", "smollm2-135m-instruct"),
        (["--max-batch-size", "257"], "--max-batch-size", "smollm2-135m-instruct"),
        (["--max-batch-size", "eight"], "--max-batch-size", "smollm2-135m-instruct"),
        # quantized weights are CPU kernels with float32 or bf16 activations
        (
            ["--quantization", "int4", "--dtype", "float16"],
            "--quantization int4 computes with float32 or bfloat16 activations, not float16",
            "smollm2-135m-instruct",
        ),
        (
            ["--quantization", "int8", "--device", "cuda"],
            "--quantization int8 is a CPU kernel and has no CUDA kernel",
            "smollm2-135m-instruct",
        ),
        (["--quantization", "int3"], "--quantization", "smollm2-135m-instruct"),
        # what depctl's engine cannot do, and what vLLM would refuse
        (["--tensor-parallel-size", "2"], "--tensor-parallel-size needs --engine vllm", "smollm2-135m-instruct"),
        (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size needs --engine vllm", "smollm2-135m-instruct"),
        (["--ray-address", "auto"], "--ray-address needs --engine vllm", "smollm2-135m-instruct"),
        (["--engine", "vllm", "--quantization", "int8"], "vLLM has no equivalent", "smollm2-135m-instruct"),
        (
            [
                "--engine",
                "vllm",
                "--draft-model",
                "qwen2.5-coder-0.5b-instruct",
                "--draft-token-count",
                "4",
                "--draft-precision",
                "int8",
            ],
            "vLLM holds the draft in the target's dtype",
            "qwen2.5-coder-1.5b-instruct",
        ),
        (["--engine", "sglang"], "--engine", "smollm2-135m-instruct"),
        (["--engine", "vllm", "--tensor-parallel-size", "0"], "--tensor-parallel-size", "smollm2-135m-instruct"),
        (["--max-context-length", "8"], "--max-context-length", "smollm2-135m-instruct"),
        # suffix speculation: one method among three, with a count, a bounded index, on depctl's engine
        (
            ["--suffix-speculation", "--ngram-speculation-length", "3", "--draft-token-count", "4"],
            "--ngram-speculation-length and --suffix-speculation cannot be used together",
            "smollm2-135m-instruct",
        ),
        (
            ["--suffix-speculation", "--draft-model", "smollm2-135m-instruct", "--draft-token-count", "4"],
            "--draft-model and --suffix-speculation cannot be used together",
            "smollm2-135m-instruct",
        ),
        (["--suffix-speculation", "--draft-token-count", "33"], "--draft-token-count", "smollm2-135m-instruct"),
        (
            ["--suffix-cache-tokens", "4096"],
            "--suffix-cache-tokens needs --suffix-speculation",
            "smollm2-135m-instruct",
        ),
        (
            ["--suffix-speculation", "--draft-token-count", "8", "--suffix-cache-tokens", "10"],
            "--suffix-cache-tokens",
            "smollm2-135m-instruct",
        ),
        (
            ["--suffix-scope", "deployment"],
            "--suffix-scope needs --suffix-speculation",
            "smollm2-135m-instruct",
        ),
        (["--suffix-speculation", "--suffix-scope", "everyone"], "--suffix-scope", "smollm2-135m-instruct"),
        (
            ["--suffix-speculation", "--draft-token-count", "8", "--draft-precision", "int8"],
            "--draft-precision applies to a draft model and cannot be used with --suffix-speculation",
            "smollm2-135m-instruct",
        ),
        (
            ["--suffix-speculation", "--draft-token-count", "8", "--engine", "vllm"],
            "--suffix-speculation runs on depctl's engine",
            "smollm2-135m-instruct",
        ),
    ],
)
def test_create_rejects_bad_flags_and_writes_nothing(flags, needle, model, depctl_home):
    result = run("deployment", "create", model, *flags)
    assert result.exit_code != 0
    assert needle in " ".join(result.stderr.split()), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert spec_files(depctl_home) == []


def test_mismatched_packaged_draft_suggests_the_family_draft(depctl_home):
    result = run(
        "deployment",
        "create",
        "qwen2.5-coder-1.5b-instruct",
        "--draft-model",
        "smollm2-135m-instruct",
        "--draft-token-count",
        "4",
    )
    assert result.exit_code == 2
    assert "--draft-model=qwen2.5-coder-0.5b-instruct" in result.stderr


def fake_head(path, verifier: str):
    """A head's config as ``depctl draft train`` writes it: all the CLI reads (the daemon reads the weights)."""
    path.mkdir()
    config = {"speculators_model_type": "eagle3", "speculators_config": {"verifier": {"name_or_path": verifier}}}
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_an_eagle_head_trained_for_another_model_is_refused_naming_both(depctl_home, tmp_path):
    head = fake_head(tmp_path / "head", "smollm2-135m-instruct")
    flags = ["--draft-model", head, "--draft-token-count", "4"]
    result = run("deployment", "create", "qwen2.5-coder-1.5b-instruct", *flags)
    assert result.exit_code == 2
    err = " ".join(result.stderr.split())
    assert "an EAGLE head trained for smollm2-135m-instruct, not for qwen2.5-coder-1.5b-instruct" in err
    assert "depctl draft train qwen2.5-coder-1.5b-instruct --out DIR" in err
    assert spec_files(depctl_home) == []
    # its own target takes it (a draft model of the same family would be refused as the target itself)
    result = run("deployment", "create", "smollm2-135m-instruct", *flags, "--validate-only")
    assert result.exit_code == 0, result.stderr


def test_unknown_model_says_what_was_tried(depctl_home):
    result = run("deployment", "create", "no-such-model", "--validate-only")
    assert result.exit_code == 2
    err = " ".join(result.stderr.split())
    assert "not a local directory or .gguf file" in err and "not a packaged alias" in err and "hub id" in err


@pytest.mark.parametrize(
    "flags, speculation",
    [
        ([], {"method": "none"}),
        (
            ["--ngram-speculation-length", "3", "--draft-token-count", "4"],
            {"method": "ngram", "ngram_length": 3, "num_draft_tokens": 4},
        ),
        (
            ["--draft-model", "qwen2.5-coder-0.5b-instruct", "--draft-token-count", "32"],
            {
                "method": "draft_model",
                "draft_model": "qwen2.5-coder-0.5b-instruct",
                "num_draft_tokens": 32,
                "draft_precision": "auto",
            },
        ),
        (
            [
                "--draft-model",
                "qwen2.5-coder-0.5b-instruct",
                "--draft-token-count",
                "4",
                "--draft-precision",
                "float32",
            ],
            {
                "method": "draft_model",
                "draft_model": "qwen2.5-coder-0.5b-instruct",
                "num_draft_tokens": 4,
                "draft_precision": "float32",
            },
        ),
        (
            ["--suffix-speculation", "--draft-token-count", "16"],
            {"method": "suffix", "num_draft_tokens": 16, "cache_tokens": 262144, "scope": "user"},
        ),
        (
            ["--suffix-speculation", "--draft-token-count", "8", "--suffix-cache-tokens", "65536"],
            {"method": "suffix", "num_draft_tokens": 8, "cache_tokens": 65536, "scope": "user"},
        ),
        (
            ["--suffix-speculation", "--suffix-scope", "deployment"],
            {"method": "suffix", "num_draft_tokens": 8, "cache_tokens": 262144, "scope": "deployment"},
        ),
    ],
)
def test_validate_only_prints_the_spec_and_writes_nothing(flags, speculation, depctl_home):
    model = "qwen2.5-coder-1.5b-instruct" if "--draft-model" in flags else "smollm2-135m-instruct"
    result = run("deployment", "create", model, "--deployment-id", "my-dep", "--validate-only", *flags)
    assert result.exit_code == 0, result.stderr
    spec = yaml.safe_load(result.stdout)
    assert spec["id"] == "my-dep" and spec["model"] == model
    assert spec["speculation"] == speculation
    assert spec_files(depctl_home) == []


def test_validate_only_refuses_an_id_that_exists_as_the_create_would(depctl_home):
    from depctl.spec import DeploymentSpec
    from depctl.store import SpecStore

    SpecStore().create(DeploymentSpec(id="taken", model="smollm2-135m-instruct"))
    before = (depctl_home / "deployments" / "taken.yaml").read_bytes()
    result = run("deployment", "create", "smollm2-135m-instruct", "--deployment-id", "taken", "--validate-only")
    assert result.exit_code != 0 and "already exists" in result.stderr and "Valid" not in result.stderr
    assert (depctl_home / "deployments" / "taken.yaml").read_bytes() == before


def test_an_update_says_what_changed_in_the_flags_words():
    from depctl.cli.deployment import _changes
    from depctl.spec import DeploymentSpec

    old = DeploymentSpec(id="d", model="m")
    assert _changes(old, old.model_copy(update={"keep_alive": 30.0})) == "keep_alive: forever -> 30s"
    assert _changes(old.model_copy(update={"keep_alive": 600.0}), old) == "keep_alive: 10m -> forever"
    assert (
        _changes(old, old.model_copy(update={"prefix_cache_bytes": 512 << 20})) == "prefix_cache_bytes: auto -> 512MiB"
    )


def test_local_directory_is_stored_as_an_absolute_path(tiny_model_dir, depctl_home, monkeypatch):
    monkeypatch.chdir(tiny_model_dir.parent)
    result = run("deployment", "create", tiny_model_dir.name, "--validate-only", "-o", "json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["model"] == str(tiny_model_dir)


@pytest.mark.parametrize("bad_id", ["Upper", "has/slash", "../escape", "-leading", "a" * 64, "dot.ted"])
def test_bad_deployment_id(bad_id, depctl_home):
    result = run("deployment", "create", "smollm2-135m-instruct", "--deployment-id", bad_id, "--validate-only")
    assert result.exit_code == 2
    assert "--deployment-id" in result.stderr


def _seed(depctl_home, speculation) -> None:
    SpecStore().create(DeploymentSpec(id="dep", model="smollm2-135m-instruct", speculation=speculation))


@pytest.mark.parametrize(
    "flags, needle",
    [
        ([], "nothing to update"),
        (
            [
                "--draft-model",
                "qwen2.5-coder-0.5b-instruct",
                "--ngram-speculation-length",
                "2",
                "--draft-token-count",
                "2",
            ],
            "cannot be used together",
        ),
        (
            ["--disable-speculative-decoding", "--draft-token-count", "2"],
            "--disable-speculative-decoding cannot be combined",
        ),
        (["--draft-token-count", "0"], "--draft-token-count"),
        (
            ["--draft-precision", "int8"],
            "--draft-precision needs --draft-model (this deployment does not use a draft model)",
        ),
        (
            ["--disable-speculative-decoding", "--draft-precision", "int8"],
            "cannot be used with --disable-speculative-decoding",
        ),
        (["--max-batch-size", "0"], "--max-batch-size"),
        (["--quantization", "int8", "--dtype", "float16"], "activations, not float16"),
        (["--tensor-parallel-size", "4"], "--tensor-parallel-size needs --engine vllm"),
        (["--engine", "vllm", "--quantization", "int8"], "vLLM has no equivalent"),
        (
            ["--suffix-cache-tokens", "4096"],
            "--suffix-cache-tokens needs --suffix-speculation (this deployment does not use suffix speculation)",
        ),
        (
            ["--disable-speculative-decoding", "--suffix-speculation"],
            "--disable-speculative-decoding cannot be combined",
        ),
        (
            ["--suffix-scope", "user"],
            "--suffix-scope needs --suffix-speculation (this deployment does not use suffix speculation)",
        ),
    ],
)
def test_update_rejects_bad_flags_and_keeps_the_spec(flags, needle, depctl_home):
    _seed(depctl_home, NgramSpeculation(ngram_length=3, num_draft_tokens=4))
    before = (depctl_home / "deployments" / "dep.yaml").read_text()
    result = run("deployment", "update", "dep", "--no-wait", *flags)
    assert result.exit_code != 0
    assert needle in " ".join(result.stderr.split())
    assert (depctl_home / "deployments" / "dep.yaml").read_text() == before


def test_update_draft_precision_alone_keeps_the_rest(depctl_home, monkeypatch):
    from depctl.cli import _common
    from depctl.errors import DaemonError
    from depctl.spec import DraftModelSpeculation

    def no_daemon():
        raise DaemonError("not started in this test")

    monkeypatch.setattr(_common, "start_daemon", no_daemon)  # the spec is the point here, not loading it
    _seed(depctl_home, DraftModelSpeculation(draft_model="smollm2-135m-instruct", num_draft_tokens=5))
    result = run("deployment", "update", "dep", "--no-wait", "--draft-precision", "float32")
    # the spec is written before the daemon is contacted; without a daemon the command then says so
    assert "Updated deployment" in result.stderr and "daemon is unavailable" in result.stderr, result.stderr
    spec = SpecStore().get("dep").speculation
    assert (spec.draft_model, spec.num_draft_tokens, spec.draft_precision) == ("smollm2-135m-instruct", 5, "float32")
    # and a new count keeps the precision
    run("deployment", "update", "dep", "--no-wait", "--draft-token-count", "2")
    spec = SpecStore().get("dep").speculation
    assert (spec.num_draft_tokens, spec.draft_precision) == (2, "float32")


def test_update_to_suffix_speculation_and_its_bound(depctl_home, monkeypatch):
    from depctl.cli import _common
    from depctl.errors import DaemonError

    def no_daemon():
        raise DaemonError("not started in this test")

    monkeypatch.setattr(_common, "start_daemon", no_daemon)
    _seed(depctl_home, NgramSpeculation(ngram_length=3, num_draft_tokens=4))
    run("deployment", "update", "dep", "--no-wait", "--suffix-speculation", "--draft-token-count", "12")
    spec = SpecStore().get("dep").speculation
    assert (spec.method, spec.num_draft_tokens, spec.cache_tokens) == ("suffix", 12, 262144)
    run("deployment", "update", "dep", "--no-wait", "--suffix-cache-tokens", "8192")  # the bound alone keeps K
    spec = SpecStore().get("dep").speculation
    assert (spec.method, spec.num_draft_tokens, spec.cache_tokens) == ("suffix", 12, 8192)
    run("deployment", "update", "dep", "--no-wait", "--draft-token-count", "6")  # K alone keeps the bound
    spec = SpecStore().get("dep").speculation
    assert (spec.num_draft_tokens, spec.cache_tokens) == (6, 8192)
    result = run("deployment", "get", "dep")
    assert "suffix (k=6, cache=8192 tokens)" in " ".join(result.stdout.split())
    run("deployment", "update", "dep", "--no-wait", "--suffix-scope", "deployment")  # the scope alone keeps the rest
    spec = SpecStore().get("dep").speculation
    assert (spec.num_draft_tokens, spec.cache_tokens, spec.scope) == (6, 8192, "deployment")
    run("deployment", "update", "dep", "--no-wait", "--suffix-speculation", "--draft-token-count", "7")
    assert SpecStore().get("dep").speculation.scope == "deployment"  # re-choosing the method keeps its options
    result = run("deployment", "get", "dep")
    assert "suffix (k=7, cache=8192 tokens, shared by all users)" in " ".join(result.stdout.split())


@pytest.mark.parametrize(
    "flags, method, k",
    [
        (["--ngram-speculation-length", "3"], "ngram", 8),
        (["--suffix-speculation"], "suffix", 8),
        (["--draft-model", "qwen2.5-coder-0.5b-instruct"], "draft_model", 4),
    ],
)
def test_a_method_without_a_count_takes_its_default(flags, method, k, depctl_home):
    model = "qwen2.5-coder-1.5b-instruct" if method == "draft_model" else "smollm2-135m-instruct"
    result = run("deployment", "create", model, *flags, "--validate-only", "-o", "json")
    assert result.exit_code == 0, result.stderr
    speculation = json.loads(result.stdout)["speculation"]
    assert (speculation["method"], speculation["num_draft_tokens"]) == (method, k)


def test_switching_method_on_update_keeps_the_deployments_count(depctl_home, monkeypatch):
    _no_daemon(monkeypatch)
    _seed(depctl_home, NgramSpeculation(ngram_length=3, num_draft_tokens=5))
    result = run("deployment", "update", "dep", "--no-wait", "--suffix-speculation")  # written; no daemon to tell
    spec = SpecStore().get("dep").speculation
    assert (spec.method, spec.num_draft_tokens) == ("suffix", 5)
    assert "speculation: ngram (n=3, k=5) -> suffix (k=5)" in " ".join(result.stderr.split())


def test_update_says_what_changed_besides_the_speculation(depctl_home, monkeypatch):
    _no_daemon(monkeypatch)
    _seed(depctl_home, NgramSpeculation(ngram_length=3, num_draft_tokens=4))
    result = run("deployment", "update", "dep", "--no-wait", "--dtype", "float32", "--max-batch-size", "4")
    said = " ".join(result.stderr.split())
    assert "dtype: auto -> float32" in said and "max_batch_size: 8 -> 4" in said and "speculation" not in said


def test_a_draft_identical_to_the_target_is_refused(depctl_home):
    result = run("deployment", "create", "qwen2.5-coder-1.5b-instruct", "--draft-model", "qwen2.5-coder-1.5b-instruct")
    assert result.exit_code == 2
    said = " ".join(result.stderr.split())
    assert "is the target model itself" in said and "--draft-model=qwen2.5-coder-0.5b-instruct" in said
    assert spec_files(depctl_home) == []


def test_device_cuda_without_a_gpu_is_refused_before_writing(depctl_home, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = run("deployment", "create", "smollm2-135m-instruct", "--device", "cuda")
    assert result.exit_code == 2 and "sees no CUDA GPU" in result.stderr, result.stderr
    assert spec_files(depctl_home) == []
    _seed(depctl_home, NgramSpeculation(ngram_length=3, num_draft_tokens=4))
    before = (depctl_home / "deployments" / "dep.yaml").read_text()
    result = run("deployment", "update", "dep", "--device", "cuda")
    assert result.exit_code == 2 and "sees no CUDA GPU" in result.stderr, result.stderr
    assert (depctl_home / "deployments" / "dep.yaml").read_text() == before


def _no_daemon(monkeypatch) -> None:
    from depctl.cli import _common
    from depctl.errors import DaemonError

    def no_daemon():
        raise DaemonError("not started in this test")

    monkeypatch.setattr(_common, "start_daemon", no_daemon)


def test_update_count_without_method_on_a_plain_deployment(depctl_home):
    from depctl.spec import NoSpeculation

    _seed(depctl_home, NoSpeculation())
    result = run("deployment", "update", "dep", "--draft-token-count", "4")
    assert result.exit_code == 2
    assert "speculation disabled" in result.stderr


def test_get_and_update_unknown_deployment(depctl_home):
    for args in (["get", "ghost"], ["update", "ghost", "--draft-token-count", "3"], ["delete", "ghost"]):
        result = run("deployment", *args)
        assert result.exit_code == 3
        assert "'ghost' not found" in result.stderr and "depctl deployment list" in result.stderr


def test_list_empty_is_an_empty_json_list(depctl_home):
    result = run("deployment", "list", "-o", "json")
    assert result.exit_code == 0
    assert json.loads(result.stdout) == []


def test_list_without_daemon_reports_unknown_state(depctl_home):
    _seed(depctl_home, NgramSpeculation(ngram_length=3, num_draft_tokens=4))
    result = run("deployment", "list", "-o", "yaml")
    assert result.exit_code == 0
    (row,) = yaml.safe_load(result.stdout)
    assert row["id"] == "dep" and row["status"]["state"] == "UNKNOWN"
    assert "daemon is not running" in row["status"]["reason"]


def test_commands_needing_the_daemon_say_how_to_start_it(depctl_home):
    result = run("generate", "dep", "hi")
    assert result.exit_code != 0
    assert "depctl daemon start" in result.stderr


def test_max_batch_size_defaults_to_8_and_is_kept(depctl_home, monkeypatch):
    from depctl.cli import _common
    from depctl.errors import DaemonError

    def no_daemon():
        raise DaemonError("not started in this test")

    monkeypatch.setattr(_common, "start_daemon", no_daemon)  # (it once left a daemon running on port 8642)
    result = run("deployment", "create", "smollm2-135m-instruct", "--validate-only", "-o", "json")
    assert json.loads(result.stdout)["max_batch_size"] == 8
    result = run(
        "deployment", "create", "smollm2-135m-instruct", "--max-batch-size", "32", "--validate-only", "-o", "json"
    )
    assert json.loads(result.stdout)["max_batch_size"] == 32
    _seed(depctl_home, NgramSpeculation(ngram_length=3, num_draft_tokens=4))
    result = run("deployment", "update", "dep", "--no-wait", "--max-batch-size", "2")
    assert SpecStore().get("dep").max_batch_size == 2
    assert SpecStore().get("dep").speculation == NgramSpeculation(ngram_length=3, num_draft_tokens=4)


@pytest.mark.parametrize("name", ["[/]", "[red]x[/red]", "[bold", "a]b[/"])
def test_user_text_is_shown_as_typed_never_as_markup(name, depctl_home, tmp_path, monkeypatch):
    # the bug: `update --display-name '[/]'` wrote the spec, then failed with MarkupError, and `get` stayed broken;
    # a model directory named `[/]x` broke `list` for every deployment
    from depctl.cli import _common
    from depctl.errors import DaemonError

    def no_daemon():
        raise DaemonError("not started in this test")

    monkeypatch.setattr(_common, "start_daemon", no_daemon)
    monkeypatch.setenv("COLUMNS", "500")  # no wrapping inside a cell
    _seed(depctl_home, NgramSpeculation(ngram_length=3, num_draft_tokens=4))
    result = run("deployment", "update", "dep", "--no-wait", "--display-name", name)
    assert "Updated deployment" in result.stderr and "MarkupError" not in result.stderr
    result = run("deployment", "get", "dep")
    assert result.exit_code == 0, result.stderr
    assert name in result.stdout
    model_dir = tmp_path / f"{name}x"  # "[/]x" is a directory "[" holding "]x": the path reads [/]x
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text("{}")
    SpecStore().create(DeploymentSpec(id="odd", model=str(model_dir)))
    result = run("deployment", "list")
    assert result.exit_code == 0, result.stderr
    assert str(model_dir) in result.stdout and "dep" in result.stdout
    (depctl_home / "deployments" / "broken.yaml").write_text(f"id: [{name}\n")  # a problem quoting user text
    result = run("deployment", "list")
    assert result.exit_code == 0 and "Warning:" in result.stderr, result.stderr


def test_a_fifo_named_gguf_is_not_a_model(depctl_home, tmp_path):
    # a FIFO named *.gguf once hung the daemon's only loader on its first read
    import os

    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    result = run("deployment", "create", str(fifo), "--validate-only")
    assert result.exit_code == 2 and "is not a regular file" in " ".join(result.stderr.split())


def test_quantization_is_kept_and_checked_against_the_spec_as_it_is(depctl_home):
    result = run(
        "deployment", "create", "smollm2-135m-instruct", "--validate-only", "--quantization", "int8", "-o", "json"
    )
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["quantization"] == "int8"
    assert DeploymentSpec(id="d", model="m").quantization == "none"
    SpecStore().create(DeploymentSpec(id="dep", model="smollm2-135m-instruct", dtype="float16"))
    before = (depctl_home / "deployments" / "dep.yaml").read_text()
    result = run("deployment", "update", "dep", "--no-wait", "--quantization", "int4")  # the stored dtype is float16
    assert result.exit_code != 0 and "not float16" in " ".join(result.stderr.split())
    assert (depctl_home / "deployments" / "dep.yaml").read_text() == before


def test_a_spec_file_with_an_impossible_quantization_is_a_broken_spec(tmp_path):
    from depctl.store import parse_spec

    path = tmp_path / "x.yaml"
    path.write_text("id: x\nmodel: m\ndtype: float16\nquantization: int8\n")
    with pytest.raises(Exception, match="--quantization int8"):
        parse_spec(path)


@pytest.mark.slow
def test_engine_flags_round_trip_through_create_update_and_get(depctl_home):
    try:
        _engine_flags_round_trip()
    finally:
        run("daemon", "stop")  # create and update hand the spec to a daemon (started for them)


def _engine_flags_round_trip():
    result = run(
        "deployment",
        "create",
        "smollm2-135m-instruct",
        "--deployment-id",
        "v",
        "--engine",
        "vllm",
        "--tensor-parallel-size",
        "2",
        "--ray-address",
        "auto",
        "--max-context-length",
        "4096",
        "--ngram-speculation-length",
        "3",
        "--draft-token-count",
        "4",
        "--no-wait",
    )
    spec = SpecStore().get("v")
    assert (spec.engine, spec.tensor_parallel_size, spec.ray_address, spec.max_context_length) == (
        "vllm",
        2,
        "auto",
        4096,
    )
    # back to depctl's engine: the vLLM-only settings must go in the same update, or it is refused and nothing changes
    result = run("deployment", "update", "v", "--engine", "depctl", "--no-wait")
    assert result.exit_code != 0 and "--tensor-parallel-size needs --engine vllm" in " ".join(result.stderr.split())
    assert SpecStore().get("v").engine == "vllm"
    run(
        "deployment",
        "update",
        "v",
        "--engine",
        "depctl",
        "--tensor-parallel-size",
        "1",
        "--ray-address",
        "",
        "--no-wait",
    )
    spec = SpecStore().get("v")
    assert (spec.engine, spec.tensor_parallel_size, spec.ray_address, spec.max_context_length) == (
        "depctl",
        1,
        None,
        4096,
    )
    result = run("deployment", "get", "v", "-o", "json")
    assert '"engine": "depctl"' in result.stdout
    result = run("deployment", "list")
    assert "ENGINE" in result.stdout and "depctl" in result.stdout


def test_compile_is_on_by_default_and_no_compile_is_kept_and_updatable(depctl_home, monkeypatch):
    from depctl.cli import _common
    from depctl.errors import DaemonError

    def no_daemon():
        raise DaemonError("not started in this test")

    monkeypatch.setattr(_common, "start_daemon", no_daemon)
    result = run("deployment", "create", "smollm2-135m-instruct", "--validate-only", "-o", "json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["compile"] is True
    result = run("deployment", "create", "smollm2-135m-instruct", "--validate-only", "--no-compile", "-o", "json")
    assert json.loads(result.stdout)["compile"] is False
    SpecStore().create(DeploymentSpec(id="dep", model="smollm2-135m-instruct"))
    run("deployment", "update", "dep", "--no-wait", "--no-compile")  # written; applying it needs a daemon
    assert SpecStore().get("dep").compile is False
    assert "compile: false" in (depctl_home / "deployments" / "dep.yaml").read_text()


def test_get_shows_what_runs_the_matrix_products():
    from rich.console import Console

    from depctl.cli.views import detail_table

    status = {
        "state": "READY",
        "device": "cpu",
        "dtype": "bfloat16",
        "products": "depctl blocked bf16 on AMX tiles x121",
    }
    console = Console(width=200, record=True)
    console.print(
        detail_table(
            {"id": "dep", "model": "smollm2-135m-instruct", "device": "auto", "dtype": "auto", "status": status}
        )
    )
    text = console.export_text()
    assert "Matrix products" in text and "depctl blocked bf16 on AMX tiles x121" in text
    console.print(detail_table({"id": "dep", "model": "m", "status": {"state": "STOPPED"}}))
    assert console.export_text().count("Matrix products") == 0  # nothing loaded: no row


def test_get_shows_a_heads_layers_acceptance_per_position_and_recorded_prompts(depctl_home):
    from rich.console import Console

    from depctl import recordings
    from depctl.cli.views import detail_table

    spec = DeploymentSpec(id="h", model="smollm2-135m-instruct", record_prompts=True).model_dump(mode="json")
    recordings.record("h", {"prompt": "hi"})
    stats = {
        "requests": 2, "generated_tokens": 40, "acceptance_rate": 0.5, "mean_acceptance_length": 1.8,
        "drafts": 10, "draft_tokens": 16, "accepted_tokens": 8,
        "accepted_per_position": [6, 2], "drafted_per_position": [10, 6],
    }  # fmt: skip
    status = {"state": "READY", "stats": stats, "eagle_head": {"aux_layers": [2, 15, 27], "draft_vocab_size": 8192}}
    console = Console(width=300, record=True)
    console.print(detail_table({**spec, "status": status}))
    text = console.export_text()
    assert "drafts from the target's layers 2, 15, 27, over its 8192 most used tokens" in text
    assert "6 (60%), 2 (33%)" in text  # accepted at each position, of the drafts that reached it
    assert f"on, 1 prompt in {recordings.path('h')}" in text


def _commands():
    import typer

    def walk(command, path):
        yield path, command
        for name, sub in getattr(command, "commands", {}).items():
            yield from walk(sub, [*path, name])

    return list(walk(typer.main.get_command(app), []))


def test_every_help_names_its_values_and_describes_every_argument_and_option():
    """Usage lines read `depctl deployment get ID`, never `{ID}`; a value is named (N, SECONDS, ID), never by its
    Python type (`<str>`, `<float range>`); and nothing is left without a description."""
    import re

    for path, command in _commands():
        for param in command.params:
            assert param.name == "help" or getattr(param, "help", None), f"depctl {' '.join(path)}: {param.name}"
        text = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200"}).output
        usage = next(line for line in text.splitlines() if line.startswith("Usage:"))
        assert "{" not in usage, usage
        assert not re.search(r"<(str|int|float|path|text|int range|float range)>", text), text


@pytest.mark.parametrize(
    ("flag", "stored", "shown"),
    [("512MiB", 512 << 20, "512MiB"), ("2g", 2 << 30, "2GiB"), ("off", 0, "off"), ("auto", None, "auto")],
)
def test_prefix_cache_size_is_read_as_sizes_and_shown_as_the_flag_takes_them(flag, stored, shown):
    from depctl.spec import describe_size, parse_size

    assert parse_size(flag) == stored and describe_size(stored) == shown


def test_a_bad_prefix_cache_size_names_the_flag_and_the_forms(depctl_home):
    result = runner.invoke(app, ["deployment", "create", "smollm2-135m-instruct", "--prefix-cache-size", "lots"])
    assert result.exit_code != 0
    text = " ".join(result.output.split())
    assert "--prefix-cache-size must be a size such as 512MiB or 2GiB (or auto, or off), got 'lots'" in text
    assert not list((depctl_home / "deployments").glob("*.yaml"))


def test_the_prefix_cache_scope_is_per_user_unless_the_owner_shares_it(depctl_home, monkeypatch):
    from depctl.cli import _common
    from depctl.errors import DaemonError
    from depctl.spec import DeploymentSpec
    from depctl.store import SpecStore

    def no_daemon():
        raise DaemonError("not started in this test")

    monkeypatch.setattr(_common, "start_daemon", no_daemon)  # the spec is the point here, not loading it

    result = run("deployment", "create", "smollm2-135m-instruct", "--deployment-id", "dep", "--validate-only")
    assert yaml.safe_load(result.stdout)["prefix_cache_scope"] == "user"
    SpecStore().create(DeploymentSpec(id="dep", model="smollm2-135m-instruct"))
    run("deployment", "update", "dep", "--no-wait", "--prefix-cache-scope", "deployment")
    assert SpecStore().get("dep").prefix_cache_scope == "deployment"
    bad = run("deployment", "update", "dep", "--no-wait", "--prefix-cache-scope", "everyone")
    assert bad.exit_code != 0 and "--prefix-cache-scope" in " ".join(bad.stderr.split())
    assert SpecStore().get("dep").prefix_cache_scope == "deployment"


def test_sampling_defaults_are_kept_per_field_and_checked(depctl_home, monkeypatch):
    """A deployment's sampling defaults (ollama's PARAMETERs): create sets them, update changes one and keeps the
    rest, and a value out of range writes nothing."""
    from depctl.cli import _common
    from depctl.errors import DaemonError
    from depctl.spec import DeploymentSpec
    from depctl.store import SpecStore

    def no_daemon():
        raise DaemonError("not started in this test")

    monkeypatch.setattr(_common, "start_daemon", no_daemon)
    flags = ("--temperature", "0.2", "--top-k", "20")
    result = run("deployment", "create", "smollm2-135m-instruct", "--deployment-id", "dep", "--validate-only", *flags)
    assert yaml.safe_load(result.stdout)["sampling"] == {"temperature": 0.2, "top_p": None, "top_k": 20}
    SpecStore().create(DeploymentSpec(id="dep", model="smollm2-135m-instruct", sampling={"temperature": 0.2}))
    run("deployment", "update", "dep", "--no-wait", "--top-p", "0.8")
    assert SpecStore().get("dep").sampling.model_dump() == {"temperature": 0.2, "top_p": 0.8, "top_k": None}
    bad = run("deployment", "update", "dep", "--no-wait", "--temperature", "3")
    assert bad.exit_code != 0 and "--temperature" in " ".join(bad.stderr.split())
    assert SpecStore().get("dep").sampling.temperature == 0.2


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--learn-draft-head"], "--learn-draft-head drafts with --ngram-speculation-length or --suffix-speculation"),
        (
            ["--learn-draft-head", "--ngram-speculation-length", "3", "--engine", "vllm"],
            "--learn-draft-head trains on depctl's own engine",
        ),
        (["--suffix-speculation", "--learn-disk-size", "1GiB"], "--learn-disk-size needs --learn-draft-head"),
        (
            ["--suffix-speculation", "--learn-draft-head", "--learn-disk-size", "1MiB"],
            "--learn-disk-size must be at least 16MiB",
        ),
        (["--suffix-speculation", "--learn-draft-head", "--learn-disk-size", "lots"], "--learn-disk-size must be a"),
    ],
)
def test_a_learning_head_needs_a_method_to_start_from_and_depctls_engine(flags, needle, depctl_home):
    result = run("deployment", "create", "smollm2-135m-instruct", "--no-wait", *flags)
    assert result.exit_code != 0
    assert needle in " ".join(result.stderr.split()), result.stderr
    assert spec_files(depctl_home) == []


def test_a_learning_head_does_not_go_with_a_draft_model():
    from depctl.spec import DraftModelSpeculation, LearnDraftHead

    with pytest.raises(ValueError, match="got --draft-model"):
        DeploymentSpec(
            id="x",
            model="m",
            speculation=DraftModelSpeculation(draft_model="d", num_draft_tokens=4),
            learn_draft_head=LearnDraftHead(),
        )


def test_learning_is_kept_in_the_spec_and_turned_on_off_and_resized_by_update(depctl_home, monkeypatch):
    from depctl.cli import _common
    from depctl.errors import DaemonError

    def no_daemon():
        raise DaemonError("not started in this test")

    monkeypatch.setattr(_common, "start_daemon", no_daemon)
    result = run(
        "deployment", "create", "smollm2-135m-instruct", "--deployment-id", "dep", "--no-wait",
        "--suffix-speculation", "--draft-token-count", "4", "--learn-draft-head",
    )  # fmt: skip
    assert "Created deployment" in result.stderr, result.stderr
    assert SpecStore().get("dep").learn_draft_head.disk_bytes == 1 << 30
    run("deployment", "update", "dep", "--no-wait", "--learn-disk-size", "256MiB")
    assert SpecStore().get("dep").learn_draft_head.disk_bytes == 256 << 20
    refused = run("deployment", "update", "dep", "--no-wait", "--disable-speculative-decoding")
    assert "--no-learn-draft-head" in " ".join(refused.stderr.split())  # learning needs a method to start from
    result = run("deployment", "update", "dep", "--no-wait", "--no-learn-draft-head")
    assert "learn_draft_head" in result.stderr and SpecStore().get("dep").learn_draft_head is None


def _head_folder(path, trained_for: str):
    """A folder with an EAGLE-3 head's config (as ``depctl draft train`` writes), trained for ``trained_for``."""
    path.mkdir()
    config = {"speculators_model_type": "eagle3", "speculators_config": {"verifier": {"name_or_path": trained_for}}}
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_learning_starts_from_a_trained_head_for_its_model_and_update_changes_or_clears_it(
    depctl_home, monkeypatch, tmp_path
):
    from depctl.cli import _common
    from depctl.errors import DaemonError

    def no_daemon():
        raise DaemonError("not started in this test")

    monkeypatch.setattr(_common, "start_daemon", no_daemon)
    head = _head_folder(tmp_path / "head", "smollm2-135m-instruct")
    not_a_head = tmp_path / "plain"
    not_a_head.mkdir()
    (not_a_head / "config.json").write_text(json.dumps({"model_type": "llama"}))
    other = _head_folder(tmp_path / "qwen-head", "qwen2.5-coder-0.5b-instruct")
    create = ("deployment", "create", "smollm2-135m-instruct", "--deployment-id", "dep", "--no-wait")
    for folder, needle in (
        (not_a_head, f"--learn-draft-head-from {not_a_head} is not an EAGLE head"),
        (other, "is an EAGLE head trained for qwen2.5-coder-0.5b-instruct, not for smollm2-135m-instruct"),
        (tmp_path / "missing", "--learn-draft-head-from"),
    ):
        refused = run(*create, "--suffix-speculation", "--learn-draft-head-from", str(folder))
        assert refused.exit_code != 0 and needle in " ".join(refused.stderr.split()), refused.stderr
        assert spec_files(depctl_home) == []
    # the flag turns learning on: no --learn-draft-head needed
    result = run(*create, "--suffix-speculation", "--learn-draft-head-from", str(head))
    assert "Created deployment" in result.stderr, result.stderr
    assert SpecStore().get("dep").learn_draft_head.start_from == str(head.resolve())
    refused = run("deployment", "update", "dep", "--no-wait", "--no-learn-draft-head", "--learn-draft-head-from", "")
    assert "--learn-draft-head-from cannot go with --no-learn-draft-head" in " ".join(refused.stderr.split())
    run("deployment", "update", "dep", "--no-wait", "--learn-draft-head-from", "")
    assert SpecStore().get("dep").learn_draft_head.start_from is None
    run("deployment", "update", "dep", "--no-wait", "--learn-disk-size", "256MiB", "--learn-draft-head-from", str(head))
    assert SpecStore().get("dep").learn_draft_head.model_dump() == {
        "disk_bytes": 256 << 20,
        "start_from": str(head.resolve()),
    }


def test_get_and_top_show_the_learned_heads_generation_training_and_comparisons():
    from rich.console import Console

    from depctl.cli import top
    from depctl.cli.views import detail_table

    spec = DeploymentSpec(
        id="h",
        model="smollm2-135m-instruct",
        speculation=NgramSpeculation(ngram_length=3, num_draft_tokens=4),
        learn_draft_head={},
    ).model_dump(mode="json")
    learning = {
        "generation": 3,
        "drafting": "head",
        "held_out_mean_accepted": 2.41,
        "live": {"drafted": 400, "accepted": 300, "mean_accepted": 2.2},
        "training": {
            "state": "training", "minutes": 12.5, "optimizer_steps": 90, "positions": 46000,
            "positions_recorded": 30000, "shipped_prompts": {"answered": 262, "total": 262}, "requests_written": 57,
            "vocabulary_answers": 96,
        },
        "traffic": {
            "answers": 120, "held_out": 15, "bytes": 300 << 20, "budget_bytes": 1 << 30, "waiting": 0, "dropped": 0,
        },
        "history": [
            {"at": "2026-11-27T17:01:00+00:00", "candidate": 1.9, "serving": None, "generation": 1, "promoted": True},
            {"at": "2026-11-27T17:03:00+00:00", "candidate": 1.91, "serving": 1.9, "generation": 1, "promoted": False},
            {"at": "2026-11-27T17:05:00+00:00", "candidate": 2.41, "serving": 1.9, "generation": 3, "promoted": True},
        ],
    }  # fmt: skip
    console = Console(width=400, record=True)
    console.print(detail_table({**spec, "status": {"state": "READY", "learning": learning}}))
    text = " ".join(console.export_text().split())
    assert "generation 3: 2.41 mean accepted length on held-out recent answers, 2.20 accepted a step it drafted" in text
    assert (
        "training; 12.5 min, 90 steps over 46000 positions; 120 answers recorded (15 held out, 262 of 262 shipped "
        "prompts and 57 requests the target wrote among them), 300.0 MiB of 1.0 GiB on disk; drafting within the "
        "tokens of 96 answers" in text
    )
    assert "17:01 1.90 -> generation 1; 17:03 1.91 vs 1.90 (kept); 17:05 2.41 vs 1.90 -> generation 3" in text
    given = {**learning, "generation": 1, "started_from": "/heads/smol", "held_out_mean_accepted": None, "history": []}
    console = Console(width=400, record=True)
    console.print(detail_table({**spec, "status": {"state": "READY", "learning": given}}))
    text = " ".join(console.export_text().split())
    assert "generation 1 (learning from the head in /heads/smol): not yet compared on this deployment's answers" in text

    class FakeClient:
        def deployments(self):
            return [{"id": "h", "state": "READY", "learning": learning}]

    rows = top._rows(FakeClient())
    console = Console(width=200, record=True)
    console.print(top._top_view({"pid": 1, "memory_bytes": 1, "deployments": rows}, 200))
    text = " ".join(console.export_text().split())
    assert "h: learned head generation 3 (2.41 accepted on held-out answers); training, 12.5 min trained" in text


def test_get_shows_the_pass_costs_of_chains_of_a_drafts_start_and_of_draft_trees():
    from rich.console import Console

    from depctl.cli.views import detail_table

    policy = {
        "max_draft_tokens": 4,
        "verify_ms": {"1": 50.0, "5": 60.0},
        "draft_ms": {"1": 11.0},
        "draft_start_ms": {"1": 14.5},
        "tree_ms": {"3": 55.0, "9": 70.0},
    }
    console = Console(width=200, record=True)
    console.print(detail_table({"id": "dep", "model": "m", "status": {"state": "READY", "policy": policy}}))
    text = console.export_text()
    assert "1: 50.0, 5: 60.0" in text and "3: 55.0, 9: 70.0" in text and "Tree pass cost" in text
    assert "Draft start (rows: ms)" in text and "1: 14.5" in text  # a step's first drafted position
    untried = {"state": "READY", "policy": {**policy, "tree_ms": {}}}
    console.print(detail_table({"id": "dep", "model": "m", "status": untried}))
    assert "Tree pass cost" not in console.export_text()  # none measured: no row


def test_get_shows_where_each_kind_of_drafting_step_gains_or_was_turned_off():
    from rich.console import Console

    from depctl.cli.views import detail_table

    policy = {
        "max_draft_tokens": 4,
        "verify_ms": {"1": 50.0},
        "drafting_over_plain": {  # as JSON carries it: the bands' keys are strings
            "1": {"sizes": "1", "free": {"ratio": 1.42, "off": False}, "model": {"ratio": 0.81, "off": True}},
            "8": {"sizes": "8-15", "free": {"ratio": 1.1, "off": False}},
            "16": {"sizes": "16-31", "steps": {"plain": 40}},  # plain steps only: nothing to compare there
        },
    }
    console = Console(width=300, record=True)
    console.print(detail_table({"id": "dep", "model": "m", "status": {"state": "READY", "policy": policy}}))
    text = " ".join(console.export_text().split())
    assert "Drafting steps vs plain 1 row: free guesses 1.42x, draft model 0.81x (off); 8-15 rows: 1.10x" in text
    assert "16-31" not in text
    console = Console(width=300, record=True)
    console.print(
        detail_table(
            {"id": "dep", "model": "m", "status": {"state": "READY", "policy": {**policy, "drafting_over_plain": {}}}}
        )
    )
    assert "Drafting steps vs plain" not in console.export_text()  # nothing compared yet: no row
