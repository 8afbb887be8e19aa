"""OpenAI's Responses API (``POST /v1/responses``) over the chat request path.

A Responses request becomes the chat request it stands for (``to_chat``): ``instructions`` a system message,
``input`` items messages, function calls and their outputs, ``text.format`` a ``response_format`` (the same grammar
engine), function tools and ``tool_choice`` the chat ones. depctl keeps no responses: ``store`` is accepted and
nothing is stored, and ``previous_response_id`` is a 400 that says to send the conversation in ``input`` (as
stateless clients such as Codex CLI with ``store: false`` do). Hints a local model cannot honour (``reasoning``,
``include``, ``truncation``, ``service_tier``, ``prompt_cache_key``, ``client_metadata``) are ignored; built-in tools
(web search, file search, computer use) are left out of what the model is offered, and a ``tool_choice`` naming one
is refused.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from depctl_runtime.api.errors import APIError
from depctl_runtime.api.protocol import ChatCompletionRequest, Text, required_str, text_of
from depctl_runtime.api.serving import Job
from depctl_runtime.api.tools import ToolCallDelta

IGNORED_ITEMS = ("reasoning",)  # a model's earlier reasoning: nothing of it goes to this model


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class ResponsesRequest(_Body):
    model: str
    input: Text | list[dict]
    instructions: Text | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[dict] | None = None
    tool_choice: Literal["auto", "required", "none"] | dict | None = None
    parallel_tool_calls: bool = True
    text: dict | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    user: str | None = None
    metadata: dict | None = None


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    if req.previous_response_id:
        raise APIError(
            400,
            "depctl keeps no responses, so previous_response_id cannot be followed: send the whole conversation in "
            "input (function calls and their outputs included), with store false",
            param="previous_response_id",
            code="unsupported_parameter",
        )
    messages: list[dict] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
    else:
        for i, item in enumerate(req.input):
            _add_item(messages, item, f"input.{i}")
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    body.update({k: v for k, v in (("temperature", req.temperature), ("top_p", req.top_p)) if v is not None})
    if req.user:
        body["user"] = req.user
    functions = _functions(req.tools or [])
    if functions:
        body["tools"] = functions
        body["parallel_tool_calls"] = req.parallel_tool_calls
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
    fmt = (req.text or {}).get("format")
    if fmt is not None:
        body["response_format"] = _format(fmt)
    return ChatCompletionRequest.model_validate(body)


def _add_item(messages: list[dict], item: dict, where: str) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise APIError(
                400,
                f"{where}.role must be user, assistant, system or developer",
                param=f"{where}.role",
                code="invalid_value",
            )
        messages.append({"role": role, "content": _content(item.get("content"), f"{where}.content")})
    elif kind == "function_call":
        call = {
            "name": required_str(item.get("name"), f"{where}.name"),
            "arguments": required_str(item.get("arguments"), f"{where}.arguments"),
        }
        entry = {"id": required_str(item.get("call_id"), f"{where}.call_id"), "type": "function", "function": call}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(entry)  # parallel calls: one assistant turn
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [entry]})
    elif kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else _content(output, f"{where}.output")
        messages.append(
            {"role": "tool", "tool_call_id": required_str(item.get("call_id"), f"{where}.call_id"), "content": text}
        )
    elif kind in IGNORED_ITEMS:
        return
    else:
        raise APIError(
            400,
            f"{where}: input items of type {kind!r} are not supported by depctl (message, function_call and "
            "function_call_output are); remove it from the request",
            param=f"{where}.type",
            code="unsupported_value",
        )


def _content(content, where: str) -> str:
    return text_of(content, where, ("input_text", "output_text", "text"))


def _functions(tools: list[dict]) -> list[dict]:
    """The chat functions the model is offered: function tools, and those inside a ``namespace`` (a group of them,
    offered by their own names). OpenAI's built-in tools (``web_search``, ``file_search``, computer use, ...) are
    left out: a local model has none to call, and Codex CLI sends ``web_search`` with every request."""
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind == "function":
            out.append(_function(tool, f"tools.{i}"))
        elif kind == "namespace":
            out += [_function(inner, f"tools.{i}.tools.{j}") for j, inner in enumerate(tool.get("tools") or [])]
    return out


def _function(tool: dict, where: str) -> dict:
    if tool.get("type") != "function":
        raise APIError(
            400, f"{where}: a namespace holds function tools", param=f"{where}.type", code="unsupported_value"
        )
    function = {"name": required_str(tool.get("name"), f"{where}.name")}
    for key in ("description", "parameters", "strict"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


def _tool_choice(choice) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(
        400,
        "tool_choice must be auto, required, none or a function by name (depctl serves no built-in tools)",
        param="tool_choice",
        code="invalid_value",
    )


def _format(fmt: dict) -> dict:
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": schema}
    raise APIError(
        400, "text.format.type must be text, json_object or json_schema", param="text.format.type", code="invalid_value"
    )


# ---- responses ------------------------------------------------------------------------------------------------


def _usage(job: Job, counted: tuple[int, int] | None = None) -> dict:
    """``counted``: (output tokens, cached prompt tokens) as a stream counted them (its last event comes before the
    job's usage is set), else the job's."""
    usage = job.usage or {}
    prompt = len(job.request.prompt_ids)
    output = usage.get("completion_tokens", 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    if counted is not None:
        output, cached = counted
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


def _shell(job: Job, req: ResponsesRequest, status: str, output: list[dict], usage: dict | None) -> dict:
    return {
        "id": f"resp_{job.id}",
        "object": "response",
        "created_at": job.created,
        "status": status,
        "model": job.model,
        "output": output,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": None,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [],
        "text": req.text or {"format": {"type": "text"}},
        "store": False,
        "metadata": req.metadata or {},
        "usage": usage,
    }


def _text_item(job: Job, text: str) -> dict:
    return {
        "type": "message",
        "id": f"msg_{job.id}",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def _call_item(job: Job, index: int, call_id: str, name: str, arguments: str) -> dict:
    return {
        "type": "function_call",
        "id": f"fc_{job.id}_{index}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


def response(job: Job, req: ResponsesRequest, text: str, finish: str) -> dict:
    """The whole response: a message item with the text, function_call items for the calls read out of it."""
    calls: list[dict] = []
    if job.tools:
        text, calls = job.split_calls(text)
    output = []
    if text.strip() or not calls:
        output.append(_text_item(job, text.strip() if calls else text))
    for i, call in enumerate(calls):
        output.append(_call_item(job, i, call["id"], call["function"]["name"], call["function"]["arguments"]))
    status = "incomplete" if finish == "length" else "completed"
    return _shell(job, req, status, output, _usage(job))


class ResponseStream:
    """The Responses API's streaming events for one job: ``response.created`` and ``response.in_progress``, each
    output item's ``output_item.added``, its deltas (``output_text.delta`` in a content part, or
    ``function_call_arguments.delta``) and its ``.done`` events, then ``response.completed`` (or ``incomplete``)."""

    def __init__(self, job: Job, req: ResponsesRequest):
        self.job, self.req = job, req
        self.parser = job.call_parser()
        self.sequence = 0
        self.items: list[dict] = []  # finished output items
        self.open: dict | None = None  # the item being written
        self.text = ""  # the open message's text so far
        self.tokens = self.cached = 0  # output tokens, and prompt tokens read from the prefix cache

    def start(self) -> list[dict]:
        shell = _shell(self.job, self.req, "in_progress", [], None)
        return [self._event("response.created", response=shell), self._event("response.in_progress", response=shell)]

    def feed(self, delta) -> list[dict]:
        """A run of output (``backends.Delta``) as events."""
        text, finish = delta.text, delta.finish_reason
        self.tokens += delta.tokens
        self.cached += delta.cached_tokens
        events: list[dict] = []
        calls: list[ToolCallDelta] = []
        if self.parser is not None:
            text, calls = self.parser.feed_run(text, last=bool(finish))
        if text:
            if self.open is None or self.open["type"] != "message":
                events += self._close()
                events += self._open(_text_item(self.job, ""), status="in_progress")
                part = {"type": "output_text", "text": "", "annotations": []}
                events.append(self._event("response.content_part.added", **self._where(), content_index=0, part=part))
            self.text += text
            events.append(self._event("response.output_text.delta", **self._where(), content_index=0, delta=text))
        for call in calls:
            if call.id is not None:
                events += self._close()
                item = _call_item(self.job, len(self.items), call.id, call.name, "")
                events += self._open(item, status="in_progress")
            if call.arguments and self.open is not None:
                self.open["arguments"] += call.arguments
                events.append(
                    self._event("response.function_call_arguments.delta", **self._where(), delta=call.arguments)
                )
        if finish:
            events += self._close()
            status = "incomplete" if finish == "length" else "completed"
            final = _shell(self.job, self.req, status, self.items, _usage(self.job, (self.tokens, self.cached)))
            events.append(self._event(f"response.{status}", response=final))
        return events

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items)}

    def _open(self, item: dict, status: str) -> list[dict]:
        self.open, self.text = item, ""
        return [
            self._event("response.output_item.added", output_index=len(self.items), item={**item, "status": status})
        ]

    def _close(self) -> list[dict]:
        item = self.open
        if item is None:
            return []
        events = []
        if item["type"] == "message":
            part = {"type": "output_text", "text": self.text, "annotations": []}
            item["content"] = [part]
            events.append(self._event("response.output_text.done", **self._where(), content_index=0, text=self.text))
            events.append(self._event("response.content_part.done", **self._where(), content_index=0, part=part))
        else:
            events.append(
                self._event("response.function_call_arguments.done", **self._where(), arguments=item["arguments"])
            )
        events.append(self._event("response.output_item.done", output_index=len(self.items), item=item))
        self.items.append(item)
        self.open = None
        return events

    def error(self, error: APIError) -> dict:
        body = {"type": "error", "code": error.code, "message": error.message, "param": error.param}
        return {"event": "error", "data": json.dumps({**body, "sequence_number": self.sequence})}

    def _event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return {"event": kind, "data": json.dumps({"type": kind, "sequence_number": self.sequence - 1, **fields})}
