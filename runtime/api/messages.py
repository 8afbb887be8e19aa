"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) over the chat request path.

A Messages request becomes a chat request (``to_chat``): the same job, engine and speculation, so the output is
what chat completions would give for the same conversation. What a local model cannot honour but a client sends
as a hint (``thinking``, ``context_management``, ``output_config``, ``cache_control`` on blocks, ``service_tier``)
is accepted and ignored; what would change the answer and depctl cannot do (images, documents, server tools) is a
400 naming it. ``max_tokens`` is required, as Anthropic requires it, and cut to what the context leaves (clients
send 32000 whatever the model), ending with ``stop_reason: max_tokens``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from depctl_runtime.api.errors import APIError
from depctl_runtime.api.protocol import MAX_STOP_STRINGS, ChatCompletionRequest, Text, required_str, text_of
from depctl_runtime.api.serving import Job
from depctl_runtime.api.tools import ToolCallDelta

IGNORED_BLOCKS = ("thinking", "redacted_thinking")  # a model's earlier reasoning: nothing of it goes to this model
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class Metadata(_Body):
    user_id: str | None = None


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Message(_Body):
    role: Literal["user", "assistant", "system"]  # Claude Code sends system turns inside the conversation
    content: Text | list[dict]


class MessagesRequest(_Body):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: Text | list[dict] | None = None
    stop_sequences: list[Text] | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    metadata: Metadata | None = None
    tools: list[dict] | None = None
    tool_choice: ToolChoice | None = None


class CountTokensRequest(_Body):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: Text | list[dict] | None = None
    tools: list[dict] | None = None


def to_chat(req: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat request a Messages request stands for."""
    messages: list[dict] = []
    system = _without_billing_header(req.system)
    if system:
        messages.append({"role": "system", "content": _text(system, "system")})
    for i, message in enumerate(req.messages):
        messages.extend(_chat_messages(message, f"messages.{i}.content"))
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.tools:
        body["tools"] = [_function(tool, i) for i, tool in enumerate(req.tools)]
    if isinstance(req, MessagesRequest):
        body["max_tokens"] = req.max_tokens
        body.update({k: v for k, v in (("temperature", req.temperature), ("top_p", req.top_p)) if v is not None})
        if req.top_k:
            body["top_k"] = req.top_k
        if req.stop_sequences:
            body["stop"] = list(req.stop_sequences)
        if req.metadata is not None and req.metadata.user_id:
            body["user"] = req.metadata.user_id
        choice = req.tool_choice
        if choice is not None:
            if choice.type == "tool" and not choice.name:
                raise APIError(400, "tool_choice of type tool needs a name", param="tool_choice", code="invalid_value")
            named = {"type": "function", "function": {"name": choice.name}}
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type, named)
            body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return ChatCompletionRequest.model_validate(body)


def _chat_messages(message: Message, where: str) -> list[dict]:
    """One Messages turn as chat messages: a user turn's tool results become tool messages (before its text), an
    assistant turn's tool_use blocks its tool_calls."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts, calls, results = [], [], []
    for j, block in enumerate(message.content):
        kind = block.get("type")
        if kind == "text":
            texts.append(required_str(block.get("text"), f"{where}.{j}.text"))
        elif kind == "tool_use" and message.role == "assistant":
            call = {
                "name": required_str(block.get("name"), f"{where}.{j}.name"),
                "arguments": json.dumps(block.get("input")),
            }
            calls.append({"id": required_str(block.get("id"), f"{where}.{j}.id"), "type": "function", "function": call})
        elif kind == "tool_result" and message.role == "user":
            content = block.get("content")
            text = "" if content is None else _text(content, f"{where}.{j}.content")
            if block.get("is_error"):
                text = f"Error: {text}"
            results.append(
                {
                    "role": "tool",
                    "tool_call_id": required_str(block.get("tool_use_id"), f"{where}.{j}"),
                    "content": text,
                }
            )
        elif kind in IGNORED_BLOCKS:
            continue
        else:
            raise APIError(
                400,
                f"{where}.{j}: content blocks of type {kind!r} are not supported by depctl (text, tool_use and "
                "tool_result are); remove it from the request",
                param=f"{where}.{j}.type",
                code="unsupported_value",
            )
    out = list(results)
    if texts or calls or not results:
        turn: dict[str, Any] = {"role": message.role, "content": "".join(texts)}
        if calls:
            turn["tool_calls"] = calls
        out.append(turn)
    return out


BILLING_HEADER = "x-anthropic-billing-header:"


def _without_billing_header(system: str | list | None) -> str | list | None:
    """The system prompt without Claude Code's billing header block, which means nothing to a model and whose hash
    changes with every request: at the front of the prompt it would leave the prefix cache nothing to find (as
    llama.cpp's server also drops it)."""
    if not isinstance(system, list):
        return system
    return [b for b in system if not (isinstance(b, dict) and str(b.get("text", "")).startswith(BILLING_HEADER))]


def _text(content: str | list, where: str) -> str:
    """A string or text blocks (the system prompt's joined by newlines, as Anthropic joins them)."""
    return text_of(content, where, ("text",), "\n" if where == "system" else "")


def _function(tool: dict, i: int) -> dict:
    """A custom tool as a chat function; server tools (a ``type`` such as web_search_20250305) are refused."""
    kind = tool.get("type", "custom")
    if kind != "custom":
        raise APIError(
            400,
            f"tools.{i}: tools of type {kind!r} run on Anthropic's servers and are not supported by depctl; "
            "send custom tools (name, description, input_schema)",
            param=f"tools.{i}.type",
            code="unsupported_value",
        )
    function = {"name": required_str(tool.get("name"), f"tools.{i}.name"), "parameters": tool.get("input_schema")}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


# ---- responses ------------------------------------------------------------------------------------------------


def _usage(job: Job, output_tokens: int, cached: int | None = None) -> dict:
    """Anthropic counts prompt tokens read from a cache apart from ``input_tokens``. ``cached``: as counted so far
    (a stream's last event comes before the job's usage is set), else the job's."""
    prompt = len(job.request.prompt_ids)
    if cached is None:
        cached = ((job.usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output_tokens,
    }


def _stop(job: Job, finish: str, called: bool) -> tuple[str, str | None]:
    if job.stop is not None:
        return "stop_sequence", job.stop
    if called and finish == "stop":
        return "tool_use", None
    return STOP_REASONS.get(finish, "end_turn"), None


def message(job: Job, text: str, finish: str) -> dict:
    """The whole response: text and tool_use blocks."""
    content: list[dict] = []
    calls: list[dict] = []
    if job.tools:
        text, calls = job.split_calls(text)
    blocks = []
    for call in calls:
        try:
            arguments = call["function"]["arguments"]
            tool_input = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:  # a call cut short (max_tokens): its text, never a call a client cannot parse
            text += arguments
            continue
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": tool_input})
    if text.strip() or not blocks:
        content.append({"type": "text", "text": text.strip() if blocks else text})
    content.extend(blocks)
    reason, sequence = _stop(job, finish, bool(blocks))
    return {
        "id": f"msg_{job.id}",
        "type": "message",
        "role": "assistant",
        "model": job.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": _usage(job, (job.usage or {}).get("completion_tokens", 0)),
    }


class MessageStream:
    """Anthropic's streaming events for one job: ``message_start``, a ``ping``, then each content block's
    ``content_block_start``, deltas (``text_delta``, ``input_json_delta``) and ``content_block_stop``, then
    ``message_delta`` (stop reason, output tokens) and ``message_stop``."""

    def __init__(self, job: Job):
        self.job = job
        self.parser = job.call_parser()
        self.index = -1  # the open block's index
        self.open: str | None = None  # "text", "tool_use" or None
        self.called = False
        self.tokens = 0  # output tokens so far
        self.cached = 0  # prompt tokens read from the prefix cache

    def start(self) -> list[dict]:
        head = {
            "id": f"msg_{self.job.id}",
            "type": "message",
            "role": "assistant",
            "model": self.job.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {**_usage(self.job, 0), "cache_read_input_tokens": 0},
        }
        return [_event("message_start", message=head), _event("ping")]

    def feed(self, delta) -> list[dict]:
        """A run of output (``backends.Delta``) as events."""
        text, finish = delta.text, delta.finish_reason
        self.tokens += delta.tokens
        self.cached += delta.cached_tokens
        events = []
        calls: list[ToolCallDelta] = []
        if self.parser is not None:
            text, calls = self.parser.feed_run(text, last=bool(finish))
        if text:
            events += self._open("text", {"type": "text", "text": ""})
            events.append(_event("content_block_delta", index=self.index, delta={"type": "text_delta", "text": text}))
        for call in calls:
            if call.id is not None:
                self.called = True
                block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
                events += self._open("tool_use", block, new=True)
            if call.arguments:
                delta = {"type": "input_json_delta", "partial_json": call.arguments}
                events.append(_event("content_block_delta", index=self.index, delta=delta))
        if finish:
            events += self._close()
            reason, sequence = _stop(self.job, finish, self.called)
            usage = _usage(self.job, self.tokens, self.cached)  # the whole usage: the SDKs take each field
            events.append(
                _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence}, usage=usage)
            )
            events.append(_event("message_stop"))
        return events

    def _open(self, kind: str, block: dict, new: bool = False) -> list[dict]:
        if self.open == kind and not new:
            return []
        events = self._close()
        self.index += 1
        self.open = kind
        return [*events, _event("content_block_start", index=self.index, content_block=block)]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", index=self.index)]

    @staticmethod
    def error(error: APIError) -> dict:
        return {"event": "error", "data": json.dumps(error.anthropic_body())}


def _event(kind: str, **fields) -> dict:
    """An SSE event as sse-starlette sends it: Anthropic names each event and repeats the name as ``type``."""
    return {"event": kind, "data": json.dumps({"type": kind, **fields})}
