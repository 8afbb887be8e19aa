"""An EAGLE-3 draft head: one decoder layer that reads the target's own hidden states and drafts tokens.

EAGLE-3 (Li et al. 2025, arXiv 2503.01840): the target's hidden states from three layers (low, middle, high) are
fused by ``fc`` into one vector ``g`` per position. To draft the token after ``x[i+1]``, the head's layer reads
``[norm(embed(x[i+1])), hidden_norm(g[i])]`` (twice the hidden size: its q, k and v projections take both) and
attends over the head's own keys of the earlier positions; its output goes through ``norm`` and a reduced output
layer (``draft_vocab_size`` of the target's most frequent tokens, mapped back by ``d2t``). The next draft step feeds
the layer's own output (before ``norm``) where the target's ``g`` was, with the drafted token's embedding: the head
runs ahead of the target on its own states. Training-time test (``ttt_logits``) trains exactly that chain.

Parameter names and the checkpoint are Red Hat's ``speculators`` format (``midlayer.*``, ``fc``, ``norm``,
``lm_head``, ``d2t``, ``t2d``), which vLLM loads as ``eagle3``; ``depctl_runtime.model.eagle_format`` reads and
writes it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int  # the head's (the target's, in every head depctl trains)
    target_hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    aux_layers: tuple[int, int, int]  # the target layers whose outputs ``fc`` fuses
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048

    def to_dict(self) -> dict:
        out = asdict(self)
        out["aux_layers"] = list(self.aux_layers)
        return out

    @classmethod
    def for_target(cls, config, draft_vocab_size: int) -> EagleConfig:
        """A head shaped like one layer of the target (transformers' config of a Llama-family model)."""
        layers = config.num_hidden_layers
        heads = config.num_attention_heads
        return cls(
            hidden_size=config.hidden_size,
            target_hidden_size=config.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(config, "num_key_value_heads", heads),
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            draft_vocab_size=min(draft_vocab_size, config.vocab_size),
            aux_layers=default_aux_layers(layers),
            rms_norm_eps=getattr(config, "rms_norm_eps", 1e-5),
            rope_theta=_rope_theta(config),
            max_position_embeddings=getattr(config, "max_position_embeddings", 2048),
        )


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """Low, middle and high: the layers vLLM and SGLang read by default (2, L/2, L-3); the first, middle and last
    of a model too shallow for those (a layer may repeat)."""
    if num_layers >= 6:
        return (2, num_layers // 2, num_layers - 3)
    return (0, num_layers // 2, num_layers - 1)


def layer_outputs(model: nn.Module, input_ids: torch.Tensor, layers: tuple[int, ...]):
    """transformers' forward of ``model`` over input_ids [1, T]: its logits [1, T, vocab] and the outputs of ``layers``
    side by side [T, len(layers) * hidden], the residual stream after each layer as the fused decoder returns it
    (``output_hidden_states`` gives the last layer's after the final norm)."""
    taken = {}

    def keep(i):
        def hook(module, args, output):
            taken[i] = output[0] if isinstance(output, tuple) else output

        return hook

    handles = [model.model.layers[i].register_forward_hook(keep(i)) for i in set(layers)]
    try:
        logits = model(input_ids).logits
    finally:
        for handle in handles:
            handle.remove()
    return logits, torch.cat([taken[i].reshape(-1, taken[i].shape[-1]) for i in layers], dim=-1)


def _rope_theta(config) -> float:
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        theta = params.get("rope_theta", 10000.0) if isinstance(params, dict) else 10000.0
    return float(theta)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, c: EagleConfig):
        super().__init__()
        self.heads, self.kv_heads, self.dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, self.heads * self.dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, self.kv_heads * self.dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, self.kv_heads * self.dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.dim, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: EagleConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, c: EagleConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = _MLP(c)


class EagleHead(nn.Module):
    def __init__(self, config: EagleConfig):
        super().__init__()
        self.config = c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)  # the target's, frozen
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = _Layer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        # draft id -> target id is ``id + d2t[id]`` (speculators' convention); t2d marks the target ids drafted
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    # ---- the vocabulary map ----
    def set_vocabulary(self, target_ids: torch.Tensor) -> None:
        """Draft ids 0..n-1 stand for ``target_ids`` (sorted ascending, as speculators writes them)."""
        ids = torch.as_tensor(target_ids, dtype=torch.long).sort().values
        if ids.numel() != self.config.draft_vocab_size:
            raise ValueError(f"{ids.numel()} target ids for a draft vocabulary of {self.config.draft_vocab_size}")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def target_ids(self) -> torch.Tensor:
        """[draft_vocab] the target id of each draft id."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def draft_ids(self, target_tokens: torch.Tensor) -> torch.Tensor:
        """Target ids -> draft ids, -1 where the draft vocabulary lacks the token."""
        # the map is built once per vocabulary: a training step maps two or three sequences, and building it (a
        # scatter over the target's whole vocabulary) cost more than the lookups
        key = (self.d2t.data_ptr(), self.d2t._version)
        if getattr(self, "_lookup_key", None) != key:
            lookup = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=self.d2t.device)
            lookup[self.target_ids] = torch.arange(self.d2t.numel(), device=self.d2t.device)
            self._lookup, self._lookup_key = lookup, key
        return self._lookup[target_tokens]

    # ---- the layer ----
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """[..., 3 * target_hidden] (the aux layers' outputs side by side) -> [..., hidden]."""
        return self.fc(features)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    def _qkv(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """One step's inputs for T positions -> q [heads, T, dim], k and v [kv_heads, T, dim], and the residual."""
        layer = self.midlayer
        normed = layer.hidden_norm(hidden)
        x = torch.cat([layer.input_layernorm(self.embed_tokens(tokens)), normed], dim=-1)
        attn = layer.self_attn
        t = x.shape[0]
        q = attn.q_proj(x).view(t, attn.heads, attn.dim).transpose(0, 1)
        k = attn.k_proj(x).view(t, attn.kv_heads, attn.dim).transpose(0, 1)
        v = attn.v_proj(x).view(t, attn.kv_heads, attn.dim).transpose(0, 1)
        cos, sin = (c.to(q.dtype) for c in self._rope(positions))  # computed in float32, applied in the head's dtype
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        return q, k, v, normed  # norm_before_residual: the normed state is the residual

    def _finish(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """attended [heads, T, dim] -> the layer's output [T, hidden] (before ``norm``)."""
        layer = self.midlayer
        t = attended.shape[1]
        x = residual + layer.self_attn.o_proj(attended.transpose(0, 1).reshape(t, -1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """The layer's output -> [..., draft_vocab] logits."""
        return self.lm_head(self.norm(out))

    # ---- training-time test ----
    def ttt_logits(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor,
        steps: int,
        first: int = 0,
        context: tuple[torch.Tensor, torch.Tensor] | None = None,
        keys_out: list | None = None,
    ) -> list[torch.Tensor]:
        """Draft logits of ``steps`` chained steps over one sequence, as drafting runs them.

        tokens [T] (the sequence), features [T - 1 or more, 3 * target_hidden] (the target's aux states at each
        position). Step j at index i reads token ``tokens[i + 1 + j]`` and, for j = 0, the target's state at i; after
        that its own output of step j - 1 at i. It attends to step 0's keys at indices <= i (what the target verified)
        and to its own chain's keys at i (steps 1..j), at position i + j: the keys a draft from position i would have.
        Only indices ``>= first`` draft (earlier ones give step 0's keys, the context a draft attends to): a prompt's
        positions cost no output layer. Returns ``steps`` tensors [T - 2 - j - first, draft_vocab]; step j's row r
        (index i = first + r) predicts ``tokens[i + 2 + j]``.

        context: step 0's keys and values [kv_heads, c, dim] of indices ``0 .. c - 1`` (c <= first), computed before
        (a window of a long sequence trained after the window before it: no gradient reaches them); keys_out: a list
        that receives this call's step-0 keys and values of every index (detached), the next window's context."""
        n = tokens.shape[0] - 1
        positions = torch.arange(n, device=tokens.device)
        start = 0 if context is None else context[0].shape[1]  # indices whose keys are given
        q0, k0, v0, residual0 = self._qkv(tokens[1 + start : 1 + n], self.fuse(features[start:n]), positions[start:])
        if context is not None:
            k0, v0 = torch.cat([context[0], k0], dim=1), torch.cat([context[1], v0], dim=1)
        if keys_out is not None:
            keys_out.append((k0.detach(), v0.detach()))
        hidden = None
        chain_k, chain_v, out = [], [], []
        scale = self.config.head_dim**-0.5
        groups = self.config.num_attention_heads // self.config.num_key_value_heads
        for j in range(steps):
            m = n - j  # indices with a token to read: the last j have none
            rows = m - first
            if rows <= 1:
                break
            if j == 0:
                q, residual = q0[:, first - start : m - start], residual0[first - start : m - start]
            else:
                q, k, v, residual = self._qkv(tokens[1 + j + first : 1 + j + m], hidden[:rows], positions[first:m] + j)
                chain_k.append(k)
                chain_v.append(v)
            kk0 = k0[:, :m].repeat_interleave(groups, 0)  # [heads, m, dim]
            vv0 = v0[:, :m].repeat_interleave(groups, 0)
            scores = q @ kk0.transpose(1, 2) * scale  # [heads, rows, m]: step 0's keys, causal from index first
            sees = torch.arange(m, device=q.device)[None] <= positions[first:m, None]
            scores = scores.masked_fill(~sees, float("-inf"))
            diag = [(q * ck[:, :rows].repeat_interleave(groups, 0)).sum(-1, keepdim=True) * scale for ck in chain_k]
            weights = torch.softmax(torch.cat([scores, *diag], dim=-1), dim=-1)
            attended = weights[..., :m] @ vv0
            for s, cv in enumerate(chain_v):
                attended = attended + weights[..., m + s : m + s + 1] * cv[:, :rows].repeat_interleave(groups, 0)
            step_out = self._finish(attended, residual)
            out.append(self.logits(step_out))
            hidden = step_out  # the next step reads this step's own states
        # step j's row r predicts tokens[first + r + 2 + j]: the last row of each step has no target in the sequence
        return [logits[: n - first - j - 1] for j, logits in enumerate(out)]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
