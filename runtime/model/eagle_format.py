"""An EAGLE-3 head on disk in Red Hat's ``speculators`` format, which vLLM loads natively (``eagle3``).

A directory with ``config.json`` (``speculators_model_type: eagle3``, the layer's Llama config in
``transformer_layer_config``, ``draft_vocab_size``, ``target_hidden_size``, ``norm_before_residual``, the target layers
read in ``eagle_aux_hidden_state_layer_ids``, and ``speculators_config`` naming the algorithm, the proposal method and
the verifier) and ``model.safetensors`` (the head's weights with ``d2t`` and ``t2d``; the embeddings are the target's
and are not stored). The verifier's name and a fingerprint of its weights let a deployment refuse a head trained for
another target.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from depctl_runtime.model.eagle import EagleConfig, EagleHead

FORMAT_VERSION = "0.1.0"
_NOT_STORED = ("embed_tokens.weight",)


class HeadError(ValueError):
    """A directory that is not a head depctl can load; the message says what is wrong."""


def save(head: EagleHead, out: Path, verifier: dict, speculative_tokens: int, extra: dict | None = None) -> None:
    """Write ``head`` to ``out`` (atomically per file). ``verifier``: ``name_or_path``, ``architectures`` and
    depctl's ``fingerprint`` of the target."""
    out.mkdir(parents=True, exist_ok=True)
    c = head.config
    layer = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": FORMAT_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "norm_before_residual": True,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layers),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "verifier": verifier,
        },
        "depctl": extra or {},
    }
    weights = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items() if k not in _NOT_STORED}
    _atomic(out / "model.safetensors", lambda tmp: save_file(weights, str(tmp)))
    _atomic(out / "config.json", lambda tmp: tmp.write_text(json.dumps(config, indent=2) + "\n"))


def is_head(path: Path) -> bool:
    """Whether ``path`` looks like an EAGLE-3 speculators checkpoint (a draft-model directory otherwise)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("speculators_model_type") == "eagle3"


def read_config(path: Path) -> dict:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise HeadError(f"{path}: cannot read config.json ({exc})") from None
    if config.get("speculators_model_type") != "eagle3":
        raise HeadError(
            f"{path}: not an EAGLE-3 head (speculators_model_type is {config.get('speculators_model_type')!r})"
        )
    return config


def measured(config: dict) -> tuple[float, int] | None:
    """A head's mean accepted length on held-out answers and the draft steps it was measured at, where its config
    records them (a learned generation's last comparison, or ``depctl draft train``'s last evaluation); else None."""
    extra = config.get("depctl") or {}
    history = extra.get("history") or [{}]
    mean = extra.get("held_out_mean_accepted") or history[-1].get("mean_accepted")
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    k = methods[0].get("speculative_tokens")
    if not isinstance(mean, (int, float)) or not isinstance(k, int) or k < 1:
        return None
    return float(mean), k


def load(path: Path, embeddings: torch.Tensor) -> tuple[EagleHead, dict]:
    """The head in ``path`` with the target's input ``embeddings`` [vocab, hidden]; and its config."""
    config = read_config(path)
    try:
        layer = config["transformer_layer_config"]
        c = EagleConfig(
            hidden_size=layer["hidden_size"],
            target_hidden_size=config.get("target_hidden_size") or layer["hidden_size"],
            num_attention_heads=layer["num_attention_heads"],
            num_key_value_heads=layer.get("num_key_value_heads", layer["num_attention_heads"]),
            head_dim=layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
            intermediate_size=layer["intermediate_size"],
            vocab_size=layer["vocab_size"],
            draft_vocab_size=config.get("draft_vocab_size") or layer["vocab_size"],
            aux_layers=tuple(config["eagle_aux_hidden_state_layer_ids"]),
            rms_norm_eps=layer.get("rms_norm_eps", 1e-5),
            rope_theta=layer.get("rope_theta", 10000.0),
            max_position_embeddings=layer.get("max_position_embeddings", 2048),
        )
    except (KeyError, TypeError) as exc:
        raise HeadError(f"{path}/config.json: missing or malformed field {exc}") from None
    if not config.get("norm_before_residual", True):
        raise HeadError(f"{path}: a head with norm_before_residual false is not supported yet")
    if embeddings.shape != (c.vocab_size, c.hidden_size):
        raise HeadError(
            f"{path}: the head expects embeddings of {c.vocab_size} x {c.hidden_size}, the target has "
            f"{tuple(embeddings.shape)[0]} x {tuple(embeddings.shape)[1]}"
        )
    head = EagleHead(c)
    try:
        weights = load_file(str(path / "model.safetensors"))
    except Exception as exc:  # safetensors raises its own errors for a truncated or foreign file
        raise HeadError(f"{path}/model.safetensors: cannot read it ({exc})") from None
    weights = {k.removeprefix("model."): v for k, v in weights.items()}
    weights.setdefault("embed_tokens.weight", embeddings)
    missing, unexpected = head.load_state_dict(weights, strict=False)
    missing = [m for m in missing if m != "embed_tokens.weight"]
    if missing or unexpected:
        raise HeadError(f"{path}/model.safetensors: missing {missing[:4]}, unexpected {unexpected[:4]}")
    head.embed_tokens.weight.data = embeddings  # the target's own table, shared
    return head.eval().requires_grad_(False), config


def fingerprint(model: torch.nn.Module) -> str:
    """A short digest of a target's embeddings and first layer: the same model (at any precision depctl loads it)
    gives the same one, another model a different one."""
    import hashlib

    table = model.get_input_embeddings().weight
    sample = table[:: max(1, table.shape[0] // 64)].detach()  # rounded to bf16: float32 and bf16 loads agree
    # a copy: numpy's view of the table itself would leave its storage unresizable (``compiled.Library``)
    sample = sample.to(torch.bfloat16).view(torch.int16).cpu().clone()
    digest = hashlib.sha256(sample.numpy().tobytes())
    digest.update(str(tuple(table.shape)).encode())
    return digest.hexdigest()[:16]


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, path)
