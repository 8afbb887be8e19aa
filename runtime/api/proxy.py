"""Requests for a ``--engine vllm`` deployment: validated here like any other, then answered by its vLLM server.

A client cannot tell which engine answered except by ``deployment get``: the request passes the same validation
(``check_supported``, the same 400s), the response carries depctl's ids and echoes the ``model`` the client sent,
and every error, vLLM's included, comes back in OpenAI's envelope with depctl's wording where depctl has one.
The server listens on loopback with a key only the daemon knows, so the daemon's own auth is the only way in.

Streams are passed through chunk by chunk; usage is always asked of vLLM (for the daemon's metrics) and dropped
again when the client did not ask for it. A client that goes away closes the upstream request, which vLLM aborts.
"""

from __future__ import annotations

import json
import time
from contextlib import aclosing

import httpx
from fastapi import Request
from sse_starlette.sse import EventSourceResponse

from runtime.api.errors import APIError
from runtime.api.protocol import ChatCompletionRequest, CompletionRequest
from runtime.api.serving import Job
from runtime.manager import Deployment

# extensions vLLM does not take: a prediction and per-request speculation control are speed hints, never the output
_DEPCTL_ONLY = {"speculate", "speculation", "prediction"}


class Proxy:
    def __init__(self):
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:  # made on the event loop that uses it
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def forward(self, job: Job, body: ChatCompletionRequest | CompletionRequest, request: Request,
                      metrics, unless_disconnected):
        dep = job.dep
        server = dep.server
        if server is None or not server.ready:
            raise APIError(503, f"deployment {dep.id!r} is {dep.state.value}: its vLLM server is not up",
                           code="deployment_not_ready")
        chat = isinstance(body, ChatCompletionRequest)
        endpoint = "chat" if chat else "completions"
        payload = body.model_dump(exclude_unset=True, exclude=_DEPCTL_ONLY)
        payload["model"] = dep.id  # the served name
        payload["max_tokens"] = job.params.max_tokens  # as depctl resolved it (a chat's default, within the context)
        payload.pop("max_completion_tokens", None)
        client_usage = body.include_usage
        if body.stream:
            payload["stream_options"] = {**payload.get("stream_options", {}), "include_usage": True}
        ids = _Ids(chat, body.model, job.id)
        url = f"{server.url}/v1/{'chat/completions' if chat else 'completions'}"
        t0 = time.perf_counter()
        if not body.stream:
            response = await unless_disconnected(self._post(url, payload, server.headers, dep), request)
            out = ids.rewrite(response)
            usage = out.get("usage") or {}
            metrics.observe_request(dep.id, endpoint, "ok", usage.get("prompt_tokens", 0),
                                    usage.get("completion_tokens", 0), None, time.perf_counter() - t0)
            return out
        upstream = await self._open_stream(url, payload, server.headers, dep)
        return EventSourceResponse(self._relay(upstream, ids, client_usage, dep, endpoint, metrics, t0), ping=15)

    async def _post(self, url: str, payload: dict, headers: dict, dep: Deployment) -> dict:
        try:
            response = await self.client.post(url, json=payload, headers=headers)
        except httpx.HTTPError as exc:
            raise _unreachable(dep, exc) from None
        if response.status_code != 200:
            raise _upstream_error(response.status_code, response.content)
        return response.json()

    async def _open_stream(self, url: str, payload: dict, headers: dict, dep: Deployment) -> httpx.Response:
        try:
            upstream = await self.client.send(self.client.build_request("POST", url, json=payload, headers=headers),
                                              stream=True)
        except httpx.HTTPError as exc:
            raise _unreachable(dep, exc) from None
        if upstream.status_code != 200:  # before any chunk: the client gets a plain error response
            content = await upstream.aread()
            await upstream.aclose()
            raise _upstream_error(upstream.status_code, content)
        return upstream

    async def _relay(self, upstream: httpx.Response, ids: "_Ids", client_usage: bool, dep: Deployment, endpoint: str,
                     metrics, t0: float):
        first_at, usage, status = None, {}, "error"
        try:
            async with aclosing(upstream.aiter_lines()) as lines:
                async for line in lines:
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        status = "ok"
                        break
                    chunk = json.loads(data)
                    if "error" in chunk or chunk.get("object") == "error":
                        yield {"data": json.dumps(_upstream_error(500, data.encode()).body())}
                        continue
                    if first_at is None:
                        first_at = time.perf_counter()
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    if not chunk.get("choices") and chunk.get("usage"):
                        if client_usage:
                            yield {"data": json.dumps(ids.rewrite(chunk))}
                        continue
                    if not client_usage:
                        chunk.pop("usage", None)
                    elif "usage" in chunk:
                        chunk["usage"] = None  # as depctl's engine streams: usage only in the last chunk
                    yield {"data": json.dumps(ids.rewrite(chunk))}
        except httpx.HTTPError as exc:
            yield {"data": json.dumps(_unreachable(dep, exc).body())}
        finally:
            await upstream.aclose()
            metrics.observe_request(dep.id, endpoint, status, usage.get("prompt_tokens", 0),
                                    usage.get("completion_tokens", 0),
                                    None if first_at is None else first_at - t0, time.perf_counter() - t0)
        yield {"data": "[DONE]"}


class _Ids:
    """depctl's response id and the client's own ``model`` string on every chunk of one response."""

    def __init__(self, chat: bool, model: str, job_id: str):
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{job_id}"
        self.model = model

    def rewrite(self, body: dict) -> dict:
        """depctl's id and the client's model; only the fields depctl's own engine sends (vLLM adds its own)."""
        out = {k: body[k] for k in _TOP if k in body}
        out["id"], out["model"] = self.id, self.model
        out["choices"] = [{k: c[k] for k in _CHOICE if k in c} for c in body.get("choices") or ()]
        for choice in out["choices"]:
            for key in ("message", "delta"):
                if isinstance(choice.get(key), dict):
                    choice[key] = {k: v for k, v in choice[key].items() if k in ("role", "content")}
        if isinstance(out.get("usage"), dict):
            out["usage"] = {k: v for k, v in out["usage"].items() if k in _USAGE}
        return out


_TOP = ("id", "object", "created", "model", "choices", "usage")
_CHOICE = ("index", "message", "delta", "text", "finish_reason", "logprobs")
_USAGE = ("prompt_tokens", "completion_tokens", "total_tokens")


def _unreachable(dep: Deployment, exc: Exception) -> APIError:
    return APIError(503, f"deployment {dep.id!r}: its vLLM server did not answer ({type(exc).__name__}); "
                         "`depctl deployment get` shows its state", code="deployment_not_ready")


def _upstream_error(status: int, content: bytes) -> APIError:
    """vLLM's error, in depctl's envelope: ``{"error": {...}}`` (current) or ``{"object": "error", ...}`` (older)."""
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
    return APIError(status, message, param=err.get("param"), code=code)
