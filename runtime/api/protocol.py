"""OpenAI request bodies. Unknown fields are ignored, as OpenAI clients expect; known ones are checked, and the known
ones depctl does not implement, which would change what the client gets back, are refused with 400 naming the field
rather than silently ignored.

depctl extensions, as vLLM spells them where vLLM has them: ``top_k``, ``ignore_eos``, ``repetition_penalty``,
``structured_outputs`` (``{"json": schema}``, ``{"regex": ...}``, ``{"grammar": lark}`` or ``{"choice": [...]}``),
and ``speculation`` (this request's drafting).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from depctl.spec import MAX_DRAFT_TOKENS, SamplingDefaults
from depctl_runtime.api.errors import APIError
from depctl_runtime.backends import Constraint
from depctl_runtime.backends.structured import schema_problem
from depctl_runtime.speculation.params import Penalties, SamplingParams

MAX_STOP_STRINGS = 16
MAX_CHOICES = 16  # n: beyond this a client should send more requests (they queue fairly)
MAX_TOP_LOGPROBS = 20
TOKEN_ID = re.compile(r"-?[0-9]{1,10}")


def _unicode(text: str) -> str:
    """JSON can carry a lone UTF-16 surrogate ("\\udfff"), which no tokenizer can encode: refuse it by name."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"contains an unpaired UTF-16 surrogate ({text[exc.start]!a} at character {exc.start}); "
            "send valid Unicode text"
        ) from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]


def text_of(content, where: str, kinds: tuple[str, ...], sep: str = "") -> str:
    """A string, or a list of text parts (blocks whose ``type`` is one of ``kinds``) joined by ``sep``; any other
    part is refused by its type (images, documents, files)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of text parts", param=where, code="invalid_type")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in kinds:
            raise APIError(
                400,
                f"{where}.{j}: parts of type {kind!r} are not supported by depctl (text only)",
                param=f"{where}.{j}.type",
                code="unsupported_value",
            )
        parts.append(required_str(part.get("text"), f"{where}.{j}.text"))
    return sep.join(parts)


def required_str(value, where: str) -> str:
    """A field of a loosely typed block (Anthropic's content blocks, Responses input items) that must be a string."""
    if not isinstance(value, str):
        raise APIError(400, f"{where} must be a string", param=where, code="invalid_type")
    return _unicode(value)


def _first(*values):
    """The first value that is set (a request's own, then the deployment's default, then OpenAI's)."""
    return next(v for v in values if v is not None)


def _unsupported(name: str, value: Any, why: str = "") -> None:
    raise APIError(
        400,
        f"{name} is not supported by depctl{why}; remove it from the request",
        param=name,
        code="unsupported_parameter",
    )


class _Request(BaseModel):
    # strict, as OpenAI is: `"max_tokens": "8"` or `true` is a 400, not 8 or 1 (an integer is still a float)
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


class SpeculationControl(BaseModel):
    """depctl extension: this request's speculation. Unknown keys are refused (a typo must not silently do nothing)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    enabled: bool = True  # false: no drafts at all (a prediction included); the output is the same either way
    max_draft_tokens: int | None = Field(default=None, ge=0, le=MAX_DRAFT_TOKENS)  # per step; 0 is off


class JSONSchemaFormat(_Request):
    name: str = "response"
    description: str | None = None
    schema_: dict | bool | None = Field(default=None, alias="schema")  # None: any JSON object
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """depctl extension (vLLM's name and keys): exactly one constraint on the output."""

    model_config = ConfigDict(extra="forbid", strict=True)
    json_: dict | bool | None = Field(default=None, alias="json")
    regex: str | None = None
    grammar: str | None = None  # Lark, llguidance's dialect
    choice: list[str] | None = Field(default=None, min_length=1)
    json_object: bool | None = None

    def constraint(self) -> Constraint:
        given = {k: v for k, v in self.model_dump(by_alias=True).items() if v not in (None, False)}
        if len(given) != 1:
            raise APIError(
                400,
                "structured_outputs takes exactly one of json, regex, grammar, choice, json_object; "
                f"got {sorted(given) or 'none'}",
                param="structured_outputs",
                code="invalid_value",
            )
        (kind, value), param = next(iter(given.items())), f"structured_outputs.{next(iter(given))}"
        if kind == "json_object":
            return Constraint("json", None, param)
        return Constraint(kind, value, param)


class _Common(_Request):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0: off (vLLM uses -1)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # what torch's generators accept
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)  # choices, each its own row in the batch
    user: str | None = None
    # requests with different salts never share cached prompt blocks, even from one tenant (vLLM's field)
    cache_salt: str | None = Field(default=None, max_length=256)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)  # vLLM extension
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    ignore_eos: bool = False  # vLLM extension: benchmarks use it to force a length
    speculate: bool = True  # depctl extension, kept for old clients: false is speculation.enabled = false
    speculation: SpeculationControl | None = None

    def check_supported(self) -> None:
        if len(self.stop_strings) > MAX_STOP_STRINGS:
            raise APIError(
                400, f"at most {MAX_STOP_STRINGS} stop strings are supported", param="stop", code="invalid_value"
            )
        if self.constraint() is not None and self.ignore_eos:
            raise APIError(
                400,
                "ignore_eos cannot be combined with a constrained output, which ends where its grammar does",
                param="ignore_eos",
                code="unsupported_value",
            )

    def constraint(self) -> Constraint | None:
        """What the output must match: ``response_format`` or the ``structured_outputs`` extension (not both)."""
        fmt = self.response_format
        from_format = None
        if fmt is not None and fmt.type == "json_object":
            from_format = Constraint("json", None, "response_format")
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise APIError(
                    400,
                    "response_format of type json_schema needs a json_schema object with a schema",
                    param="response_format.json_schema",
                    code="missing_required_parameter",
                )
            from_format = Constraint("json", fmt.json_schema.schema_, "response_format.json_schema.schema")
        if self.structured_outputs is None:
            return from_format
        if from_format is not None:
            raise APIError(
                400,
                "send response_format or structured_outputs, not both",
                param="structured_outputs",
                code="invalid_value",
            )
        return self.structured_outputs.constraint()

    def penalties(self) -> Penalties:
        bias = []
        for key, value in (self.logit_bias or {}).items():
            if not TOKEN_ID.fullmatch(key):  # (ASCII digits only, and few: int() of 5000 digits raises)
                raise APIError(
                    400, f"logit_bias keys are token ids; got {key[:40]!r}", param="logit_bias", code="invalid_value"
                )
            bias.append((int(key), float(value)))
        return Penalties(
            logit_bias=tuple(bias),
            presence=self.presence_penalty or 0.0,
            frequency=self.frequency_penalty or 0.0,
            repetition=self.repetition_penalty or 1.0,
        )

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]

    @property
    def speculation_enabled(self) -> bool:
        return self.speculate and (self.speculation is None or self.speculation.enabled)

    @property
    def max_draft_tokens(self) -> int | None:
        return None if self.speculation is None else self.speculation.max_draft_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, defaults: SamplingDefaults = SamplingDefaults()) -> SamplingParams:
        """defaults: the deployment's, for the fields the request leaves out (then OpenAI's)."""
        temperature = _first(self.temperature, defaults.temperature, 1.0)
        top_p = _first(self.top_p, defaults.top_p, 1.0)
        top_k = _first(self.top_k, defaults.top_k, 0)
        return SamplingParams(temperature=temperature, top_p=top_p, top_k=max(top_k, 0), seed=self.seed)


class CompletionRequest(_Common):
    prompt: Union[Text, list[Text], list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # the top alternatives per token
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @property
    def logprobs_count(self) -> int | None:
        return self.logprobs

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            _unsupported("echo", self.echo)
        if self.best_of not in (None, 1):
            _unsupported("best_of", self.best_of)
        if self.suffix:
            _unsupported("suffix", self.suffix, " (no fill-in-the-middle)")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) > 1:
            raise APIError(
                400,
                "batched prompts are not supported: send one prompt per request",
                param="prompt",
                code="unsupported_value",
            )


class TextPart(_Request):
    type: Literal["text"]
    text: Text


class FunctionCall(_Request):
    name: str
    arguments: str | dict  # a JSON string, as OpenAI sends it back


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class Prediction(_Request):
    type: Literal["content"]
    content: Text | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionDefinition(_Request):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema for the arguments (None: no arguments)
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    prediction: Prediction | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list | None = None
    function_call: str | dict | None = None
    modalities: list[str] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        for name in ("functions", "function_call"):
            if getattr(self, name):
                _unsupported(name, getattr(self, name), " (deprecated by OpenAI: send tools and tool_choice)")
        self.check_tools()
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        if self.modalities and set(self.modalities) != {"text"}:
            _unsupported("modalities", self.modalities, " (text only)")

    def check_tools(self) -> None:
        names = [t.function.name for t in self.tools or ()]
        choice = self.tool_choice
        if choice in ("required",) or isinstance(choice, NamedToolChoice):
            if not names:
                raise APIError(
                    400,
                    "tool_choice asks for a tool call, but the request has no tools",
                    param="tool_choice",
                    code="invalid_value",
                )
            if self.constraint() is not None:
                raise APIError(
                    400,
                    "tool_choice that requires a call cannot be combined with response_format or structured_outputs",
                    param="tool_choice",
                    code="unsupported_value",
                )
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise APIError(
                400,
                f"tool_choice names function {choice.function.name!r}, which is not in tools ({', '.join(names)})",
                param="tool_choice",
                code="invalid_value",
            )
        if len(set(names)) != len(names):
            raise APIError(400, "tools: two functions share a name", param="tools", code="invalid_value")
        for i, tool in enumerate(self.tools or ()):
            schema = tool.function.parameters
            if schema is None:
                continue
            problem = schema_problem(schema)
            if problem:
                raise APIError(
                    400,
                    f"tools[{i}].function.parameters is {problem}",
                    param=f"tools.{i}.function.parameters",
                    code="invalid_value",
                )

    @property
    def calling_tools(self) -> bool:
        """The model is offered the tools (and its output is read for calls)."""
        return bool(self.tools) and self.tool_choice != "none"

    def required_functions(self) -> list[dict] | None:
        """The functions the output must call (tool_choice "required" or a named function), else None."""
        if not self.calling_tools:
            return None
        functions = [t.function.model_dump(exclude_none=True) for t in self.tools]
        if self.tool_choice == "required":
            return functions
        if isinstance(self.tool_choice, NamedToolChoice):
            return [f for f in functions if f["name"] == self.tool_choice.function.name]
        return None

    @property
    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Request):
    """vLLM's ``POST /tokenize``: a prompt, or chat messages rendered by the model's template, to token ids."""

    model: str
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[Tool] | None = None
    add_special_tokens: bool = True  # for a prompt; rendered messages carry their template's own
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(_Request):
    model: str
    tokens: list[int]
