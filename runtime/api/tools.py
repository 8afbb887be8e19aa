"""Tool calls: tools rendered by the model's own chat template, its tool-call format parsed back into OpenAI
``tool_calls``, and ``tool_choice`` "required" or a named function constrained by a grammar built from the functions'
JSON schemas (which also makes every forced key and tag a free draft).

One format is understood today, the one Qwen2.5, Hermes and many fine-tunes write:
``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, one block per call. A model whose template never
renders tools is asked for the same blocks by a system message that describes the tools (``prompted``), as
llama.cpp's generic format does, so every chat model can call tools; the grammar holds it to them where a call is
required.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from depctl_runtime.api.errors import APIError
from depctl_runtime.backends import Constraint
from depctl_runtime.speculation.params import JSON_OPTIONS

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# a call's head; its arguments are "arguments" (Hermes, Qwen2.5) or "parameters" (Llama 3.1's template asks for it)
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
HOLD = len(CLOSE) + 8  # characters of a call held back while streaming: the wrapper's "}" and a partial close tag


def template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return template if isinstance(template, str) else "\n".join(str(t) for t in template.values())


@dataclass(frozen=True)
class ToolFormat:
    """How a model family writes a call: between ``OPEN`` and ``CLOSE`` tags or as a bare JSON object, the key its
    arguments go under, and whether it writes more than one call an answer."""

    tagged: bool
    arguments: str
    parallel: bool


HERMES = ToolFormat(True, "arguments", True)  # Qwen2.5, Hermes; and models told it (``prompted``)
LLAMA3 = ToolFormat(False, "parameters", False)  # Llama 3.1-3.3's template: one bare object


def renders_tools(tokenizer) -> bool:
    """Whether the model's chat template renders ``tools`` itself (else ``prompted`` describes them)."""
    return "tools" in template_text(tokenizer)


def tool_format(tokenizer, deployment: str) -> ToolFormat:
    """The call format of the model's family (a template that never renders tools is told HERMES's); a 400 naming
    the deployment where its template asks for calls in a format depctl does not read."""
    template = template_text(tokenizer)
    if "tools" not in template or OPEN in template:
        return HERMES
    if '"parameters": ' in template:
        return LLAMA3
    raise APIError(
        400,
        f"deployment {deployment!r}: its model writes tool calls in a format depctl does not parse yet "
        f'(depctl reads {OPEN}...{CLOSE} blocks and Llama 3\'s bare {{"name", "parameters"}} objects)',
        param="tools",
        code="tools_unsupported",
    )


def _tag(tokenizer, text: str) -> str:
    """A Lark terminal for ``text``: the model's own single token when it has one (the model writes that token, not
    the characters spelled out), else the string."""
    ids = tokenizer.convert_tokens_to_ids([text])
    if ids and isinstance(ids[0], int) and ids[0] != tokenizer.unk_token_id and tokenizer.decode(ids) == text:
        return f"<[{ids[0]}]>"
    return json.dumps(text)


def call_schema(functions: list[dict], key: str = "arguments") -> dict:
    """The JSON of one call to any of ``functions`` (OpenAI tool ``function`` objects), keys in the model's order;
    ``key``: what its family names the arguments."""
    options = []
    for fn in functions:
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, key: params},
                "required": ["name", key],
                "additionalProperties": False,
            }
        )
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    # lenient: a keyword the grammar cannot enforce (propertyNames, in Claude Code's tools) is left unenforced; a
    # client's tools must never turn its requests into 400s
    return {**schema, "x-guidance": {**JSON_OPTIONS, "lenient": True}}


def tool_constraint(
    tokenizer, functions: list[dict], parallel: bool, param: str, lazy: bool = False, fmt: ToolFormat = HERMES
) -> Constraint | None:
    """The output is one call (or, with ``parallel`` where the family writes several, one or more) to
    ``functions``, in the model's format ``fmt``.

    ``lazy`` (tool_choice "auto"): the output is free text, and the grammar starts where the model writes the call
    tag (llguidance's lazy rule: free text up to the tag's first appearance), so every call it writes names an
    offered function with arguments that match its schema; text may follow a call. A family without tags has no
    such trigger (any JSON in the text would set it off): None, auto runs unconstrained there."""
    if not fmt.tagged:
        if lazy:
            return None
        return Constraint("grammar", f"start: %json {json.dumps(call_schema(functions, fmt.arguments))}", param)
    body = f'"\\n" %json {json.dumps(call_schema(functions))} "\\n" {_tag(tokenizer, CLOSE)}'
    if not lazy:
        # a model ends its last call with a newline as often as with its end token: let it end after one
        start = 'start: call ("\\n" call)* "\\n"?' if parallel else 'start: call "\\n"?'
        return Constraint("grammar", f"{start}\ncall: {_tag(tokenizer, OPEN)} {body}", param)
    opening = _tag(tokenizer, OPEN)
    if opening.startswith("<["):  # the model's own token: text cannot spell it, so no lazy rule is needed
        rules = f"call: TEXT {opening} {body}"
    else:
        rules = f"call: trigger {body}\ntrigger[lazy]: TEXT {opening}"
    start = "start: call* TEXT" if parallel else "start: call? TEXT"
    return Constraint("grammar", f"%llguidance {{}}\n{start}\n{rules}\nTEXT: /(.|\\n)*/", param, optional=True)


TOOLS_PROMPT = """You can call functions to answer. Each one, with the JSON schema of its arguments:
{functions}

To call a function, reply with only this, one block per call:
<tool_call>
{{"name": "<the function's name>", "arguments": <its arguments, a JSON object>}}
</tool_call>
Each result comes back in a <tool_response> block. When you need no call, answer in plain text."""


def prompted(turns: list[dict], functions: list[dict]) -> list[dict]:
    """``turns`` (as ``history`` gives them) for a template that never renders tools: ``functions`` described in the
    system message, an assistant's earlier calls written as the blocks it is asked for, and tool results as one user
    turn of ``<tool_response>`` blocks (such templates know no tool role, and some refuse two turns of one role)."""
    described = TOOLS_PROMPT.format(functions="\n".join(json.dumps(f, ensure_ascii=False) for f in functions))
    out: list[dict] = []
    results = False  # the last turn out is tool results (the next result joins it)
    for turn in turns:
        role, content = turn["role"], turn.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if results:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            results = True
            continue
        results = False
        if role == "assistant" and turn.get("tool_calls"):
            calls = [
                {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in turn["tool_calls"]
            ]
            blocks = [f"{OPEN}\n{json.dumps(call, ensure_ascii=False)}\n{CLOSE}" for call in calls]
            out.append({"role": "assistant", "content": "\n".join(([content] if content else []) + blocks)})
        else:
            out.append(turn)
    if out and out[0]["role"] == "system":
        return [{**out[0], "content": f"{described}\n\n{out[0]['content']}"}, *out[1:]]
    return [{"role": "system", "content": described}, *out]


def history(messages) -> list[dict]:
    """Chat messages as chat templates read them: an assistant's ``tool_calls`` with their arguments as objects
    (templates write them with ``tojson``), a tool's reply with its ``tool_call_id``."""
    out = []
    for m in messages:
        # OpenAI's developer role is the system role of newer models; templates know only system (Qwen2.5's drops
        # a turn of a role it does not know)
        msg: dict = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            calls = []
            for call in m.tool_calls:
                fn = call.function
                try:
                    arguments = json.loads(fn.arguments) if isinstance(fn.arguments, str) else fn.arguments
                except json.JSONDecodeError:
                    raise APIError(
                        400,
                        f"messages: the arguments of tool call {call.id!r} are not JSON: {fn.arguments[:80]!r}",
                        param="messages",
                        code="invalid_value",
                    ) from None
                calls.append({"id": call.id, "type": "function", "function": {"name": fn.name, "arguments": arguments}})
            msg["tool_calls"] = calls
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        if m.name:
            msg["name"] = m.name
        out.append(msg)
    return out


# ---- reading calls back out of the output ---------------------------------------------------------------------
@dataclass
class ToolCallDelta:
    """A piece of a streamed tool call, in OpenAI's chunk form: the first carries id and name."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_dict(self) -> dict:
        out: dict = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function", function={"name": self.name, "arguments": self.arguments})
        else:
            out["function"] = {"arguments": self.arguments}
        return out


@dataclass
class _Call:
    id: str
    name: str | None = None
    body: str = ""  # the text after OPEN
    args_from: int = -1  # where the arguments start in ``body`` (-1: header not read yet)
    sent: int = 0  # characters of the arguments already streamed
    cut: bool = False  # the output ended inside it (max_tokens): no close tag
    opening: str = OPEN  # what came before ``body``: the tag, or for a call without tags its fence (if any)
    braces: _Braces | None = None  # a call without tags: it ends where its object closes


@dataclass
class _Braces:
    """Where a JSON object written piece by piece closes: its depth outside strings, over the text seen so far."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    seen: int = 0

    def close(self, text: str) -> int:
        """The index just past the object's closing brace in ``text`` (which only grows between calls), or -1."""
        for i in range(self.seen, len(text)):
            ch = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch == "{":
                self.depth += 1
            elif ch == "}":
                self.depth -= 1
                if self.depth == 0:
                    self.seen = i + 1
                    return i + 1
        self.seen = len(text)
        return -1


@dataclass
class ToolCallParser:
    """Splits the output into content and tool calls as it arrives: ``feed`` returns (content, call deltas).

    Small models often skip the tags and answer with the call's JSON alone, bare or in a ```json fence. Once such an
    output has shown ``{"name": <one of names>, "arguments":`` it streams as a call, which ends where its object
    closes; any other output that begins like that (a list of calls, keys in another order) is held until it ends,
    and returned as calls if it then is one.
    """

    names: frozenset[str] = frozenset()
    calls: list[_Call] = field(default_factory=list)
    _text: str = ""  # content not yet given out (it may end in the start of OPEN)
    _call: _Call | None = None
    _bare: bool | None = None  # the output may be a call without tags (None: not known yet)
    _fence: bool = False  # a fenced call without tags has closed: its closing fence may follow

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = "", []
        self._text += text
        if self._bare is not False and not self.calls and self._call is None:
            start = self._text.lstrip()
            if not start:
                return "", []
            self._bare = bool(self.names) and start[0] in "{`[" and OPEN not in self._text
            if self._bare and not self._open_bare():
                return "", []
        while self._text:
            if self._fence:
                rest = self._text.lstrip()
                if len(rest) < 3 and "```".startswith(rest):
                    break  # held: the fence may still be arriving
                self._text, self._fence = rest.removeprefix("```"), False
                continue
            if self._call is None:
                at = self._text.find(OPEN)
                if at < 0:
                    keep = _partial_suffix(self._text, OPEN)
                    if self.calls and not self._text[: len(self._text) - keep].strip():
                        break  # held: the whitespace between calls, which is not content
                    content += self._text[: len(self._text) - keep]
                    self._text = self._text[len(self._text) - keep :]
                    break
                before = self._text[:at]
                if not self.calls or before.strip():  # the newline between two calls is not content
                    content += before
                self._text = self._text[at + len(OPEN) :]
                self._call = _Call(id="call_" + secrets.token_hex(12))
                self.calls.append(self._call)
            call = self._call
            call.body += self._text
            if call.braces is None:
                end = call.body.find(CLOSE)
                self._text = "" if end < 0 else call.body[end + len(CLOSE) :]
            else:
                end = call.braces.close(call.body)
                self._text = "" if end < 0 else call.body[end:]
                self._fence = end >= 0 and bool(call.opening)  # its closing fence is no content
            call.body = call.body if end < 0 else call.body[:end]
            deltas += self._advance(call, closed=end >= 0)
            if end >= 0:
                self._call = None
        return content, deltas

    def _open_bare(self) -> bool:
        """Begin streaming a call written without tags, once the held output shows its header naming one of
        ``names``; False: hold on."""
        body = self._text.lstrip()
        opening = ""
        if body.startswith("```"):
            newline = body.find("\n")
            if newline < 0:
                return False
            opening, body = body[: newline + 1], body[newline + 1 :].lstrip()
        header = _HEADER.match(body)
        if header is None or header.end() == len(body):
            return False
        try:
            name = json.loads(f'"{header.group(1)}"')
        except json.JSONDecodeError:
            return False
        if name not in self.names:
            return False
        self._call = _Call(id="call_" + secrets.token_hex(12), opening=opening, braces=_Braces())
        self.calls.append(self._call)
        self._text, self._bare = body, False
        return True

    def feed_run(self, text: str, last: bool) -> tuple[str, list[ToolCallDelta]]:
        """``feed`` a run of output; on the ``last`` one, ``finish`` too."""
        content, deltas = self.feed(text)
        if last:
            rest, more = self.finish()
            content, deltas = content + rest, deltas + more
        return content, deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The end of the output: content held back, and the rest of an unclosed call's arguments."""
        content, deltas = "", []
        if self._bare:
            deltas = self._bare_calls(self._text)
            if deltas:
                self._text = ""
        if self._call is not None:
            self._call.cut = True
            deltas = self._advance(self._call, closed=True)
            self._call = None
        elif self._text.strip() or not self.calls:  # a newline after the last call is not content
            content = self._text
        self._text = ""
        return content, deltas

    def _bare_calls(self, text: str) -> list[ToolCallDelta]:
        """``text`` as calls written without tags: {"name", "arguments"} objects (one, or a list), maybe fenced."""
        body = text.strip()
        if body.startswith("```"):
            body = body.removeprefix("```json").removeprefix("```").removesuffix("```").strip()
        try:
            found = json.loads(body)
        except json.JSONDecodeError:
            return []
        found = found if isinstance(found, list) else [found]
        valid = [
            c for c in found if isinstance(c, dict) and c.get("name") in self.names and isinstance(_arguments(c), dict)
        ]
        if not valid or len(valid) != len(found):
            return []
        deltas = []
        for c in valid:
            call = _Call(id="call_" + secrets.token_hex(12), name=c["name"])
            self.calls.append(call)
            index = len(self.calls) - 1
            arguments = json.dumps(_arguments(c), ensure_ascii=False)
            deltas += [ToolCallDelta(index, call.id, call.name), ToolCallDelta(index, arguments=arguments)]
        return deltas

    def _advance(self, call: _Call, closed: bool) -> list[ToolCallDelta]:
        index = len(self.calls) - 1
        deltas = []
        if call.args_from < 0:
            header = _HEADER.match(call.body)
            if header is None or (header.end() == len(call.body) and not closed):  # more space may follow
                return []
            call.name, call.args_from = json.loads(f'"{header.group(1)}"'), header.end()
            deltas.append(ToolCallDelta(index, call.id, call.name))
        args = call.body[call.args_from :]
        if closed:  # the call's own "}" closes the wrapper object
            args = args.rstrip()
            args = args[:-1].rstrip() if args.endswith("}") else args
            upto = len(args)
        else:
            upto = max(len(args) - HOLD, call.sent)
        if upto > call.sent:
            deltas.append(ToolCallDelta(index, arguments=args[call.sent : upto]))
            call.sent = upto
        return deltas


def _arguments(call: dict):
    """A bare call's arguments, under either name models give them."""
    return call.get("arguments", call.get("parameters", {}))


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def split_calls(text: str, names: frozenset[str]) -> tuple[str, list[dict]]:
    """A whole output's content and the tool calls to ``names`` read out of it (OpenAI's ``tool_calls`` shape). A
    call the output ended inside (cut by max_tokens) is no call: its text is returned as content."""
    parser = ToolCallParser(names)
    content, deltas = parser.feed_run(text, last=True)
    calls = gather(deltas)
    cut = [i for i, call in enumerate(parser.calls) if call.cut]
    for i in cut:
        content += parser.calls[i].opening + parser.calls[i].body
    return content, [call for i, call in enumerate(calls) if i not in cut]


def gather(deltas: list[ToolCallDelta]) -> list[dict]:
    """Streamed call deltas joined into the message's ``tool_calls``."""
    calls: dict[int, dict] = {}
    for d in deltas:
        if d.id is not None:
            calls[d.index] = {"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}}
        calls[d.index]["function"]["arguments"] += d.arguments
    return [calls[i] for i in sorted(calls)]
