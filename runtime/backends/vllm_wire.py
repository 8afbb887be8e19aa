"""What goes over HTTP between the daemon and a vLLM server: a request as the body of vLLM's completions endpoint,
its streamed answer's pieces, its errors in depctl's envelope, and its Prometheus metrics as depctl's speculation
counters."""

from __future__ import annotations

import json

from depctl_runtime.backends.base import BackendError, GenerateRequest, Logprob
from depctl_runtime.backends.structured import vllm_structured_outputs
from depctl_runtime.speculation.params import cache_scope

METRICS_TTL = 1.0  # seconds a reading of the server's metrics is reused


def parse_metrics(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {}
    per_pos: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
                pos = int(sample.labels.get("position", 0))
                per_pos[pos] = per_pos.get(pos, 0) + sample.value
            elif sample.name.startswith("vllm:") and not sample.name.endswith(("_created", "_bucket")):
                out[sample.name] = out.get(sample.name, 0) + sample.value
    if per_pos:
        out["vllm:spec_decode_num_accepted_tokens_per_pos_total"] = [per_pos[p] for p in sorted(per_pos)]
    return out


def stats_from_metrics(m: dict) -> dict:
    """vLLM's counters in the shape of depctl's engine stats (``deployment get`` shows both the same way)."""
    drafts = int(m.get("vllm:spec_decode_num_drafts_total", 0))
    draft_tokens = int(m.get("vllm:spec_decode_num_draft_tokens_total", 0))
    accepted = int(m.get("vllm:spec_decode_num_accepted_tokens_total", 0))
    return {
        "source": "vllm",
        "requests": int(m.get("vllm:request_success_total", 0)),
        "generated_tokens": int(m.get("vllm:generation_tokens_total", 0)),
        "prompt_tokens": int(m.get("vllm:prompt_tokens_total", 0)),
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / draft_tokens, 4) if draft_tokens else None,
        # as vLLM defines it: tokens a verify step yields, the bonus token included
        "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
        "accepted_per_position": [int(v) for v in m.get("vllm:spec_decode_num_accepted_tokens_per_pos_total", [])],
        "decode_tokens_per_second": None,
    }


def parse_logprobs(body: dict | None) -> tuple[Logprob, ...]:
    """vLLM's completions logprobs (``tokens``, ``token_logprobs``, ``top_logprobs``) as ``Logprob``s."""
    if not body:
        return ()
    tops = body.get("top_logprobs") or [None] * len(body.get("tokens") or ())
    return tuple(
        Logprob(token, token.encode(), lp, tuple((t, t.encode(), v) for t, v in (top or {}).items()))
        for token, lp, top in zip(body.get("tokens") or (), body.get("token_logprobs") or (), tops)
    )


def upstream_error(status: int, content: bytes) -> BackendError:
    """vLLM's error, in depctl's terms: ``{"error": {...}}`` (current) or ``{"object": "error", ...}`` (older)."""
    try:
        body = json.loads(content)
    except ValueError:
        body = {}
    err = body.get("error") if isinstance(body.get("error"), dict) else body
    message = err.get("message") or content.decode(errors="replace")[:500] or f"vLLM answered {status}"
    status = status if status in (400, 404, 413, 422, 429, 500, 503) else (400 if 400 <= status < 500 else 500)
    if status == 422:
        status = 400
    code = err.get("code") if isinstance(err.get("code"), str) else None
    return BackendError(status, message, code=code, param=err.get("param"))


def completion_payload(model: str, request: GenerateRequest) -> dict:
    """The request as the body of vLLM's ``/v1/completions``, streamed: the prompt as token ids (the chat template
    is already applied), sampling, stops, penalties, logprobs and the constraint in vLLM's own fields."""
    sampling, params = request.params.sampling, request.params
    payload = {
        "model": model,
        "prompt": request.prompt_ids,
        "max_tokens": params.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": params.ignore_eos,
        "cache_salt": cache_scope(params),  # vLLM's prefix cache, kept apart per tenant as ours is
    }
    if sampling.top_k:
        payload["top_k"] = sampling.top_k
    if sampling.seed is not None:
        payload["seed"] = sampling.seed
    if request.stops:
        payload["stop"] = list(request.stops)
    if request.shown_tokens:  # vLLM shows special tokens all or none: a tool format's marker needs them shown
        payload["skip_special_tokens"] = False
    if request.constraint is not None:
        payload["structured_outputs"] = vllm_structured_outputs(request.constraint)
    penalties = params.penalties
    if penalties.active:
        payload["presence_penalty"] = penalties.presence
        payload["frequency_penalty"] = penalties.frequency
        payload["repetition_penalty"] = penalties.repetition
        if penalties.logit_bias:
            payload["logit_bias"] = {str(t): b for t, b in penalties.logit_bias}
    if params.logprobs is not None:
        payload["logprobs"] = params.logprobs
    return payload
