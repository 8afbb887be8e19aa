"""Training state on disk without pickle: tensors in safetensors, everything else in JSON.

A head directory (and its ``.train/`` folder) is something people hand each other, so nothing read back from it may
run code: ``torch.load`` of a pickle can, whatever ``weights_only`` promises about a given torch version. Two
kinds of file:

- **answer shards** (``answers-N.safetensors``): rows of tensors plus a few integers, the integers in the file's
  metadata;
- **the resume state** (``state.safetensors`` + ``state.json``): the head's and the optimizer's tensors, and the
  rest (optimizer settings, clocks, history). The JSON is written last and names the tensors' file size, so a
  state cut short by an interrupt reads as no state.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

ROW_INTS = ("index", "sample", "start")


def save_rows(rows: list[dict], path: Path) -> None:
    """Rows of ``{name: tensor}`` and the integers ``ROW_INTS``, atomically."""
    tensors, meta = {}, []
    for i, row in enumerate(rows):
        meta.append({k: int(row[k]) for k in ROW_INTS})
        for name, value in row.items():
            if name not in ROW_INTS:
                tensors[f"{i}.{name}"] = value.contiguous()
    _atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata={"rows": json.dumps(meta)}))


def load_rows(path: Path) -> list[dict]:
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["rows"])
        rows = [dict(m) for m in meta]
        for key in f.keys():
            i, name = key.split(".", 1)
            rows[int(i)][name] = f.get_tensor(key)
    return rows


def save_state(folder: Path, head: dict, optimizer: dict, info: dict) -> None:
    """The head's state dict, the optimizer's and ``info`` (JSON-able), as one resumable state."""
    tensors = {f"head.{k}": v.detach().contiguous() for k, v in head.items()}
    opt_state = {}
    for param, entries in optimizer["state"].items():
        opt_state[str(param)] = {}
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{param}.{name}"] = value.detach().contiguous()
            else:
                opt_state[str(param)][name] = value
    tensors_path = folder / "state.safetensors"
    _atomic(tensors_path, lambda tmp: save_file(tensors, str(tmp)))
    record = {
        **info,
        "optimizer": {"state": opt_state, "param_groups": optimizer["param_groups"]},
        "tensors_bytes": tensors_path.stat().st_size,
    }
    _atomic(folder / "state.json", lambda tmp: tmp.write_text(json.dumps(record)))


def load_state(folder: Path, device) -> tuple[dict, dict, dict] | None:
    """(head state dict, optimizer state dict, info), or None where there is no complete state."""
    tensors_path, record_path = folder / "state.safetensors", folder / "state.json"
    if not (tensors_path.exists() and record_path.exists()):
        return None
    try:
        record = json.loads(record_path.read_text())
        if record.pop("tensors_bytes") != tensors_path.stat().st_size:
            return None
        head, opt_tensors = {}, {}
        with safe_open(str(tensors_path), framework="pt", device=str(device)) as f:
            for key in f.keys():
                kind, rest = key.split(".", 1)
                (head if kind == "head" else opt_tensors)[rest] = f.get_tensor(key)
    except Exception:  # noqa: BLE001 - not a state this code wrote (or cut short): trained afresh
        return None
    saved = record.pop("optimizer")
    state = {int(param): dict(entries) for param, entries in saved["state"].items()}
    for key, value in opt_tensors.items():
        param, name = key.split(".", 1)
        state.setdefault(int(param), {})[name] = value
    return head, {"state": state, "param_groups": saved["param_groups"]}, record


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)
