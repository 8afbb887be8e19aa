"""The deployment spec: what the user asked for, and nothing the daemon observed.

A spec is data. It validates without touching the disk or loading a model; model references are checked
separately (``depctl.models.resolve``) because that does touch the disk.

```yaml
id: smollm2-3f9c1a
display_name: my chat model
model: smollm2-135m-instruct
speculation: {method: ngram, ngram_length: 3, num_draft_tokens: 4}
max_batch_size: 8
device: auto
dtype: auto
quantization: none
compile: true             # decode and verify passes compiled where that is faster (int8 weights on a CPU)
engine: depctl            # or vllm: the daemon runs a vLLM server for it (see depctl.vllm)
max_context_length: null  # tokens a request may span (prompt + output); null: the model's, up to 32768
tensor_parallel_size: 1   # vLLM only, like pipeline_parallel_size and ray_address
created_at: 2026-11-22T12:00:00Z
updated_at: 2026-11-22T12:00:00Z
```
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Annotated, Callable, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from depctl.errors import UsageError

# Bounds are documented in README.md ("Flags"); the CLI and the spec share them.
DEFAULT_DRAFT_MODEL_TOKENS = 4
DEFAULT_MODEL_FREE_TOKENS = 8  # n-gram and suffix
MAX_DRAFT_TOKENS = 32
MAX_NGRAM_LENGTH = 16
# suffix speculation's index: ~200 bytes a held token (runtime/speculation/suffix.py), so the default is ~50 MB
DEFAULT_SUFFIX_CACHE_TOKENS = 262_144
MIN_SUFFIX_CACHE_TOKENS = 1024
MAX_SUFFIX_CACHE_TOKENS = 1 << 26
# who shares suffix speculation's drafts: "user" (the default) indexes each (API key, `user` field) apart, so
# drafts, counts and timing never depend on another user's requests; "deployment" shares one index (opt-in)
SuffixScope = Literal["user", "deployment"]
# who shares the prefix cache's prompt blocks: "user" (the default) keys them by API key and `user` field, so no
# user's time to first token tells what another sent; "deployment" shares them (opt-in). A cache_salt always separates
PrefixCacheScope = Literal["user", "deployment"]
MAX_BATCH_SIZE = 256
DEFAULT_BATCH_SIZE = 8
ID_PATTERN = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")

Device = Literal["auto", "cpu", "cuda"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
# How the draft model's weights are held. The draft only proposes, so its numerics never change the output (the
# target verifies every token); "int8" (dynamic int8 linears, CPU only) drafts ~3x faster than float32 on a CPU;
# "int4" (depctl's 4-bit grouped weights, CPU only) reads a third of bf16's bytes. auto: int8 on a CPU, the target's
# dtype on a GPU.
DraftPrecision = Literal["auto", "float32", "bfloat16", "float16", "int8", "int4"]
# How the target's weights are held (CPU only). "int8" and "int4": weight-only, in groups of 32 inputs with an fp16
# scale and offset each (9 and 5 bits a weight, as GGUF's Q8_1 and Q4_1), activations in float32 or bfloat16. They
# change the model's outputs slightly, as llama.cpp's Q8_0 and Q4_K_M do; speculation stays exact against the same
# quantized model decoding plainly. Never picked for you.
Quantization = Literal["none", "int8", "int4"]
# Which engine serves the deployment: depctl's own (one device, one process), or a vLLM server the daemon starts and
# supervises (tensor/pipeline parallel, multi-node through Ray), behind the same API.
Engine = Literal["depctl", "vllm"]
MAX_PARALLEL_SIZE = 1024
MIN_CONTEXT_LENGTH = 16
# a learning draft head's recorded traffic: ~3.5 KB a token for SmolLM2 (three layers' bf16 features), so the default
# holds about 300,000 tokens of answers and their prompts
DEFAULT_LEARN_DISK_BYTES = 1 << 30
MIN_LEARN_DISK_BYTES = 16 << 20


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NoSpeculation(_Strict):
    method: Literal["none"] = "none"


class NgramSpeculation(_Strict):
    """Prompt-lookup decoding: propose what followed the last match of the final ``ngram_length`` tokens."""

    method: Literal["ngram"] = "ngram"
    ngram_length: int = Field(ge=1, le=MAX_NGRAM_LENGTH)
    num_draft_tokens: int = Field(ge=1, le=MAX_DRAFT_TOKENS)


class SuffixSpeculation(_Strict):
    """Suffix speculation: propose what followed the longest match of the recent tokens in this request and in the
    deployment's recent traffic (prompts and outputs), scored by how often each continuation followed it."""

    method: Literal["suffix"] = "suffix"
    num_draft_tokens: int = Field(ge=1, le=MAX_DRAFT_TOKENS)
    # the index's memory bound: tokens of recent requests held, least recently used evicted first
    cache_tokens: int = Field(DEFAULT_SUFFIX_CACHE_TOKENS, ge=MIN_SUFFIX_CACHE_TOKENS, le=MAX_SUFFIX_CACHE_TOKENS)
    scope: SuffixScope = "user"


class DraftModelSpeculation(_Strict):
    """A smaller model with the target's tokenizer proposes ``num_draft_tokens`` tokens per step."""

    method: Literal["draft_model"] = "draft_model"
    draft_model: str = Field(min_length=1)
    num_draft_tokens: int = Field(ge=1, le=MAX_DRAFT_TOKENS)
    draft_precision: DraftPrecision = "auto"


Speculation = Annotated[
    Union[NoSpeculation, NgramSpeculation, SuffixSpeculation, DraftModelSpeculation], Field(discriminator="method")
]
AnySpeculation = Union[NoSpeculation, NgramSpeculation, SuffixSpeculation, DraftModelSpeculation]


class LearnDraftHead(_Strict):
    """A draft head learned from the deployment's own traffic (``--learn-draft-head``): trained in idle time on what the
    target computed while answering, it replaces the n-gram or suffix index once it drafts better on held-out recent
    answers, and each better generation replaces the last, without a reload."""

    # the recorded answers' bytes on disk (the deployment's own folder); the oldest are deleted beyond it
    disk_bytes: int = Field(DEFAULT_LEARN_DISK_BYTES, ge=MIN_LEARN_DISK_BYTES)
    # a trained head to start from (a folder ``depctl draft train`` wrote): it drafts from the first request, and
    # training goes on from it; a deployment that has learned generations keeps them. None: learning starts bare
    start_from: str | None = Field(None, min_length=1)


def _now() -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0)


class SamplingDefaults(_Strict):
    """What a request that leaves a sampling field out gets (ollama's Modelfile PARAMETERs, vLLM's
    --override-generation-config); a request's own value always wins. None: OpenAI's default (1.0, 1.0, off)."""

    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)


class DeploymentSpec(_Strict):
    id: str
    display_name: str | None = None
    model: str = Field(min_length=1)
    speculation: Speculation = NoSpeculation()
    # requests decoded together; more wait in arrival order. A change reloads (the KV cache has a row per request)
    max_batch_size: int = Field(DEFAULT_BATCH_SIZE, ge=1, le=MAX_BATCH_SIZE)
    device: Device = "auto"
    dtype: Dtype = "auto"
    quantization: Quantization = "none"
    # decode and verify passes compiled (a CPU) or recorded as CUDA graphs (a GPU) at load where that is faster and
    # exact (depctl_runtime.backends.loader.compile_passes);
    # with --engine vllm, false is vLLM's --enforce-eager
    compile: bool = True
    engine: Engine = "depctl"
    max_context_length: int | None = Field(None, ge=MIN_CONTEXT_LENGTH)
    tensor_parallel_size: int = Field(1, ge=1, le=MAX_PARALLEL_SIZE)
    pipeline_parallel_size: int = Field(1, ge=1, le=MAX_PARALLEL_SIZE)
    ray_address: str | None = Field(None, min_length=1)
    # seconds a deployment stays loaded with nothing to do before the daemon frees its memory; the next request
    # loads it again (ollama's keep_alive). None: loaded for good.
    keep_alive: float | None = Field(None, gt=0)
    # keep the prompts it serves (depctl.recordings) to train a draft head on them; changes apply without a reload
    record_prompts: bool = False
    # bytes of prompt blocks kept for later prompts of the same tenant that start the same way (depctl's engine);
    # None: a tenth of the memory free after loading, at most 1 GiB; 0: none
    prefix_cache_bytes: int | None = Field(None, ge=0)
    prefix_cache_scope: PrefixCacheScope = "user"
    # a draft head that learns from this deployment's traffic; None: off
    learn_draft_head: LearnDraftHead | None = None
    # changes apply without a reload
    sampling: SamplingDefaults = SamplingDefaults()
    created_at: datetime = Field(default_factory=_now)
    updated_at: datetime = Field(default_factory=_now)

    @field_validator("id")
    @classmethod
    def _check_id(cls, value: str) -> str:
        check_deployment_id(value)
        return value

    @model_validator(mode="after")
    def _check_quantization(self) -> "DeploymentSpec":
        check_quantization(self.quantization, self.dtype, self.device)
        check_engine(self)
        check_learning(self)
        return self

    def to_yaml_dict(self) -> dict:
        return self.model_dump(mode="json")


def check_quantization(quantization: str, dtype: str, device: str) -> None:
    """Quantized weights are depctl's CPU kernels, with float32 or bfloat16 activations; raises ValueError naming the
    flag to change."""
    if quantization == "none":
        return
    if dtype == "float16":
        raise ValueError(
            f"--quantization {quantization} computes with float32 or bfloat16 activations, not float16: use --dtype "
            "auto, float32 or bfloat16, or --quantization none"
        )
    if device == "cuda":
        raise ValueError(
            f"--quantization {quantization} is a CPU kernel and has no CUDA kernel in this version: use --device cpu "
            "(or auto on a machine without a GPU), or --quantization none (bf16 on the GPU)"
        )


def check_engine(spec: "DeploymentSpec") -> None:
    """What each engine can run; raises ValueError naming the flag to change. vLLM's own refusals that a spec can
    show without loading anything are here, so ``create`` refuses them instead of a server failing to start."""
    if spec.engine == "depctl":
        for flag, value, default in (
            ("--tensor-parallel-size", spec.tensor_parallel_size, 1),
            ("--pipeline-parallel-size", spec.pipeline_parallel_size, 1),
            ("--ray-address", spec.ray_address, None),
        ):
            if value != default:
                raise ValueError(
                    f"{flag} needs --engine vllm: depctl's own engine runs on one device in one process "
                    f"(use --engine vllm to spread a model over GPUs or machines, or drop {flag})"
                )
        return
    if spec.quantization != "none":
        raise ValueError(
            f"--quantization {spec.quantization} is depctl's own kernel and vLLM has no equivalent: use "
            "--quantization none with --engine vllm (or a checkpoint quantized for vLLM), or --engine depctl"
        )
    if isinstance(spec.speculation, SuffixSpeculation):
        raise ValueError(
            "--suffix-speculation runs on depctl's engine (vLLM's `suffix` method needs the "
            "arctic-inference package, which depctl does not manage): use --engine depctl, or "
            "--ngram-speculation-length with --engine vllm"
        )
    precision = getattr(spec.speculation, "draft_precision", "auto")
    if precision != "auto":
        raise ValueError(
            f"--draft-precision {precision} applies to depctl's engine; vLLM holds the draft in the "
            "target's dtype: use --draft-precision auto with --engine vllm"
        )


def check_learning(spec: "DeploymentSpec") -> None:
    """What a learning head needs: depctl's engine, and an n-gram or suffix index to draft until it is good enough
    (and to give K); raises ValueError naming the flag to change."""
    if spec.learn_draft_head is None:
        return
    if spec.engine != "depctl":
        raise ValueError(
            "--learn-draft-head trains on depctl's own engine while it serves: use --engine depctl, or drop "
            "--learn-draft-head (train a head with `depctl draft train` and give it to vLLM as --draft-model)"
        )
    if not isinstance(spec.speculation, (NgramSpeculation, SuffixSpeculation)):
        given = "--draft-model" if isinstance(spec.speculation, DraftModelSpeculation) else "no speculation method"
        raise ValueError(
            f"--learn-draft-head drafts with --ngram-speculation-length or --suffix-speculation until its head is "
            f"better, and takes their --draft-token-count; got {given}: add --suffix-speculation (or "
            "--ngram-speculation-length N), or turn learning off with --no-learn-draft-head"
        )


def check_deployment_id(value: str) -> str:
    if not ID_PATTERN.match(value):
        raise ValueError(
            f"deployment id {value!r} is invalid: use 1-63 lowercase letters, digits and '-', starting with a "
            "letter or digit (no path separators)"
        )
    return value


def new_deployment_id(model: str) -> str:
    """``<model slug>-<6 hex>``, e.g. ``smollm2-135m-instruct-3f9c1a``."""
    base = model.rstrip("/").split("/")[-1].lower()
    base = re.sub(r"\.gguf$", "", base)
    slug = re.sub(r"[^a-z0-9]+", "-", base).strip("-")[:40] or "deployment"
    return f"{slug}-{secrets.token_hex(3)}"


@dataclass(frozen=True)
class SpeculationFlags:
    """The speculation flags of a ``create`` or ``update``, as typed (None: not given)."""

    draft_model: str | None = None
    draft_token_count: int | None = None
    ngram_speculation_length: int | None = None
    draft_precision: str | None = None
    disable: bool = False
    suffix: bool = False
    suffix_cache_tokens: int | None = None
    suffix_scope: str | None = None

    @property
    def methods(self) -> list[str]:
        """The method flags given, in the order the messages name them."""
        given = (
            ("--draft-model", self.draft_model is not None),
            ("--ngram-speculation-length", self.ngram_speculation_length is not None),
            ("--suffix-speculation", self.suffix),
        )
        return [flag for flag, on in given if on]

    @property
    def suffix_options(self) -> dict:
        """The suffix index's options given: {field: value}."""
        options = (("cache_tokens", self.suffix_cache_tokens), ("scope", self.suffix_scope))
        return {field: value for field, value in options if value is not None}

    @property
    def suffix_option_flags(self) -> list[str]:
        return [f"--suffix-{field.replace('_', '-')}" for field in self.suffix_options]

    @property
    def beside_precision(self) -> str | None:
        """The first flag given that a draft precision cannot go with."""
        given = (
            ("--ngram-speculation-length", self.ngram_speculation_length is not None),
            ("--suffix-speculation", self.suffix),
            ("--disable-speculative-decoding", self.disable),
        )
        return next((flag for flag, on in given if on), None)


def _on(current: AnySpeculation | None, kind: type) -> bool:
    return isinstance(current, kind)


def _where(current: AnySpeculation | None, what: str) -> str:
    """On update, why the deployment's own method does not help: `` (this deployment ...)``."""
    return f" (this deployment {what})" if current is not None else ""


@dataclass(frozen=True)
class FlagRule:
    """A combination of flags that is refused: when ``broken`` holds, a ``UsageError`` with ``message`` (a function
    of the flags and the deployment's current method, on update) and ``hint``."""

    broken: Callable[[SpeculationFlags, AnySpeculation | None], bool]
    message: Callable[[SpeculationFlags, AnySpeculation | None], str]
    hint: Callable[[SpeculationFlags], str | None] = lambda f: None


# the cross-flag rules, checked in order: the first that is broken is the one reported
FLAG_RULES: tuple[FlagRule, ...] = (
    FlagRule(
        lambda f, c: f.draft_precision is not None and f.beside_precision is not None,
        lambda f, c: f"--draft-precision applies to a draft model and cannot be used with {f.beside_precision}",
        lambda f: "drop --draft-precision, or use it with --draft-model",
    ),
    FlagRule(
        lambda f, c: f.draft_precision is not None and f.draft_model is None and not _on(c, DraftModelSpeculation),
        lambda f, c: f"--draft-precision needs --draft-model{_where(c, 'does not use a draft model')}",
        lambda f: "add --draft-model=MODEL --draft-token-count=N, or drop --draft-precision",
    ),
    FlagRule(
        lambda f, c: len(f.methods) > 1,
        lambda f, c: f"{f.methods[0]} and {f.methods[1]} cannot be used together: pick one speculation method",
        lambda f: (
            "use --draft-model=MODEL for a draft model, --ngram-speculation-length=N for prompt lookup, or "
            "--suffix-speculation to draft from this deployment's recent traffic as well"
        ),
    ),
    FlagRule(
        lambda f, c: bool(f.suffix_options) and not f.suffix and not _on(c, SuffixSpeculation),
        lambda f, c: (
            f"{f.suffix_option_flags[0]} needs --suffix-speculation" + _where(c, "does not use suffix speculation")
        ),
        lambda f: f"add --suffix-speculation --draft-token-count=N, or drop {f.suffix_option_flags[0]}",
    ),
    FlagRule(
        lambda f, c: f.disable and bool(f.methods or f.draft_token_count is not None or f.suffix_options),
        lambda f, c: (
            "--disable-speculative-decoding cannot be combined with --draft-model, "
            "--ngram-speculation-length, --suffix-speculation, --suffix-cache-tokens, --suffix-scope or "
            "--draft-token-count"
        ),
    ),
    FlagRule(
        lambda f, c: f.draft_model is not None and not f.draft_model.strip(),
        lambda f, c: "--draft-model must not be empty",
    ),
)


def speculation_from_flags(f: SpeculationFlags, current: AnySpeculation | None = None) -> AnySpeculation | None:
    """Turn the speculation flags into a ``Speculation``; the one place the cross-flag rules live (``FLAG_RULES``).

    ``current`` is the deployment's speculation on ``update``: there ``--draft-token-count`` alone changes the
    count of whatever method is configured, ``--draft-precision`` alone the precision of a configured draft
    model, and ``--suffix-cache-tokens`` / ``--suffix-scope`` alone the options of configured suffix speculation.
    Returns ``None`` on update when no speculation flag was given. Messages name the flags the user typed.
    """
    for rule in FLAG_RULES:
        if rule.broken(f, current):
            raise UsageError(rule.message(f, current), rule.hint(f))
    if f.disable:
        return NoSpeculation()
    try:
        if f.methods:
            return _new_method(f, current)
        if f.suffix_options:  # update: the suffix index's options (and maybe K)
            count = {"num_draft_tokens": f.draft_token_count} if f.draft_token_count is not None else {}
            return SuffixSpeculation.model_validate({**current.model_dump(), **f.suffix_options, **count})
    except ValidationError as exc:  # bounds are also enforced by the CLI; this guards library callers
        raise UsageError(_flag_bounds_message(exc)) from None
    return _same_method(f, current)


def _new_method(f: SpeculationFlags, current: AnySpeculation | None) -> AnySpeculation:
    """The method a flag names; options not given keep the deployment's own where it already uses that method."""
    count = f.draft_token_count
    if count is None:  # the deployment's own K when it switches method, else the method's default
        has_k = current is not None and not isinstance(current, NoSpeculation)
        count = current.num_draft_tokens if has_k else default_draft_tokens(f.methods[0])
    if f.draft_model is not None:
        kept = current.draft_precision if isinstance(current, DraftModelSpeculation) else "auto"
        return DraftModelSpeculation(
            draft_model=f.draft_model, num_draft_tokens=count, draft_precision=f.draft_precision or kept
        )
    if f.suffix:
        kept = current.model_dump(include={"cache_tokens", "scope"}) if isinstance(current, SuffixSpeculation) else {}
        return SuffixSpeculation(num_draft_tokens=count, **{**kept, **f.suffix_options})
    return NgramSpeculation(ngram_length=f.ngram_speculation_length, num_draft_tokens=count)


def _same_method(f: SpeculationFlags, current: AnySpeculation | None) -> AnySpeculation | None:
    """No method flag: on update, a new count or draft precision for the method the deployment has."""
    if f.draft_precision is not None and f.draft_token_count is None:  # the precision alone
        return current.model_copy(update={"draft_precision": f.draft_precision})
    if f.draft_token_count is None:
        return NoSpeculation() if current is None else None
    if current is None or isinstance(current, NoSpeculation):
        raise UsageError(
            "--draft-token-count needs --draft-model, --ngram-speculation-length or --suffix-speculation"
            + _where(current, "has speculation disabled"),
            "add --draft-model=MODEL, --ngram-speculation-length=N or --suffix-speculation, "
            "or drop --draft-token-count",
        )
    fields = {"num_draft_tokens": _check_count(f.draft_token_count)}
    if f.draft_precision is not None:
        fields["draft_precision"] = f.draft_precision
    return current.model_copy(update=fields)


def default_draft_tokens(method_flag: str) -> int:
    """K when the user gives none. Model-free drafts cost nothing to propose and the draft-length policy verifies
    only as many as pay, so they get a wider cap than a draft model, whose every token is a forward pass."""
    return DEFAULT_DRAFT_MODEL_TOKENS if method_flag == "--draft-model" else DEFAULT_MODEL_FREE_TOKENS


def _check_count(value: int) -> int:
    if not 1 <= value <= MAX_DRAFT_TOKENS:
        raise UsageError(f"--draft-token-count must be between 1 and {MAX_DRAFT_TOKENS}, got {value}")
    return value


def _flag_bounds_message(exc: ValidationError) -> str:
    flags = {
        "num_draft_tokens": "--draft-token-count",
        "ngram_length": "--ngram-speculation-length",
        "cache_tokens": "--suffix-cache-tokens",
        "scope": "--suffix-scope",
    }
    parts = []
    for err in exc.errors():
        field = str(err["loc"][-1]) if err["loc"] else ""
        parts.append(f"{flags.get(field, field)}: {err['msg']}")
    return "; ".join(parts)


def parse_duration(text: str) -> float | None:
    """``--keep-alive``: ``30s``, ``10m``, ``2h``, plain seconds, or ``forever`` (None)."""
    value = text.strip().lower()
    if value in ("forever", "never", "-1", "inf"):
        return None
    scale = {"s": 1, "m": 60, "h": 3600}.get(value[-1:], None)
    number = value[:-1] if scale else value
    try:
        seconds = float(number) * (scale or 1)
    except ValueError:
        raise UsageError(f"--keep-alive must be a duration such as 30s, 10m or 2h (or forever), got {text!r}") from None
    if not seconds > 0:
        raise UsageError(f"--keep-alive must be longer than 0, got {text!r}", "use forever to keep it loaded")
    return seconds


_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def parse_size(text: str, flag: str = "--prefix-cache-size") -> int | None:
    """``512MiB``, ``2GiB``, ``1g``, plain bytes, ``off`` (0) or ``auto`` (None: the default)."""
    value = text.strip().lower().replace(" ", "")
    if value == "auto":
        return None
    if value in ("off", "none", "0"):
        return 0
    number = value.rstrip("kmgib")
    unit = value[len(number) :]
    try:
        size = float(number) * _SIZE_UNITS[unit]
    except (ValueError, KeyError):
        raise UsageError(f"{flag} must be a size such as 512MiB or 2GiB (or auto, or off), got {text!r}") from None
    if size < 0:
        raise UsageError(f"{flag} cannot be negative, got {text!r}", "use off for none")
    return int(size)


def learn_from_flags(
    on: bool | None, size: str | None, start: str | None = None, current: "LearnDraftHead | None" = None
):
    """``--learn-draft-head/--no-learn-draft-head``, ``--learn-disk-size`` and ``--learn-draft-head-from`` (``start``,
    resolved; "" clears it) as the spec's ``learn_draft_head`` (on update, ``current`` is the deployment's); ``...``
    where none was given. ``--learn-draft-head-from`` turns learning on."""
    if on is None and size is None and start is None:
        return ...
    if on is False:
        for flag, value in (("--learn-disk-size", size), ("--learn-draft-head-from", start)):
            if value is not None:
                raise UsageError(f"{flag} cannot go with --no-learn-draft-head", "drop one of them")
        return None
    if on is None and current is None and not start:
        flag = "--learn-disk-size" if size is not None else "--learn-draft-head-from"
        raise UsageError(
            f"{flag} needs --learn-draft-head (this deployment does not learn a head)",
            f"add --learn-draft-head, or drop {flag}",
        )
    fields = dict(current.model_dump()) if current is not None else {}
    if size is not None:
        bytes_ = parse_size(size, "--learn-disk-size")
        if not bytes_ or bytes_ < MIN_LEARN_DISK_BYTES:
            raise UsageError(
                f"--learn-disk-size must be at least {describe_size(MIN_LEARN_DISK_BYTES)}, got {size!r}",
                "give a size such as 512MiB or 2GiB, or turn learning off with --no-learn-draft-head",
            )
        fields["disk_bytes"] = bytes_
    if start is not None:
        fields["start_from"] = start or None
    return LearnDraftHead(**fields)


def describe_size(size: int | None) -> str:
    if size is None:
        return "auto"
    if size == 0:
        return "off"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:g}{unit}"
    return f"{size}B"


def describe_duration(seconds: float | None) -> str:
    if seconds is None:
        return "forever"
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def describe_engine(spec: "DeploymentSpec") -> str:
    """``depctl``, or ``vllm`` with its parallelism when there is any: ``vllm (tp=2, pp=2, ray=auto)``."""
    if spec.engine != "vllm":
        return spec.engine
    parts = [f"tp={spec.tensor_parallel_size}"] if spec.tensor_parallel_size > 1 else []
    parts += [f"pp={spec.pipeline_parallel_size}"] if spec.pipeline_parallel_size > 1 else []
    parts += [f"ray={spec.ray_address}"] if spec.ray_address else []
    return "vllm" + (f" ({', '.join(parts)})" if parts else "")


def describe_speculation(spec: AnySpeculation) -> str:
    if isinstance(spec, NgramSpeculation):
        return f"ngram (n={spec.ngram_length}, k={spec.num_draft_tokens})"
    if isinstance(spec, SuffixSpeculation):
        cache = "" if spec.cache_tokens == DEFAULT_SUFFIX_CACHE_TOKENS else f", cache={spec.cache_tokens} tokens"
        shared = ", shared by all users" if spec.scope == "deployment" else ""
        return f"suffix (k={spec.num_draft_tokens}{cache}{shared})"
    if isinstance(spec, DraftModelSpeculation):
        precision = "" if spec.draft_precision == "auto" else f", {spec.draft_precision}"
        return f"draft {spec.draft_model} (k={spec.num_draft_tokens}{precision})"
    return "off"
