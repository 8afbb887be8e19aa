"""Pass costs kept between loads: a deployment's speculation policy starts from the costs an earlier load of the same
deployment shape measured on this machine (and refined while it served), instead of calibrating on every load and
every keep-alive reload. Calibrating takes seconds and is noisy on a busy machine; serving refines the costs anyway
(``policy.CostModel``), and what it learned is written back when the engine is released."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from pathlib import Path

import torch

from depctl import config
from depctl_runtime.kernels import native

log = logging.getLogger("depctl.loader")


def kept_costs_path(spec, model: torch.nn.Module, precision: str, passes: str, products: str) -> Path:
    """Where this deployment shape's costs are kept: the model, its precision and how its passes and products run
    (and the build of depctl's C++ ops, whose products keep their names when their code changes), the rows and
    speculation that decide which widths are priced, and the machine (its CPU, torch, threads)."""
    shape = {
        "model": model.config.to_diff_dict() if hasattr(model.config, "to_diff_dict") else str(model.config),
        "precision": precision,
        "dtype": str(next(model.parameters()).dtype),
        "device": str(next(model.parameters()).device),
        "passes": passes,
        "products": products,
        "kernels": native.identity(),
        "rows": spec.max_batch_size,
        "speculation": spec.speculation.model_dump(mode="json"),
        "torch": torch.__version__,
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "machine": platform.node(),
    }
    key = hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return config.cache_dir() / "calibration" / f"{key}.json"


def read_costs(path: Path) -> dict | None:
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # none yet, or a damaged file: calibrate
    # (costs kept before passes over draft trees were priced have no "tree_ms": measured again once)
    return kept if isinstance(kept, dict) and kept.get("verify_ms") and "tree_ms" in kept else None


def write_costs(path: Path, snapshot: dict) -> None:
    """Atomically (a reader never sees half a file); a failure to write costs only the next load's calibration."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps(snapshot))
        os.replace(partial, path)
    except OSError as exc:
        log.warning("could not keep the pass costs in %s: %s", path, exc)
