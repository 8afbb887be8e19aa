"""Tool calls: tools rendered by the model's own chat template, its tool-call format parsed back into OpenAI
``tool_calls``, and ``tool_choice`` "required" or a named function constrained by a grammar built from the functions'
JSON schemas (which also makes every forced key and tag a free draft).

The formats read: the one Qwen2.5, Hermes and many fine-tunes write,
``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, one block per call; Llama 3.1-3.3's bare
``{"name": "f", "parameters": {...}}``; Mistral's v3 (Mistral 7B v0.3, Nemo)
``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]``; and Mistral's v11 (Mistral Small 3.1/3.2, Devstral,
Ministral 3) ``[TOOL_CALLS]f[ARGS]{...}``, one marker a call. A model whose template never renders tools is asked for
Hermes's blocks by a system message that describes the tools (``prompted``), as llama.cpp's generic format does, so
every chat model can call tools; the grammar holds it to them where a call is required.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import string
from dataclasses import dataclass, field

from depctl_runtime.api.errors import APIError
from depctl_runtime.backends import Constraint
from depctl_runtime.speculation.json_schema import JSON_OPTIONS, cap_numbers

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARK = "[TOOL_CALLS]"
MISTRAL_ARGS, MISTRAL_CALL_ID = "[ARGS]", "[CALL_ID]"  # v11: name[ARGS]{...}; Small 3.2's history adds [CALL_ID]id
# a call's head; its arguments are "arguments" (Hermes, Qwen2.5) or "parameters" (Llama 3.1's template asks for it)
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
HOLD = len(CLOSE) + 8  # characters of a call held back while streaming: the wrapper's "}" and a partial close tag


def template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return template if isinstance(template, str) else "\n".join(str(t) for t in template.values())


@dataclass(frozen=True)
class ToolFormat:
    """How a model family writes a call: between ``OPEN`` and ``CLOSE`` tags, as a bare JSON object, in a JSON list
    after a ``marker``, or each after its own marker as its name, ``args_tag`` and its arguments' object; the key its
    arguments go under; whether it writes more than one call an answer."""

    tagged: bool
    arguments: str
    parallel: bool
    marker: str = ""  # the calls are a JSON list after this (a special token of the model's, as a rule)
    args_tag: str = ""  # each call is marker, name, this, then the arguments' object (no list)


HERMES = ToolFormat(True, "arguments", True)  # Qwen2.5, Hermes; and models told it (``prompted``)
LLAMA3 = ToolFormat(False, "parameters", False)  # Llama 3.1-3.3's template: one bare object
MISTRAL = ToolFormat(False, "arguments", True, MISTRAL_MARK)  # Mistral's v3 templates (7B v0.3, Nemo)
MISTRAL_V11 = ToolFormat(False, "arguments", True, MISTRAL_MARK, MISTRAL_ARGS)  # Small 3.1/3.2, Devstral, Ministral 3


def renders_tools(tokenizer) -> bool:
    """Whether the model's chat template renders ``tools`` itself (else ``prompted`` describes them)."""
    return "tools" in template_text(tokenizer)


def template_format(tokenizer) -> ToolFormat | None:
    """The call format of the model's family (a template that never renders tools is told HERMES's); None where
    its template asks for calls in a format depctl does not read."""
    template = template_text(tokenizer)
    if "tools" not in template or OPEN in template:
        return HERMES
    if MISTRAL_MARK in template:
        return MISTRAL_V11 if MISTRAL_ARGS in template else MISTRAL
    if '"parameters": ' in template:
        return LLAMA3
    return None


def tool_format(tokenizer, deployment: str) -> ToolFormat:
    """``template_format``, or a 400 naming the deployment where depctl does not read its model's format."""
    fmt = template_format(tokenizer)
    if fmt is None:
        raise APIError(
            400,
            f"deployment {deployment!r}: its model writes tool calls in a format depctl does not parse yet "
            f'(depctl reads {OPEN}...{CLOSE} blocks, Llama 3\'s bare {{"name", "parameters"}} objects, '
            f"Mistral v3's {MISTRAL_MARK}[...] lists and v11's {MISTRAL_MARK}name{MISTRAL_ARGS}{{...}} calls)",
            param="tools",
            code="tools_unsupported",
        )
    return fmt


def shown_tokens(tokenizer, fmt: ToolFormat) -> tuple[int, ...]:
    """The special tokens of a format's tags, which the output's text must show (decoding drops special tokens)."""
    tags = [fmt.marker, fmt.args_tag] + ([MISTRAL_CALL_ID] if fmt.args_tag else [])
    return tuple(token for tag in tags if tag and (token := _token(tokenizer, tag)) is not None)


def _token(tokenizer, text: str) -> int | None:
    """The model's own single token for ``text``, if it has one."""
    ids = tokenizer.convert_tokens_to_ids([text])
    if ids and isinstance(ids[0], int) and ids[0] != tokenizer.unk_token_id and tokenizer.decode(ids) == text:
        return ids[0]
    return None


def _tag(tokenizer, text: str) -> str:
    """A Lark terminal for ``text``: the model's own single token when it has one (the model writes that token, not
    the characters spelled out), else the string."""
    token = _token(tokenizer, text)
    return json.dumps(text) if token is None else f"<[{token}]>"


def call_schema(functions: list[dict], key: str = "arguments") -> dict:
    """The JSON of one call to any of ``functions`` (OpenAI tool ``function`` objects), keys in the model's order;
    ``key``: what its family names the arguments."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": fn["name"]}, key: _parameters(fn)},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for fn in functions
    ]
    return _lenient(options[0] if len(options) == 1 else {"anyOf": options})


def _parameters(fn: dict) -> dict:
    return fn.get("parameters") or {"type": "object", "properties": {}}


def _lenient(schema: dict) -> dict:
    """``schema`` as the grammar takes it: numbers capped, and a keyword the grammar cannot enforce (propertyNames,
    in Claude Code's tools) left unenforced; a client's tools must never turn its requests into 400s."""
    return cap_numbers({**schema, "x-guidance": {**JSON_OPTIONS, "lenient": True}})


# free text that does not open like a call written without tags: JSON, bare or in a ```json fence (after spaces)
_TEXT = "TEXT: /(.|\\n)*/ & ~/\\s*(\\{|```json)(.|\\n)*/"


def tool_constraint(
    tokenizer, functions: list[dict], parallel: bool, param: str, lazy: bool = False, fmt: ToolFormat = HERMES
) -> Constraint:
    """The output is one call (or, with ``parallel`` where the family writes several, one or more) to
    ``functions``, in the model's format ``fmt``.

    ``lazy`` (tool_choice "auto"): the output is free text, and the grammar starts where the model writes the call
    tag (llguidance's lazy rule: free text up to the tag's first appearance), so every call it writes names an
    offered function with arguments that match their schema; text may follow a call. An output that opens like a
    call written without tags (JSON, bare or fenced: Llama 3's own format, and what small models write in place of
    the tags) is held to one such call, and ends there: a call or text, never half of each."""
    call = f"%json {json.dumps(call_schema(functions, fmt.arguments))}"
    bare = f'bare: /[ \\n]*/ ({call} | "```json\\n" {call} "\\n```")'
    if fmt.args_tag:  # each call after its own marker: the name, the tag, the arguments' object
        opening, many = _tag(tokenizer, fmt.marker), parallel
        args = _tag(tokenizer, fmt.args_tag)
        named = [f"{json.dumps(fn['name'])} {args} %json {json.dumps(_lenient(_parameters(fn)))}" for fn in functions]
        body = f"({' | '.join(named)})"
        required = "start: call+" if parallel else "start: call"
    elif fmt.marker:  # one list of calls after the marker
        opening, many = _tag(tokenizer, fmt.marker), False
        body = f'"[" {call} (", " {call})* "]"' if parallel else f'"[" {call} "]"'
        required = "start: call"
    elif fmt.tagged:
        opening, many = _tag(tokenizer, OPEN), parallel
        body = f'"\\n" {call} "\\n" {_tag(tokenizer, CLOSE)}'
        # a model ends its last call with a newline as often as with its end token: let it end after one
        required = 'start: call ("\\n" call)* "\\n"?' if parallel else 'start: call "\\n"?'
    elif lazy:
        return Constraint("grammar", f"%llguidance {{}}\nstart: TEXT | bare\n{bare}\n{_TEXT}", param, optional=True)
    else:
        return Constraint("grammar", f"start: {call}", param)
    if not lazy:
        return Constraint("grammar", f"{required}\ncall: {opening} {body}", param)
    if opening.startswith("<["):  # the model's own token: text cannot spell it, so no lazy rule is needed
        rules = f"call: TEXT {opening} {body}"
    else:
        rules = f"call: trigger {body}\ntrigger[lazy]: TEXT {opening}"
    start = "start: call* TEXT | bare" if many else "start: call? TEXT | bare"
    grammar = f"%llguidance {{}}\n{start}\n{rules}\n{bare}\n{_TEXT}"
    return Constraint("grammar", grammar, param, optional=True)


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


def history(messages, fmt: ToolFormat | None = HERMES) -> list[dict]:
    """Chat messages as chat templates read them: an assistant's ``tool_calls`` with their arguments as objects
    (templates write them with ``tojson``), a tool's reply with its ``tool_call_id`` (for Mistral's formats, as the
    9 letters and digits its templates insist on)."""
    call_id = _nine if fmt in (MISTRAL, MISTRAL_V11) else str
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
                function = {"name": fn.name, "arguments": arguments}
                calls.append({"id": call_id(call.id), "type": "function", "function": function})
            msg["tool_calls"] = calls
        if m.tool_call_id:
            msg["tool_call_id"] = call_id(m.tool_call_id)
        if m.name:
            msg["name"] = m.name
        out.append(msg)
    return out


def _nine(call_id: str) -> str:
    """A call id as 9 letters and digits: itself if it is already, else drawn from its hash (the same for a call and
    its result)."""
    if len(call_id) == 9 and call_id.isascii() and call_id.isalnum():
        return call_id
    digest = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    alphabet = string.ascii_letters + string.digits
    return "".join(alphabet[(digest >> (6 * i)) % len(alphabet)] for i in range(9))


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
    header: re.Pattern = _HEADER  # what ``body`` opens with before the arguments; its group 1 the name


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
    fmt: ToolFormat = HERMES  # its marker (Mistral's [TOOL_CALLS]) and args tag, where it has them
    calls: list[_Call] = field(default_factory=list)
    _text: str = ""  # content not yet given out (it may end in the start of OPEN)
    _call: _Call | None = None
    _bare: bool | None = None  # the output may be a call without tags (None: not known yet)
    _fence: bool = False  # a fenced call without tags has closed: its closing fence may follow
    _listing: bool = False  # inside the JSON list of calls after ``marker``

    @property
    def marker(self) -> str:
        return self.fmt.marker

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = "", []
        self._text += text
        if self._bare is not False and not self.calls and self._call is None:
            start = self._text.lstrip()
            if not start:
                return "", []
            opened = OPEN in self._text or (self.marker and (self.marker in start or self.marker.startswith(start)))
            self._bare = bool(self.names) and start[0] in "{`[" and not opened
            if self._bare and not self._open_bare():
                return "", []
        while self._text:
            if self._fence:
                rest = self._text.lstrip()
                if len(rest) < 3 and "```".startswith(rest):
                    break  # held: the fence may still be arriving
                self._text, self._fence = rest.removeprefix("```"), False
                continue
            if self._listing and self._call is None:
                rest = self._text.lstrip()
                if not rest:
                    break  # held: what follows tells
                if rest[0] in "[,]":
                    self._listing, self._text = rest[0] != "]", rest[1:]
                    continue
                if rest[0] != "{":  # no list of calls after all: text
                    self._listing = False
                    continue
                self._text = rest
                self._call = _Call(id="call_" + secrets.token_hex(12), opening="", braces=_Braces())
                self.calls.append(self._call)
            if self._call is None:
                at, tag = self._opening()
                if at < 0:
                    keep = max(_partial_suffix(self._text, OPEN), _partial_suffix(self._text, self.marker))
                    if self.calls and not self._text[: len(self._text) - keep].strip():
                        break  # held: the whitespace between calls, which is not content
                    content += self._text[: len(self._text) - keep]
                    self._text = self._text[len(self._text) - keep :]
                    break
                before = self._text[:at]
                if not self.calls or before.strip():  # the newline between two calls is not content
                    content += before
                self._text = self._text[at + len(tag) :]
                if tag == self.marker and not self.fmt.args_tag:
                    self._listing = True
                    continue
                if tag == self.marker:  # name, args tag, the arguments' object
                    self._call = _Call(
                        id="call_" + secrets.token_hex(12), opening=tag, braces=_Braces(), header=_named(self.fmt)
                    )
                else:
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
                self._fence = end >= 0 and call.opening.startswith("```")  # its closing fence is no content
            call.body = call.body if end < 0 else call.body[:end]
            deltas += self._advance(call, closed=end >= 0)
            if end >= 0:
                self._call = None
        return content, deltas

    def _opening(self) -> tuple[int, str]:
        """Where the next call (or, for a format with a marker, list of calls) opens in the held text, and its tag."""
        found = [(at, tag) for tag in (OPEN, self.marker) if tag and (at := self._text.find(tag)) >= 0]
        return min(found) if found else (-1, "")

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
        wrapped = call.header is _HEADER  # {"name": ..., "arguments": {...}}: the arguments end before its "}"
        if call.args_from < 0:
            header = call.header.match(call.body)
            if header is None or (header.end() == len(call.body) and not closed):  # more space may follow
                return []
            name = header.group(1)
            call.name, call.args_from = json.loads(f'"{name}"') if wrapped else name, header.end()
            deltas.append(ToolCallDelta(index, call.id, call.name))
        args = call.body[call.args_from :]
        if closed:
            args = args.rstrip()
            args = args[:-1].rstrip() if wrapped and args.endswith("}") else args
            upto = len(args)
        else:
            upto = max(len(args) - HOLD, call.sent)
        if upto > call.sent:
            deltas.append(ToolCallDelta(index, arguments=args[call.sent : upto]))
            call.sent = upto
        return deltas


def _named(fmt: ToolFormat) -> re.Pattern:
    """The head of a call in ``fmt``'s named form: its name, maybe a call id, then the args tag."""
    call_id = re.escape(MISTRAL_CALL_ID)
    return re.compile(rf"\s*([\w.:-]+)\s*(?:{call_id}\s*\w*\s*)?{re.escape(fmt.args_tag)}\s*")


def _arguments(call: dict):
    """A bare call's arguments, under either name models give them."""
    return call.get("arguments", call.get("parameters", {}))


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (0 for no tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def split_calls(text: str, names: frozenset[str], fmt: ToolFormat = HERMES) -> tuple[str, list[dict]]:
    """A whole output's content and the tool calls to ``names`` read out of it (OpenAI's ``tool_calls`` shape). A
    call the output ended inside (cut by max_tokens) is no call: its text is returned as content."""
    parser = ToolCallParser(names, fmt)
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
