"""A spec in vLLM's terms (depctl.vllm) and as a cluster's config (depctl.export). The same output is checked against
vLLM's own parser and SpeculativeConfig, and Ray Serve's LLMConfig, in tests/engines (where vLLM is installed)."""

from __future__ import annotations

import json

import pytest
import yaml

from depctl.export import export, vllm_argv
from depctl.spec import DeploymentSpec, DraftModelSpeculation, NgramSpeculation, SuffixSpeculation
from depctl.vllm import engine_args, engine_kwargs, speculative_config


def _spec(**kw) -> DeploymentSpec:
    return DeploymentSpec(**{"id": "v", "model": "smollm2-135m-instruct", "engine": "vllm", **kw})


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_ngram_is_prompt_lookup_of_exactly_n():
    spec = _spec(speculation=NgramSpeculation(ngram_length=3, num_draft_tokens=5))
    assert speculative_config(spec) == {
        "method": "ngram",
        "num_speculative_tokens": 5,
        "prompt_lookup_min": 3,
        "prompt_lookup_max": 3,
    }


def test_draft_model_names_the_drafts_source():
    spec = _spec(speculation=DraftModelSpeculation(draft_model="qwen2.5-coder-0.5b-instruct", num_draft_tokens=4))
    assert speculative_config(spec, draft_source="/models/q05") == {
        "method": "draft_model",
        "model": "/models/q05",
        "num_speculative_tokens": 4,
    }
    assert speculative_config(_spec()) is None


def test_an_eagle_head_is_vllms_eagle3_method(tmp_path):
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))
    spec = _spec(speculation=DraftModelSpeculation(draft_model=str(head), num_draft_tokens=3))
    assert speculative_config(spec) == {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}


def test_engine_args_carry_every_setting_in_vllms_spelling():
    spec = _spec(
        speculation=NgramSpeculation(ngram_length=2, num_draft_tokens=4),
        max_batch_size=16,
        max_context_length=4096,
        tensor_parallel_size=2,
        pipeline_parallel_size=3,
        ray_address="auto",
        dtype="bfloat16",
    )
    args = engine_args(spec)
    assert _flag(args, "--served-model-name") == "v" and _flag(args, "--dtype") == "bfloat16"
    assert _flag(args, "--max-num-seqs") == "16" and _flag(args, "--max-model-len") == "4096"
    assert _flag(args, "--tensor-parallel-size") == "2" and _flag(args, "--pipeline-parallel-size") == "3"
    assert _flag(args, "--distributed-executor-backend") == "ray"
    assert json.loads(_flag(args, "--speculative-config"))["prompt_lookup_max"] == 2
    # the daemon's resolved values win over the spec's auto
    args = engine_args(_spec(), dtype="float32", max_model_len=8192)
    assert _flag(args, "--dtype") == "float32" and _flag(args, "--max-model-len") == "8192"
    assert "--speculative-config" not in args and "--tensor-parallel-size" not in args
    assert "--enforce-eager" not in args
    # --no-compile is vLLM's --enforce-eager (a switch: no value follows it)
    args = engine_args(_spec(compile=False))
    assert (
        args[args.index("--enforce-eager") + 1].startswith("--")
        and engine_kwargs(_spec(compile=False))["enforce_eager"]
    )
    kwargs = engine_kwargs(spec)
    assert kwargs["speculative_config"]["method"] == "ngram" and kwargs["tensor_parallel_size"] == 2
    assert kwargs["max_num_seqs"] == 16 and kwargs["distributed_executor_backend"] == "ray"


def test_export_vllm_is_a_runnable_command_with_the_hub_checkpoint(depctl_home):
    spec = _spec(
        speculation=DraftModelSpeculation(draft_model="smollm2-135m-instruct", num_draft_tokens=4),
        ray_address="ray://head:10001",
        tensor_parallel_size=2,
    )
    text = export(spec, "vllm")
    command = " ".join(line for line in text.splitlines() if not line.startswith("#")).replace("\\", " ")
    import shlex

    argv = shlex.split(command)
    assert argv[0] == "RAY_ADDRESS=ray://head:10001" and argv[1:4] == [
        "vllm",
        "serve",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
    ]
    assert argv[4:] == engine_args(spec, draft_source="HuggingFaceTB/SmolLM2-135M-Instruct")
    assert "# smollm2-135m-instruct is loaded from the hub as HuggingFaceTB/SmolLM2-135M-Instruct" in text
    assert text.count("loaded from the hub") == 1  # target and draft are one model: one note


def test_export_ray_serve_and_kserve(depctl_home):
    spec = _spec(
        speculation=NgramSpeculation(ngram_length=3, num_draft_tokens=4), max_batch_size=16, tensor_parallel_size=2
    )
    app = yaml.safe_load(export(spec, "ray-serve", min_replicas=2, max_replicas=6))["applications"][0]
    assert app["import_path"] == "ray.serve.llm:build_openai_app"
    llm = app["args"]["llm_configs"][0]
    assert llm["model_loading_config"] == {"model_id": "v", "model_source": "HuggingFaceTB/SmolLM2-135M-Instruct"}
    assert llm["engine_kwargs"] == engine_kwargs(spec)
    assert llm["deployment_config"]["autoscaling_config"] == {
        "min_replicas": 2,
        "max_replicas": 6,
        "target_ongoing_requests": 16,
    }
    isvc = yaml.safe_load(export(spec, "kserve"))
    assert (isvc["apiVersion"], isvc["kind"], isvc["metadata"]["name"]) == (
        "serving.kserve.io/v1beta1",
        "InferenceService",
        "v",
    )
    container = isvc["spec"]["predictor"]["containers"][0]
    assert container["args"][0] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert container["args"][3:] == engine_args(spec)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"


def test_export_local_keeps_depctls_copies(depctl_home, tiny_model_dir):
    spec = _spec(model=str(tiny_model_dir))
    argv = vllm_argv(spec, str(tiny_model_dir), None)
    text = export(spec, "vllm", model_source="local")
    assert f"vllm serve {tiny_model_dir}" in text and "every node that runs the deployment must see it" in text
    assert argv[2] == str(tiny_model_dir)


def test_suffix_speculation_exports_as_vllms_suffix_method_and_says_what_it_needs(depctl_home):
    spec = DeploymentSpec(
        id="s", model="HuggingFaceTB/SmolLM2-135M-Instruct", speculation=SuffixSpeculation(num_draft_tokens=12)
    )
    assert speculative_config(spec) == {"method": "suffix", "num_speculative_tokens": 12}
    text = export(spec, "vllm")
    assert "arctic-inference" in text and '"method":"suffix"' in text
    assert "one for the whole server" in text  # depctl keeps users apart by default; vLLM cannot
    shared = spec.model_copy(update={"speculation": SuffixSpeculation(num_draft_tokens=12, scope="deployment")})
    assert "one for the whole server" not in export(shared, "vllm")
    with pytest.raises(ValueError, match="--suffix-speculation runs on depctl's engine"):
        _spec(speculation=SuffixSpeculation(num_draft_tokens=12))  # the daemon's vLLM engine does not have it


def test_export_works_for_a_depctl_engine_spec_too(depctl_home):
    text = export(DeploymentSpec(id="d", model="HuggingFaceTB/SmolLM2-135M-Instruct"), "vllm")
    assert "vllm serve HuggingFaceTB/SmolLM2-135M-Instruct" in text


@pytest.mark.parametrize("fmt", ["vllm", "ray-serve", "kserve"])
def test_export_cli(fmt, depctl_home):
    from typer.testing import CliRunner

    from depctl.cli import app
    from depctl.store import SpecStore

    SpecStore().create(_spec(speculation=NgramSpeculation(ngram_length=3, num_draft_tokens=4)))
    result = CliRunner().invoke(app, ["deployment", "export", "v", "--format", fmt])
    assert result.exit_code == 0, result.output
    assert "prompt_lookup_min" in result.stdout
    result = CliRunner().invoke(app, ["deployment", "export", "nope", "--format", fmt])
    assert result.exit_code != 0 and "nope" in result.stderr
