"""Backends: what serves a deployment. ``make_backend`` picks one from the spec; everything above talks to the
``Backend`` protocol (``depctl_runtime.backends.base``)."""

from __future__ import annotations

from depctl.spec import DeploymentSpec
from depctl_runtime.backends.base import (
    Backend,
    BackendError,
    Constraint,
    Counters,
    Delta,
    GenerateRequest,
    Interrupted,
    Logprob,
    Owner,
)
from depctl_runtime.backends.loader import load_deployment
from depctl_runtime.backends.local import Loader, LocalBackend
from depctl_runtime.backends.vllm import VLLMBackend


def make_backend(spec: DeploymentSpec, owner: Owner, load_timeout: float, loader: Loader = load_deployment) -> Backend:
    if spec.engine == "vllm":
        return VLLMBackend(spec, owner, load_timeout)
    return LocalBackend(spec, owner, loader)


__all__ = [
    "Backend",
    "BackendError",
    "Constraint",
    "Counters",
    "Delta",
    "GenerateRequest",
    "Interrupted",
    "Logprob",
    "Owner",
    "make_backend",
]
