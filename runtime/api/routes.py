"""HTTP routes: thin wrappers over ``Service`` (OpenAI's API, Anthropic's Messages API) and ``DeploymentManager``
(depctl's own API)."""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import aclosing

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool

from depctl_runtime.api.errors import APIError
from depctl_runtime.api.guard import key_digest
from depctl_runtime.api.messages import CountTokensRequest, MessagesRequest, MessageStream, message, to_chat
from depctl_runtime.api.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from depctl_runtime.api.render import chat_logprobs, completion_logprobs
from depctl_runtime.api.responses import ResponsesRequest, ResponseStream, response
from depctl_runtime.api.responses import to_chat as to_responses_chat
from depctl_runtime.api.serving import Job, Service, named_deployment
from depctl_runtime.manager import State

router = APIRouter()
_END = object()


def _service(request: Request) -> Service:
    return request.app.state.service


# ---- health, models, metrics --------------------------------------------------------------------------------------


ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/v1/models",
    "/tokenize",
    "/detokenize",
    "/health",
    "/metrics",
)


@router.api_route("/", methods=["GET", "HEAD"])
async def root() -> dict:
    """What answers here; clients probe it before their first request (Claude Code sends ``HEAD /``)."""
    return {"name": "depctl", "status": "ok", "endpoints": list(ENDPOINTS)}


@router.get("/health")
async def health(request: Request) -> dict:
    deps = request.app.state.manager.all()
    return {"status": "ok", "deployments": len(deps), "ready": sum(d.state == State.READY for d in deps)}


def _model_card(dep) -> dict:
    return {
        "id": dep.id,
        "object": "model",
        "created": int(dep.ready_at or time.time()),
        "owned_by": "depctl",
        "root": (dep.loaded_spec or dep.spec).model,
        "max_model_len": dep.max_context,
    }


def _listed(dep) -> bool:
    if dep.state == State.IDLE:  # unloaded until a request for it arrives: still served
        return dep.spec is not None
    return dep.state in (State.READY, State.UPDATING) and dep.loaded_spec is not None


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    return {"object": "list", "data": [_model_card(d) for d in request.app.state.manager.all() if _listed(d)]}


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> dict:
    dep = named_deployment(request.app.state.manager, model)
    if not _listed(dep):
        raise APIError(
            404,
            f"model {model!r} is not served here; GET /v1/models lists those that are",
            param="model",
            code="model_not_found",
        )
    return _model_card(dep)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    await _service(request).awake(body.model)
    return await run_in_threadpool(_service(request).tokenize, body)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    await _service(request).awake(body.model)
    return await run_in_threadpool(_service(request).detokenize, body)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


# ---- completions ------------------------------------------------------------------------------------------------


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    service = _service(request)
    await service.awake(body.model)
    # tokenizing stays off the event loop
    job = await run_in_threadpool(service.completion_job, body, key_digest(request.headers))
    return await _respond(service, job, body, request)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    service = _service(request)
    await service.awake(body.model)
    job = await run_in_threadpool(service.chat_job, body, key_digest(request.headers))
    return await _respond(service, job, body, request)


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request):
    """Anthropic's Messages API: a chat job, answered in Anthropic's shapes (``api.messages``)."""
    service = _service(request)
    chat = to_chat(body)
    await service.awake(chat.model)
    job = await run_in_threadpool(service.chat_job, chat, key_digest(request.headers), True)
    await service.prepare(job)
    if body.stream:
        return EventSourceResponse(_translated_events(service, job, MessageStream(job)), ping=15)
    text, finish, _ = await _unless_disconnected(service.collect(job), request)
    return message(job, text, finish)


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request):
    """OpenAI's Responses API: a chat job, answered in the Responses API's shapes (``api.responses``)."""
    service = _service(request)
    chat = to_responses_chat(body)
    await service.awake(chat.model)
    job = await run_in_threadpool(service.chat_job, chat, key_digest(request.headers))
    await service.prepare(job)
    if body.stream:
        return EventSourceResponse(_translated_events(service, job, ResponseStream(job, body)), ping=15)
    text, finish, _ = await _unless_disconnected(service.collect(job), request)
    return response(job, body, text, finish)


async def _translated_events(service: Service, job: Job, stream):
    """A chat job's deltas as another API's events: ``stream`` (``MessageStream``, ``ResponseStream``) shapes them,
    and an error after the start (the status line has gone out) as that API's error event."""
    for event in stream.start():
        yield event
    try:
        async with aclosing(service.run(job)) as deltas:
            async for delta in deltas:
                if delta.text or delta.finish_reason:
                    for event in stream.feed(delta):
                        yield event
    except APIError as exc:
        yield stream.error(exc)
    except Exception as exc:  # noqa: BLE001
        yield stream.error(APIError(500, f"generation failed: {type(exc).__name__}: {exc}", code="internal_error"))


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request):
    service = _service(request)
    chat = to_chat(body)
    await service.awake(chat.model)
    return {"input_tokens": await run_in_threadpool(service.count_chat_tokens, chat)}


async def _respond(service: Service, job: Job, body, request: Request):
    await service.prepare(job)
    jobs = service.choices(job, body.n)
    if body.stream:
        return EventSourceResponse(_stream(service, jobs, body.include_usage), ping=15)
    results = await _unless_disconnected(_all(service.collect(j) for j in jobs), request)
    choices = [_choice(j, i, *result) for i, (j, result) in enumerate(zip(jobs, results))]
    return {**_head(job, job.kind), "choices": choices, "usage": service.total_usage(jobs)}


async def _all(coroutines) -> list:
    """Every choice's result; when one fails, the others are cancelled rather than left running to no one."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


def _choice(job: Job, index: int, text: str, finish: str, logprobs) -> dict:
    chat = job.kind == "chat.completion"
    choice = {"index": index, "finish_reason": finish, "logprobs": None}
    if job.request.params.logprobs is not None:
        choice["logprobs"] = chat_logprobs(logprobs) if chat else completion_logprobs(logprobs)
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
        if job.tools:
            choice["message"], choice["finish_reason"] = _with_calls(text, finish, job)
    else:
        choice["text"] = text
    return choice


def _with_calls(text: str, finish: str, job: Job) -> tuple[dict, str]:
    """The assistant message with the tool calls read out of ``text``, and the finish reason OpenAI gives it."""
    content, calls = job.split_calls(text)
    if not calls:
        return {"role": "assistant", "content": text}, finish
    message = {"role": "assistant", "content": content.strip() or None, "tool_calls": calls}
    return message, "tool_calls" if finish == "stop" else finish


async def _unless_disconnected(work, request: Request):
    """Await ``work`` unless the client hangs up first; then cancel it (Service.run's finally frees the batch row).
    uvicorn does not cancel a handler whose client went away, so a non-streaming request watches for it itself."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise APIError(499, "the client closed the connection", code="client_closed")  # (nobody reads this)
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _head(job: Job, obj: str) -> dict:
    prefix = "chatcmpl" if job.kind == "chat.completion" else "cmpl"
    return {"id": f"{prefix}-{job.id}", "object": obj, "created": job.created, "model": job.model}


class _ChoiceStream:
    """One choice's chunks: its index, its tool-call parser and where its text has got to."""

    def __init__(self, job: Job, index: int, include_usage: bool):
        self.job, self.index, self.include_usage = job, index, include_usage
        self.chat = job.kind == "chat.completion"
        self.obj = "chat.completion.chunk" if self.chat else "text_completion"
        self.with_logprobs = job.request.params.logprobs is not None
        self.parser = job.call_parser()
        self.offset = 0  # where the next chunk's text starts (completions' text_offset)

    def chunk(self, text: str | None, finish: str | None, first: bool = False, logprobs=()) -> str | None:
        """The chunk for a run of output; None where there is nothing to send yet (text a tool call holds back)."""
        shown = None
        if self.with_logprobs and not first:
            shown = chat_logprobs(logprobs) if self.chat else completion_logprobs(logprobs, self.offset)
        if self.chat:
            calls, parser = [], self.parser
            if parser is not None and not first:
                text, calls = parser.feed_run(text or "", last=bool(finish))
                if finish:
                    finish = "tool_calls" if parser.calls and finish == "stop" else finish
            delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            if calls:
                delta["tool_calls"] = [c.to_dict() for c in calls]
            if not (first or delta or finish or shown):
                return None
            choice = {"index": self.index, "delta": delta, "finish_reason": finish, "logprobs": shown}
        else:
            choice = {"index": self.index, "text": text or "", "finish_reason": finish, "logprobs": shown}
            self.offset += len(text or "")
        body = {**_head(self.job, self.obj), "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return json.dumps(body)


async def _stream(service: Service, jobs: list[Job], include_usage: bool):
    """SSE: one chunk per run of accepted tokens of each choice (``index`` says which); usage in a last chunk when
    asked; then ``[DONE]``.

    When the client goes away, sse-starlette cancels this generator; the choices' tasks are cancelled with it, and
    closing ``service.run`` cancels each request, which leaves the batch at the engine's next step.
    """
    streams = [_ChoiceStream(job, i, include_usage) for i, job in enumerate(jobs)]
    if streams[0].chat:
        for s in streams:
            yield {"data": s.chunk("", None, first=True)}
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(s: _ChoiceStream) -> None:
        try:
            async with aclosing(service.run(s.job)) as deltas:
                async for item in deltas:
                    await queue.put((s, item))
            await queue.put((s, _END))
        except BaseException as exc:  # noqa: BLE001 - handed to the stream, which reports it
            await queue.put((s, exc))
            if isinstance(exc, asyncio.CancelledError):
                raise

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    failed = None
    try:
        running = len(tasks)
        while running:
            s, item = await queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, BaseException):
                failed = item
                break
            elif item.text or item.finish_reason or item.logprobs:
                chunk = s.chunk(item.text, item.finish_reason, logprobs=item.logprobs)
                if chunk is not None:
                    yield {"data": chunk}
    finally:
        for task in tasks:
            task.cancel()
    if isinstance(failed, APIError):
        yield {"data": json.dumps(failed.body())}
    elif failed is not None:  # reported in the stream: the status line has already gone out
        message = f"generation failed: {type(failed).__name__}: {failed}"
        yield {"data": json.dumps(APIError(500, message, code="internal_error").body())}
    elif include_usage:
        usage = service.total_usage(jobs)
        if usage is not None:
            yield {"data": json.dumps({**_head(jobs[0], streams[0].obj), "choices": [], "usage": usage})}
    yield {"data": "[DONE]"}


# ---- depctl's own API ---------------------------------------------------------------------------------------------


async def _statuses(deps) -> list[dict]:
    # a vLLM deployment's status reads its server's counters over HTTP: never on the event loop
    return await run_in_threadpool(lambda: [d.status() for d in deps])


@router.get("/depctl/v1/deployments")
async def deployments(request: Request) -> list[dict]:
    return await _statuses(request.app.state.manager.all())


@router.get("/depctl/v1/deployments/{deployment_id}")
async def deployment(deployment_id: str, request: Request) -> dict:
    dep = request.app.state.manager.get(deployment_id)
    if dep is None:
        raise APIError(404, f"deployment {deployment_id!r} is not known to the daemon", code="deployment_not_found")
    return (await _statuses([dep]))[0]


@router.post("/depctl/v1/deployments/{deployment_id}/wake")
async def wake(deployment_id: str, request: Request) -> dict:
    """Load an IDLE deployment again now (as its next request would) and return its status without waiting: the CLI
    shows the load's stages while it runs, and its first request then waits for no load."""
    manager = request.app.state.manager
    dep = manager.get(deployment_id)
    if dep is None:
        raise APIError(404, f"deployment {deployment_id!r} is not known to the daemon", code="deployment_not_found")
    if dep.state == State.IDLE:
        manager.touch(dep)
        await run_in_threadpool(manager.wake, dep)
    return (await _statuses([dep]))[0]


@router.post("/depctl/v1/reconcile")
async def reconcile(request: Request) -> list[dict]:
    manager = request.app.state.manager
    await run_in_threadpool(manager.reconcile, True)
    return await _statuses(manager.all())
