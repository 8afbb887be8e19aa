"""A model's weights and tokenizer: fetched or converted where needed, read (safetensors only), and measured against
the memory free before anything is read."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from depctl import models
from depctl.errors import DepctlError, first_line
from depctl_runtime.backends.base import Stage

log = logging.getLogger("depctl.loader")

MAX_CONTEXT_CAP = 32768


class LoadError(Exception):
    pass


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    source: str  # what from_pretrained loaded (a directory or a hub id)
    device: torch.device
    dtype: torch.dtype
    # how the weights are held: the dtype's name, "int8" (a draft's dynamic int8 linears), INT8_WEIGHTS or INT4_WEIGHTS
    precision: str = ""

    def __post_init__(self):
        self.precision = self.precision or str(self.dtype).removeprefix("torch.")


Report = Callable[[Stage], None]


def log_progress(stage: Stage) -> None:
    log.info("%s", stage)


def resolve_source(ref: str, flag: str, report: Report = log_progress) -> str:
    """A model reference -> what ``from_pretrained`` loads, fetching/converting first when needed (each step reported
    as a stage, with how far it is)."""

    def progress(step: str, done: int, total: int, what: str = "") -> None:
        report(Stage(step, f"{ref} ({what})" if what else ref, done / total if total else None))

    try:
        resolved = models.resolve(ref, flag)
        return models.materialize(resolved, progress)
    except DepctlError as exc:
        raise LoadError(exc.message + (f" ({exc.hint})" if exc.hint else "")) from None


def load_model(ref: str, flag: str, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_source(ref, flag)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        # safetensors only: pickled weights (pytorch_model.bin) can run code when they are read
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, use_safetensors=True)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError... for unloadable models
        first = first_line(exc)
        if Path(source).is_dir() and not any(Path(source).glob("*.safetensors")):
            first = (
                "it has no .safetensors weights, and depctl never reads pickled ones (.bin, .pt), which can run "
                "code when loaded: convert them where you trust them (transformers' save_pretrained writes safetensors)"
            )
        offline = " (HF_HUB_OFFLINE is set: hub ids cannot be fetched)" if os.environ.get("HF_HUB_OFFLINE") else ""
        damaged = ""
        if Path(source).is_relative_to(models.models_cache()):  # our copy: a spec change cannot mend it
            damaged = (
                f"; the cached copy may be damaged or cut short: `depctl model pull {ref} --force` fetches it "
                "again, and the deployment loads it when the daemon restarts (`depctl daemon stop`, then start)"
            )
        raise LoadError(f"{flag} {ref!r} failed to load from {source}{offline}: {first}{damaged}") from exc
    model.to(device).eval()
    return LoadedModel(model, tokenizer, source, device, dtype)


def real_vocab_size(tokenizer) -> int:
    return len(tokenizer)


def check_draft_compatible(target: LoadedModel, draft: LoadedModel, target_ref: str, draft_ref: str) -> None:
    """A draft must speak the target's tokens: identical vocabularies (token -> id). Embedding tables may differ
    in size (Qwen pads them); rows past the tokenizer's vocabulary are padding and are sliced off the logits."""
    target_vocab = target.tokenizer.get_vocab()
    draft_vocab = draft.tokenizer.get_vocab()
    if target_vocab == draft_vocab:
        return
    only_target = len(target_vocab.keys() - draft_vocab.keys())
    only_draft = len(draft_vocab.keys() - target_vocab.keys())
    moved = sum(1 for t, i in target_vocab.items() if t in draft_vocab and draft_vocab[t] != i)
    suggestion = models.suggest_draft(target_ref)
    hint = (
        f"use --draft-model={suggestion}, which shares this target's tokenizer"
        if suggestion
        else "use a draft model from the target's family (same tokenizer), or --ngram-speculation-length instead"
    )
    raise LoadError(
        f"draft model {draft_ref!r} does not use the target's tokenizer ({len(target_vocab)} vs {len(draft_vocab)} "
        f"tokens; {only_target} only in the target, {only_draft} only in the draft, {moved} with different ids), "
        f"so its drafts would be meaningless: {hint}"
    )


def estimate_bytes(source: str, dtype: torch.dtype, context: int) -> int:
    """Weights (from the safetensors on disk, rescaled to ``dtype``) + a KV cache of ``context`` positions."""
    from transformers import AutoConfig

    path = Path(source)
    if not path.is_dir():
        return 0  # a hub id: nothing on disk to measure before the download
    cfg = AutoConfig.from_pretrained(source)
    stored = 4 if str(getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", "float32")).endswith("32") else 2
    weights = sum(p.stat().st_size for p in path.glob("*.safetensors")) * dtype.itemsize // stored
    return weights + kv_cache_bytes(cfg, dtype.itemsize, context)


def kv_cache_bytes(cfg, itemsize: int, positions: int) -> int:
    """Keys and values of every layer for ``positions`` cached tokens (summed over rows)."""
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = getattr(cfg, "num_attention_heads", 1)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return 2 * getattr(cfg, "num_hidden_layers", 0) * kv_heads * head_dim * positions * itemsize


def free_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None  # unknown (macOS, Windows): do not block the load


def check_memory(needs: list[tuple[str, int]], device: torch.device) -> None:
    total = sum(n for _, n in needs)
    free = free_bytes(device)
    if free is None or total == 0:
        return
    if total > free * 0.9:  # leave room for activations and the process itself
        parts = ", ".join(f"{name} {n / 2**30:.2f} GiB" for name, n in needs)
        raise LoadError(
            f"not enough memory on {device.type}: need about {total / 2**30:.2f} GiB ({parts}, weights + KV cache) "
            f"but {free / 2**30:.2f} GiB is free; free memory, use a smaller model or dtype, or delete other "
            "deployments"
        )
