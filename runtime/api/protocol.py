"""OpenAI request bodies. Unknown fields are ignored, as OpenAI clients expect; known ones are checked, and the known
ones depctl does not implement, which would change what the client gets back (tools, a JSON response format,
logprobs, logit biases, penalties), are refused with 400 naming the field rather than silently ignored."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from depctl.spec import MAX_DRAFT_TOKENS
from runtime.api.errors import APIError
from runtime.speculation import SamplingParams

MAX_STOP_STRINGS = 16


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


def _unsupported(name: str, value: Any, why: str = "") -> None:
    raise APIError(
        400,
        f"{name} is not supported by depctl{why}; remove it from the request",
        param=name,
        code="unsupported_parameter",
    )


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class SpeculationControl(BaseModel):
    """depctl extension: this request's speculation. Unknown keys are refused (a typo must not silently do nothing)."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = True  # false: no drafts at all (a prediction included); the output is the same either way
    max_draft_tokens: int | None = Field(default=None, ge=0, le=MAX_DRAFT_TOKENS)  # per step; 0 is off


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
    n: int = 1
    user: str | None = None
    logprobs: bool | int | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    response_format: dict | None = None
    ignore_eos: bool = False  # vLLM extension: benchmarks use it to force a length
    speculate: bool = True  # depctl extension, kept for old clients: false is speculation.enabled = false
    speculation: SpeculationControl | None = None

    def check_supported(self) -> None:
        if self.n != 1:
            raise APIError(400, f"n={self.n} is not supported: depctl returns one choice per request", param="n")
        if self.logprobs:
            _unsupported("logprobs", self.logprobs)
        if self.logit_bias:
            _unsupported("logit_bias", self.logit_bias)
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                _unsupported(name, getattr(self, name), " (only 0)")
        if self.response_format and self.response_format.get("type", "text") != "text":
            _unsupported(
                "response_format",
                self.response_format,
                f" (type {self.response_format.get('type')!r}: only 'text'; depctl cannot constrain output to JSON)",
            )
        if len(self.stop_strings) > MAX_STOP_STRINGS:
            raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings are supported", param="stop")

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

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0),
            seed=self.seed,
        )


class CompletionRequest(_Common):
    prompt: Union[Text, list[Text], list[int]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of is not supported", param="best_of")
        if self.suffix:
            _unsupported("suffix", self.suffix, " (no fill-in-the-middle)")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) > 1:
            raise APIError(400, "batched prompts are not supported: send one prompt per request", param="prompt")


class TextPart(_Request):
    type: Literal["text"]
    text: Text


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list | None = None

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


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    prediction: Prediction | None = None
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    modalities: list[str] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        for name in ("tools", "functions"):
            if getattr(self, name):
                _unsupported(name, getattr(self, name), " (no tool calling yet)")
        for name in ("tool_choice", "function_call"):
            value = getattr(self, name)
            if value not in (None, "none", "auto"):
                _unsupported(name, value, " (no tool calling yet)")
        if self.top_logprobs:
            _unsupported("top_logprobs", self.top_logprobs)
        if self.modalities and set(self.modalities) != {"text"}:
            _unsupported("modalities", self.modalities, " (text only)")
        if any(m.tool_calls for m in self.messages):
            _unsupported("messages.tool_calls", None, " (no tool calling yet)")

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
