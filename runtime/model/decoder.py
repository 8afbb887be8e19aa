"""The Llama-family forward over the ``SlotCache``, written out: what a step costs is what this file does.

transformers' forward is general and pays for it on every step: a decorated decoder layer with keyword plumbing, a
causal mask built and thrown away (our attention reads the ``RowLayout``), three projections where one would do.
On a CPU, once the weights are few bytes, those small ops are a large part of a step. For the
architectures whose layer is exactly ``x += attn(norm(x)); x += mlp(norm(x))`` with RoPE and RMSNorm (Llama,
SmolLM2, Mistral and Qwen2 without sliding windows), the loader fuses the projections (``fuse_projections``: q, k, v
into one ``qkv_proj``, gate and up into one ``gate_up_proj``) and the runner steps through ``forward`` below instead of
calling the model. The fused modules keep transformers' calling convention, so ``model.generate`` still works on
the same object (a benchmark's reference), and every other architecture keeps transformers' forward.

Same weights, same formulas (RMSNorm in float32, RoPE from the model's own rotary embedding); plain decoding and
speculation both run through it, so exactness is unaffected.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from depctl_runtime.model.attention import RowLayout, rows_attention

ARCHITECTURES = ("llama", "mistral", "qwen2")


class FusedAttention(nn.Module):
    """q, k and v projections as one linear (``qkv_proj``), then RoPE, the cache, our attention and ``o_proj``."""

    def __init__(self, attn: nn.Module, config):
        super().__init__()
        self.layer_idx = attn.layer_idx
        self.head_dim = attn.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = attn.scaling
        self.sliding_window = getattr(attn, "sliding_window", None)
        self.config = attn.config
        self.num_key_value_groups = self.num_heads // self.num_kv_heads  # what transformers' SDPA path reads
        self.is_causal = True
        self.qkv_proj = _concat_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o_proj = attn.o_proj

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: [1, T, hidden] -> q [1, heads, T, dim], k and v [1, kv_heads, T, dim], RoPE applied to q and k."""
        t = x.shape[1]
        qkv = self.qkv_proj(x).view(t, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk = qkv[:, : self.num_heads + self.num_kv_heads]  # q and k rotate together: one set of ops for both
        qk = qk * cos[0, :, None] + _rotate_half(qk) * sin[0, :, None]
        q = qk[:, : self.num_heads].transpose(0, 1)[None]
        k = qk[:, self.num_heads :].transpose(0, 1)[None]
        v = qkv[:, self.num_heads + self.num_kv_heads :].transpose(0, 1)[None]
        return q, k, v

    def forward(
        self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, past_key_values=None, **kwargs
    ):
        """transformers' calling convention (``model.generate`` on a fused model): [B, T, hidden] in and out. The cache
        comes as ``cache`` from transformers 5.24 on, as ``past_key_values`` before."""
        cache = cache if cache is not None else past_key_values
        b, t = hidden_states.shape[:2]
        cos, sin = position_embeddings
        q, k, v = [], [], []
        for i in range(b):  # rows of a batch rotate by their own positions
            qi, ki, vi = self.project(hidden_states[i : i + 1], cos[i : i + 1], sin[i : i + 1])
            q.append(qi), k.append(ki), v.append(vi)
        q, k, v = torch.cat(q), torch.cat(k), torch.cat(v)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        out, _ = rows_attention(
            self, q, k, v, attention_mask, scaling=self.scaling, sliding_window=self.sliding_window, **kwargs
        )
        return self.o_proj(out.reshape(b, t, -1)), None


class FusedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up as one linear."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.intermediate = mlp.gate_proj.out_features
        self.gate_up_proj = _concat_linears([mlp.gate_proj, mlp.up_proj])
        self.down_proj = mlp.down_proj
        self.act_fn = mlp.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        return self.down_proj(self.act_fn(gate_up[..., : self.intermediate]) * gate_up[..., self.intermediate :])


def supports(model: nn.Module) -> bool:
    """Whether ``fuse_projections`` and ``forward`` apply: a Llama-shaped decoder with no sliding-window layers."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in ARCHITECTURES:
        return False
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):  # Qwen2 with use_sliding_window
        return False
    if config.model_type == "mistral" and getattr(config, "sliding_window", None):
        return False
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return (
        bool(layers)
        and all(hasattr(layer.self_attn, "q_proj") or isinstance(layer.self_attn, FusedAttention) for layer in layers)
        and hasattr(model, "lm_head")
    )


def fuse_projections(model: nn.Module) -> int:
    """Swap every layer's attention and MLP for their fused forms (``FusedAttention``, ``FusedMLP``); returns how
    many layers changed, 0 for an architecture this file does not cover. Run before the precision surgery, which then
    swaps the fused linears like any other."""
    if not supports(model):
        return 0
    swapped = 0
    for layer in model.model.layers:
        if not isinstance(layer.self_attn, FusedAttention):
            layer.self_attn = FusedAttention(layer.self_attn, model.config)
            layer.mlp = FusedMLP(layer.mlp)
            swapped += 1
    return swapped


def is_fused(model: nn.Module) -> bool:
    layers = getattr(getattr(model, "model", None), "layers", None)
    return bool(layers) and all(isinstance(layer.self_attn, FusedAttention) for layer in layers)


def forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    attend,
    keep: torch.Tensor | None = None,
    head: bool = True,
) -> torch.Tensor:
    """One pass of a fused model over the flat token stream: input_ids and positions [T]; returns logits [T, vocab],
    or [len(keep), vocab] for the stream indices in ``keep``; with ``head=False`` the final norm's output [T, hidden]
    instead, for the caller to apply the output layer (``runner.Scores``: a greedy token may not need all of it).

    attend(i, attn, q, k, v) -> [1, T, heads, dim]: writes layer i's new keys and values into the cache and attends
    over it. Its owner decides how: ``cache_attention`` (eager, the ``SlotCache``'s own update) or the compiled pass
    (``depctl_runtime.model.compiled``); the rest of the layer is this one body either way."""
    return forward_with_features(model, input_ids, positions, attend, keep, head)[0]


def forward_with_features(
    model: nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    attend,
    keep: torch.Tensor | None = None,
    head: bool = True,
    features: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``forward``, and the outputs of the layers ``features`` names side by side for every token of the stream
    ([T, len(features) * hidden], ``keep`` or not; None for no layers): what an EAGLE head drafts from
    (``depctl_runtime.model.eagle``), taken from the pass the target runs anyway."""
    inner = model.model
    x = inner.embed_tokens(input_ids)[None]  # [1, T, hidden]
    cos, sin = inner.rotary_emb(x, positions[None])  # [1, T, dim] each
    taken = {}
    for i, layer in enumerate(inner.layers):
        x = _mlp(layer, _attention(i, layer, x, cos, sin, attend))
        if i in features:
            taken[i] = x[0]
    return _output(model, x, taken, features, keep, head)


class LayeredPass:
    """``forward_with_features`` a part of a layer at a time, for a prompt chunk read beside running streams: ``run``
    goes on from the first part not yet run and stops between parts (a layer's attention, its MLP) once ``more()`` says
    so. The same ops on the same tensors in the same order as one call, so the result has the same bits however the
    pass is split. Between calls the caller owns the cache; ``attend`` must find it ready for this pass when ``run``
    is called."""

    def __init__(self, model, input_ids, positions, attend, keep=None, head=True, features: tuple[int, ...] = ()):
        self.model, self.attend, self.keep, self.head, self.features = model, attend, keep, head, features
        inner = model.model
        self.x = inner.embed_tokens(input_ids)[None]  # [1, T, hidden]
        self.cos, self.sin = inner.rotary_emb(self.x, positions[None])
        self.taken: dict[int, torch.Tensor] = {}
        self.parts = 0  # parts run: layer i's attention is part 2i, its MLP part 2i + 1

    @property
    def done(self) -> bool:
        return self.parts == 2 * len(self.model.model.layers)

    def run(self, more=None) -> bool:
        """Run parts until the last, or until ``more()`` is false after one (None: to the last). Returns ``done``."""
        layers = self.model.model.layers
        while not self.done:
            i, mlp = divmod(self.parts, 2)
            if mlp:
                self.x = _mlp(layers[i], self.x)
                if i in self.features:
                    self.taken[i] = self.x[0]
            else:
                self.x = _attention(i, layers[i], self.x, self.cos, self.sin, self.attend)
            self.parts += 1
            if more is not None and not more():
                break
        return self.done

    def result(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What ``forward_with_features`` returns, once ``done``."""
        if not self.done:
            raise RuntimeError(f"the pass has run {self.parts} of {2 * len(self.model.model.layers)} parts")
        return _output(self.model, self.x, self.taken, self.features, self.keep, self.head)


def _attention(i: int, layer: nn.Module, x: torch.Tensor, cos, sin, attend) -> torch.Tensor:
    attn = layer.self_attn
    q, k, v = attn.project(_rms_norm(x, layer.input_layernorm), cos, sin)
    out = attend(i, attn, q, k, v)
    return x + attn.o_proj(out.reshape(1, x.shape[1], -1))


def _mlp(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x + layer.mlp(_rms_norm(x, layer.post_attention_layernorm))


def _output(model, x, taken: dict, features, keep, head) -> tuple[torch.Tensor, torch.Tensor | None]:
    states = torch.cat([taken[i] for i in features], dim=-1) if features else None  # [T, 3 * hidden]
    if keep is not None:
        x = x[:, keep]
    x = _rms_norm(x, model.model.norm)[0]  # [T, hidden]
    return (model.lm_head(x) if head else x), states


def cache_attention(cache, layout: RowLayout):
    """``forward``'s eager ``attend``: the cache layer's update, then our attention over the rows it returns."""

    def attend(i, attn, q, k, v):
        keys, values = cache.layers[i].update(k, v)
        return rows_attention(
            attn, q, keys, values, None, scaling=attn.scaling, sliding_window=attn.sliding_window, depctl_rows=layout
        )[0]

    return attend


def _rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """transformers' RMSNorm (float32 statistics, the weight applied in the input's dtype) in fewer ops."""
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _concat_linears(linears: list[nn.Linear]) -> nn.Linear:
    """One ``nn.Linear`` whose output is the given linears' outputs side by side (weights copied, then the originals
    are dropped with the modules that held them)."""
    first = linears[0]
    bias = [lin.bias for lin in linears]
    fused = nn.Linear(
        first.in_features,
        sum(lin.out_features for lin in linears),
        bias=bias[0] is not None,
        device=first.weight.device,
        dtype=first.weight.dtype,
    )
    with torch.no_grad():
        fused.weight.copy_(torch.cat([lin.weight for lin in linears]))
        if fused.bias is not None:
            fused.bias.copy_(
                torch.cat(
                    [
                        b if b is not None else torch.zeros(lin.out_features, dtype=fused.bias.dtype)
                        for b, lin in zip(bias, linears)
                    ]
                )
            )
    fused.requires_grad_(False)
    return fused
