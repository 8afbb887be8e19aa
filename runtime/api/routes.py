"""HTTP routes: thin wrappers over ``Service`` (OpenAI API) and ``DeploymentManager`` (depctl's own API)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool

from runtime.api.errors import APIError
from runtime.api.protocol import ChatCompletionRequest, CompletionRequest
from runtime.api.serving import Job, Service
from runtime.manager import State

router = APIRouter()
_END = object()


def _service(request: Request) -> Service:
    return request.app.state.service


# ---- health, models, metrics --------------------------------------------------------------------------------------


@router.get("/health")
async def health(request: Request) -> dict:
    deps = request.app.state.manager.all()
    return {"status": "ok", "deployments": len(deps), "ready": sum(d.state == State.READY for d in deps)}


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    data = []
    for dep in request.app.state.manager.all():
        if dep.state in (State.READY, State.UPDATING) and dep.loaded_spec is not None:
            data.append(
                {
                    "id": dep.id,
                    "object": "model",
                    "created": int(dep.ready_at or time.time()),
                    "owned_by": "depctl",
                    "root": dep.loaded_spec.model,
                    "max_model_len": dep.loaded.max_context if dep.loaded else None,
                }
            )
    return {"object": "list", "data": data}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


# ---- completions ------------------------------------------------------------------------------------------------


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    service = _service(request)
    job = service.completion_job(body)
    return await _respond(service, job, body.stream, body.include_usage)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    service = _service(request)
    job = service.chat_job(body)
    return await _respond(service, job, body.stream, body.include_usage)


async def _respond(service: Service, job: Job, stream: bool, include_usage: bool):
    cancel = threading.Event()
    if stream:
        return EventSourceResponse(_stream(service, job, cancel, include_usage), ping=15)
    try:
        text, finish = await run_in_threadpool(service.collect, job, cancel)
    except asyncio.CancelledError:
        cancel.set()
        raise
    choice = {"index": 0, "finish_reason": finish, "logprobs": None}
    if job.kind == "chat.completion":
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {**_head(job, job.kind), "choices": [choice], "usage": job.usage}


def _head(job: Job, obj: str) -> dict:
    prefix = "chatcmpl" if job.kind == "chat.completion" else "cmpl"
    return {"id": f"{prefix}-{job.id}", "object": obj, "created": job.created, "model": job.model}


async def _stream(service: Service, job: Job, cancel: threading.Event, include_usage: bool):
    """SSE: one chunk per run of accepted tokens; usage in a last chunk when asked; then ``[DONE]``.

    The engine runs on a worker thread and hands deltas over a queue. When the client goes away, sse-starlette
    cancels this generator and the ``finally`` sets ``cancel``, which stops the engine at its next step.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    chat = job.kind == "chat.completion"
    obj = "chat.completion.chunk" if chat else "text_completion"

    def produce() -> None:
        try:
            for delta in service.run(job, cancel):
                loop.call_soon_threadsafe(queue.put_nowait, delta)
        except BaseException as exc:  # handed to the consumer, which reports it in the stream
            loop.call_soon_threadsafe(queue.put_nowait, exc)
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, _END)

    def chunk(text: str | None, finish: str | None, first: bool = False) -> str:
        if chat:
            delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        body = {**_head(job, obj), "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return json.dumps(body)

    worker = loop.run_in_executor(None, produce)
    try:
        if chat:
            yield {"data": chunk("", None, first=True)}
        while True:
            item = await queue.get()
            if item is _END:
                break
            if isinstance(item, APIError):
                yield {"data": json.dumps(item.body())}
                break
            if isinstance(item, BaseException):
                yield {"data": json.dumps(APIError(500, f"generation failed: {type(item).__name__}: {item}").body())}
                break
            if item.text or item.finish_reason:
                yield {"data": chunk(item.text, item.finish_reason)}
        if include_usage and job.usage is not None:
            yield {"data": json.dumps({**_head(job, obj), "choices": [], "usage": job.usage})}
        yield {"data": "[DONE]"}
    finally:
        cancel.set()
        await asyncio.shield(worker)


# ---- depctl's own API ---------------------------------------------------------------------------------------------


@router.get("/depctl/v1/deployments")
async def deployments(request: Request) -> list[dict]:
    return [d.status() for d in request.app.state.manager.all()]


@router.get("/depctl/v1/deployments/{deployment_id}")
async def deployment(deployment_id: str, request: Request) -> dict:
    dep = request.app.state.manager.get(deployment_id)
    if dep is None:
        raise APIError(404, f"deployment {deployment_id!r} is not known to the daemon", code="deployment_not_found")
    return dep.status()


@router.post("/depctl/v1/reconcile")
async def reconcile(request: Request) -> list[dict]:
    manager = request.app.state.manager
    await run_in_threadpool(manager.reconcile, True)
    return [d.status() for d in manager.all()]
