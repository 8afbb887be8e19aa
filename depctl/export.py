"""``depctl deployment export``: a spec as what a cluster takes.

- ``vllm``: the ``vllm serve`` command line, ``--speculative-config`` JSON included;
- ``ray-serve``: a Ray Serve config file for ``serve run`` / ``serve deploy``: one application built by
  ``ray.serve.llm:build_openai_app`` with an ``LLMConfig`` (``engine_kwargs`` carry the speculative config), and
  replicas that autoscale on requests in flight (one replica's target: the spec's batch size);
- ``kserve``: an ``InferenceService`` whose predictor runs vLLM's OpenAI server image with the same arguments.

Model references: a packaged alias becomes its original hub checkpoint (the cluster downloads it; depctl's local copy
is a dequantized Q4 GGUF, so outputs differ slightly from the laptop's); a local path stays a path, with a warning
that every node must see it; ``--model-source local`` keeps depctl's local copies for a single-machine run.
"""

from __future__ import annotations

import shlex
from typing import Literal

import yaml

from depctl import models
from depctl.spec import DeploymentSpec, DraftModelSpeculation, SuffixSpeculation, describe_engine, describe_speculation
from depctl.vllm import VLLM_VERSION, engine_args, engine_kwargs

Format = Literal["vllm", "ray-serve", "kserve"]
ModelSource = Literal["hub", "local"]
SERVE_PORT = 8000
VLLM_IMAGE = {
    "cuda": f"vllm/vllm-openai:v{VLLM_VERSION}",
    "cpu": f"public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v{VLLM_VERSION}",
}


def model_reference(ref: str, source: ModelSource, notes: list[str]) -> str:
    """What the cluster should load for a spec's model reference; ``notes`` collects what the user must know."""
    resolved = models.resolve(ref)
    if resolved.kind == "hub":
        return ref
    if source == "hub" and resolved.kind == "alias" and resolved.packaged.hub_id:
        notes.append(
            f"{ref} is loaded from the hub as {resolved.packaged.hub_id} (the original weights; depctl "
            f"serves a dequantized {resolved.packaged.title.split('(')[-1].rstrip(')')} copy locally)"
        )
        return resolved.packaged.hub_id
    path = models.materialize(resolved) if resolved.kind in ("alias", "gguf") else str(resolved.path or resolved.ref)
    notes.append(f"{ref} is the local path {path}: every node that runs the deployment must see it there")
    return path


def export(
    spec: DeploymentSpec,
    fmt: Format,
    *,
    model_source: ModelSource = "hub",
    min_replicas: int = 1,
    max_replicas: int = 4,
) -> str:
    notes: list[str] = []
    model = model_reference(spec.model, model_source, notes)
    draft = None
    if isinstance(spec.speculation, DraftModelSpeculation):
        draft = model_reference(spec.speculation.draft_model, model_source, notes)
    if isinstance(spec.speculation, SuffixSpeculation):
        notes.append(
            "suffix speculation runs as vLLM's `suffix` method, which needs `pip install arctic-inference` "
            "in the cluster's vLLM environment; vLLM bounds its cache in requests "
            "(suffix_decoding_max_cached_requests, default 10000), not in tokens"
        )
        if spec.speculation.scope == "user":
            notes.append(
                "vLLM's suffix cache is one for the whole server: every user drafts from every other's requests "
                "(depctl's --suffix-scope user keeps them apart)"
            )
    notes = list(dict.fromkeys(notes))  # a draft that is the target model itself: one note
    header = [
        f"depctl deployment {spec.id}: {spec.model}, speculation {describe_speculation(spec.speculation)}, "
        f"engine {describe_engine(spec)}",
        *notes,
    ]
    if fmt == "vllm":
        return _comment(header) + vllm_command(spec, model, draft) + "\n"
    if fmt == "ray-serve":
        return _comment(
            header + ["serve run THIS_FILE (Ray Serve LLM: pip install 'ray[serve,llm]')"]
        ) + yaml.safe_dump(ray_serve_config(spec, model, draft, min_replicas, max_replicas), sort_keys=False)
    if fmt == "kserve":
        return _comment(header + ["kubectl apply -f THIS_FILE"]) + yaml.safe_dump(
            kserve_service(spec, model, draft, min_replicas, max_replicas), sort_keys=False
        )
    raise ValueError(f"unknown export format {fmt!r}")


def vllm_argv(spec: DeploymentSpec, model: str, draft: str | None) -> list[str]:
    """``vllm serve`` and its arguments (the part after ``vllm`` is what vLLM's own parser reads)."""
    return ["vllm", "serve", model, *engine_args(spec, draft_source=draft)]


def vllm_command(spec: DeploymentSpec, model: str, draft: str | None) -> str:
    env = f"RAY_ADDRESS={shlex.quote(spec.ray_address)} " if spec.ray_address else ""
    argv = vllm_argv(spec, model, draft)
    lines, i = [env + " ".join(shlex.quote(a) for a in argv[:3])], 3
    while i < len(argv):  # one flag (and its value) per line
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            lines.append(f"{argv[i]} {shlex.quote(argv[i + 1])}")
            i += 2
        else:
            lines.append(argv[i])
            i += 1
    return " \\\n    ".join(lines)


def ray_serve_config(spec: DeploymentSpec, model: str, draft: str | None, min_replicas: int, max_replicas: int) -> dict:
    llm_config = {
        "model_loading_config": {"model_id": spec.id, "model_source": model},
        "engine_kwargs": engine_kwargs(spec, draft_source=draft),
        "deployment_config": {
            "autoscaling_config": {
                "min_replicas": min_replicas,
                "max_replicas": max_replicas,
                "target_ongoing_requests": spec.max_batch_size,  # a replica decodes this many together
            }
        },
    }
    app = {
        "name": spec.id,
        "route_prefix": "/",
        "import_path": "ray.serve.llm:build_openai_app",
        "args": {"llm_configs": [llm_config]},
    }
    return {"applications": [app]}


def kserve_service(spec: DeploymentSpec, model: str, draft: str | None, min_replicas: int, max_replicas: int) -> dict:
    build = "cpu" if spec.device == "cpu" else "cuda"
    args = [model, "--port", str(SERVE_PORT), *engine_args(spec, draft_source=draft)]
    container = {
        "name": "kserve-container",
        "image": VLLM_IMAGE[build],
        "args": args,
        "ports": [{"containerPort": SERVE_PORT, "protocol": "TCP"}],
    }
    if build == "cuda":
        gpus = spec.tensor_parallel_size * spec.pipeline_parallel_size
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}, "requests": {"nvidia.com/gpu": str(gpus)}}
    if spec.ray_address:
        container["env"] = [{"name": "RAY_ADDRESS", "value": spec.ray_address}]
    return {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": {
            "name": spec.id,
            "annotations": {"depctl.dev/speculation": describe_speculation(spec.speculation)},
        },
        "spec": {"predictor": {"minReplicas": min_replicas, "maxReplicas": max_replicas, "containers": [container]}},
    }


def _comment(lines: list[str]) -> str:
    return "".join(f"# {line}\n" for line in lines)
