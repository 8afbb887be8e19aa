"""Backends: what serves a deployment. ``make_backend`` picks one from the spec; everything above talks to the
``Backend`` protocol (``depctl_runtime.backends.base``).

Importing this package loads neither engine: each is imported when a deployment first needs it, so the API's models
and the daemon's start never wait for torch.
"""

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
    Loader,
    Logprob,
    Owner,
)


def make_backend(spec: DeploymentSpec, owner: Owner, load_timeout: float, loader: Loader | None = None) -> Backend:
    """loader: how depctl's engine loads a deployment (tests pass stand-ins; None: ``loader.load_deployment``)."""
    if spec.engine == "vllm":
        from depctl_runtime.backends.vllm import VLLMBackend

        return VLLMBackend(spec, owner, load_timeout)
    from depctl_runtime.backends.local import LocalBackend

    return LocalBackend(spec, owner, loader)


__all__ = [
    "Backend",
    "BackendError",
    "Constraint",
    "Counters",
    "Delta",
    "GenerateRequest",
    "Interrupted",
    "Loader",
    "Logprob",
    "Owner",
    "make_backend",
]
