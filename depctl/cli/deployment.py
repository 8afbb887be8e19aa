"""``depctl deployment create | list | get | update | delete``."""

from __future__ import annotations

import dataclasses
import enum
import typing
from typing import Optional

import typer
from pydantic import ValidationError

from depctl import models, output
from depctl import spec as spec_module
from depctl.cli import views
from depctl.cli._common import DEPLOYMENT_ID, DEVICE_HELP, OUTPUT, connect, handle_errors
from depctl.errors import DepctlError, UsageError
from depctl.output import Format
from depctl.spec import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_DRAFT_MODEL_TOKENS,
    DEFAULT_MODEL_FREE_TOKENS,
    MAX_BATCH_SIZE,
    MAX_DRAFT_TOKENS,
    MAX_NGRAM_LENGTH,
    DeploymentSpec,
    DraftModelSpeculation,
    SamplingDefaults,
    SpeculationFlags,
    check_deployment_id,
    describe_duration,
    describe_engine,
    describe_size,
    describe_speculation,
    learn_from_flags,
    new_deployment_id,
    parse_duration,
    parse_size,
    speculation_from_flags,
)
from depctl.store import SpecStore

app = typer.Typer(rich_markup_mode=None, help="Create, inspect, change and delete deployments.", no_args_is_help=True)


def _choices(name: str, literal) -> type[enum.Enum]:
    """A str Enum for Typer from one of the spec's Literal types, so the CLI's choices are the spec's."""
    return enum.Enum(name, {value: value for value in typing.get_args(literal)}, type=str)


Device = _choices("Device", spec_module.Device)
Dtype = _choices("Dtype", spec_module.Dtype)
DraftPrecision = _choices("DraftPrecision", spec_module.DraftPrecision)
Quantization = _choices("Quantization", spec_module.Quantization)
Engine = _choices("Engine", spec_module.Engine)
SuffixScope = _choices("SuffixScope", spec_module.SuffixScope)
PrefixCacheScope = _choices("PrefixCacheScope", spec_module.PrefixCacheScope)


# Shared option declarations: bounds live in depctl.spec and are documented in README.md ("Flags").
DRAFT_MODEL = typer.Option(
    None, "--draft-model", metavar="MODEL", help="A smaller model with the same tokenizer that drafts tokens."
)
DRAFT_COUNT = typer.Option(
    None,
    "--draft-token-count",
    metavar="K",
    min=1,
    max=MAX_DRAFT_TOKENS,
    help=f"Most tokens drafted per step, 1-{MAX_DRAFT_TOKENS}. Default: {DEFAULT_DRAFT_MODEL_TOKENS} with a draft "
    f"model, {DEFAULT_MODEL_FREE_TOKENS} with n-gram or suffix (the policy verifies only as many as pay); on "
    "update, the deployment's own.",
)
NGRAM = typer.Option(
    None,
    "--ngram-speculation-length",
    metavar="N",
    min=1,
    max=MAX_NGRAM_LENGTH,
    help=f"Prompt-lookup speculation: match the last N tokens, 1-{MAX_NGRAM_LENGTH}.",
)
SUFFIX = typer.Option(
    False,
    "--suffix-speculation",
    help="Suffix speculation: draft from the longest match in this request and in the deployment's recent traffic "
    "(prompts and outputs), as far as the match is long and its continuation frequent.",
)
SUFFIX_CACHE = typer.Option(
    None,
    "--suffix-cache-tokens",
    metavar="TOKENS",
    min=spec_module.MIN_SUFFIX_CACHE_TOKENS,
    max=spec_module.MAX_SUFFIX_CACHE_TOKENS,
    help=f"Tokens of recent traffic the suffix index holds (least recently used evicted first; default "
    f"{spec_module.DEFAULT_SUFFIX_CACHE_TOKENS}, about 50 MB).",
)
SUFFIX_SCOPE = typer.Option(
    None,
    "--suffix-scope",
    metavar="[user|deployment]",
    help="Whose traffic a request drafts from. user (the default): requests with the same API key and `user` field "
    "only, so no user learns from drafts, counts or timing what another sent; deployment: everyone's (more drafts "
    "on traffic repeated across users).",
)
DRAFT_PRECISION = typer.Option(
    None,
    "--draft-precision",
    metavar="[auto|float32|bfloat16|float16|int8|int4]",
    help="How the draft model's weights are held; never changes the output. auto: int8 on CPU (about 3x faster "
    "drafting), the target's dtype on CUDA. int4: 4-bit grouped weights (CPU).",
)
QUANTIZATION_HELP = (
    "none, int8 or int4: weight-only int8 or 4-bit weights for the target, in groups of 32 (CPU only; 9 and 5 bits "
    "a weight); outputs change slightly, as llama.cpp's Q8_0 and Q4_K_M do; speculation stays exact against the "
    "quantized model."
)

COMPILE_HELP = (
    "Compile the decode and verify passes at load where that is faster and exact: on a CPU an AOTInductor "
    "library (~1.3x a step; the first load takes a minute or more, later loads reuse it), on CUDA CUDA "
    "graphs. --no-compile: always eager, and vLLM's --enforce-eager with --engine vllm."
)


ENGINE_HELP = (
    "depctl (default): our engine, one device; vllm: a vLLM server the daemon starts and supervises, "
    "for tensor/pipeline parallelism and Ray clusters (install it once: `depctl engine install vllm`)."
)
CONTEXT = typer.Option(
    None,
    "--max-context-length",
    metavar="TOKENS",
    min=spec_module.MIN_CONTEXT_LENGTH,
    help="Most tokens a request may span, prompt and output (default: the model's, up to 32768).",
)


def _parallel_option(flag: str, default: int | None, what: str):
    return typer.Option(
        default, flag, metavar="N", min=1, max=spec_module.MAX_PARALLEL_SIZE, help=f"{what} (--engine vllm)."
    )


TP_WHAT, PP_WHAT = "GPUs each layer is split over", "Pipeline stages the layers are split into"
RAY = typer.Option(
    None,
    "--ray-address",
    metavar="ADDRESS",
    help="A Ray cluster to run on, e.g. auto or ray://head:10001 (--engine vllm).",
)


def _batch_option(default):
    return typer.Option(
        default,
        "--max-batch-size",
        metavar="N",
        min=1,
        max=MAX_BATCH_SIZE,
        help=f"Most requests decoded together, 1-{MAX_BATCH_SIZE} (default {DEFAULT_BATCH_SIZE}); more wait in arrival "
        "order. A change reloads the deployment.",
    )


DISPLAY_NAME = typer.Option(None, "--display-name", metavar="NAME", help="A name to show beside the id.")
WAIT = typer.Option(True, "--wait/--no-wait", help="Wait until the daemon reports READY or FAILED.")
KEEP_ALIVE = typer.Option(
    None,
    "--keep-alive",
    metavar="DURATION",
    help="Free the deployment's memory after it has been idle this long (30s, 10m, 2h); the next request loads it "
    "again and waits for it. forever (the default) keeps it loaded. Applies without a reload.",
)
PREFIX_CACHE = typer.Option(
    None,
    "--prefix-cache-size",
    metavar="SIZE",
    help="Memory for prompt blocks already read, so a prompt that starts as an earlier one of the same tenant did "
    "reads only the rest (512MiB, 2GiB; off: none). auto (the default): a tenth of the memory free after loading, "
    "at most 1 GiB. depctl's engine.",
)
PREFIX_CACHE_SCOPE = typer.Option(
    None,
    "--prefix-cache-scope",
    metavar="[user|deployment]",
    help="Who finds the prompt blocks a request leaves in the prefix cache. user (the default): requests with the "
    "same API key and `user` field only, so no user learns from time to first token what another sent; deployment: "
    "everyone (a system prompt shared by all users is read once). A request's cache_salt always keeps it apart.",
)
RECORD_HELP = (
    "Keep the prompts this deployment serves (chat messages up to the last user turn, completion prompts; never "
    "answers), to train a draft head on its traffic: depctl draft train MODEL --from-deployment ID. Kept under the "
    "depctl home, deleted with the deployment. Applies without a reload."
)
LEARN_HELP = (
    "Learn a draft head from this deployment's own traffic: it records what the target computes while answering "
    "(under the depctl home, owner only, deleted with the deployment), trains in idle time, and replaces the n-gram "
    "or suffix drafts once it drafts better on held-out recent answers. Needs --suffix-speculation or "
    "--ngram-speculation-length. depctl's engine."
)
LEARN_DISK = typer.Option(
    None,
    "--learn-disk-size",
    metavar="SIZE",
    help="Disk for a learning head's recorded answers (default 1GiB; the oldest are deleted beyond it).",
)
LEARN_FROM = typer.Option(
    None,
    "--learn-draft-head-from",
    metavar="DIR",
    help="Learn a draft head starting from this one (a folder `depctl draft train` wrote for MODEL, with its default "
    "--draft-vocab): it drafts beside the n-gram or suffix index from the first request, and training goes on from "
    "it on this deployment's traffic. Implies --learn-draft-head; a deployment that has learned generations keeps "
    'them. "" on update: learn from nothing.',
)
_DEFAULT_FOR = "for requests that leave it out (a request's own value wins); applies without a reload"
TEMPERATURE = typer.Option(
    None, "--temperature", min=0.0, max=2.0, metavar="T", help=f"Sampling temperature {_DEFAULT_FOR}. Default 1.0."
)
TOP_P = typer.Option(None, "--top-p", min=0.0, max=1.0, metavar="P", help=f"Nucleus sampling's top_p {_DEFAULT_FOR}.")
TOP_K = typer.Option(None, "--top-k", min=0, metavar="K", help=f"top_k {_DEFAULT_FOR} (0: off).")
WAIT_TIMEOUT = typer.Option(900.0, "--wait-timeout", metavar="SECONDS", min=1.0, help="Seconds to wait with --wait.")


def _check_head_target(target: models.ResolvedModel, head: models.ResolvedModel, verifier: str, flag: str) -> None:
    """An EAGLE head reads its target's layers, so it must have been trained on them."""
    try:
        trained_for = models.resolve(verifier, "verifier") if verifier else None
    except models.ModelResolutionError:
        trained_for = None  # a path since moved, say: the daemon compares the weights' fingerprint at load
    if trained_for is not None and trained_for != target:
        raise UsageError(
            f"{flag} {head.ref} is an EAGLE head trained for {trained_for.ref}, not for {target.ref}",
            f"train one for this target: depctl draft train {target.ref} --out DIR",
        )


def _check_head_start(target: models.ResolvedModel, ref: str) -> str:
    """``--learn-draft-head-from``'s folder, resolved: an EAGLE head trained for ``target``."""
    head = models.resolve(ref, "--learn-draft-head-from")
    verifier = models.head_verifier(head)
    if verifier is None:
        raise UsageError(
            f"--learn-draft-head-from {ref} is not an EAGLE head (its config.json is no speculators eagle3 config)",
            f"give a folder depctl draft train wrote: depctl draft train {target.ref} --out DIR",
        )
    _check_head_target(target, head, verifier, "--learn-draft-head-from")
    return head.ref


def _check_draft(target: models.ResolvedModel, draft_ref: str) -> models.ResolvedModel:
    draft = models.resolve(draft_ref, "--draft-model")
    verifier = models.head_verifier(draft)
    if verifier is not None:
        _check_head_target(target, draft, verifier, "--draft-model")
        return draft
    if draft == target:
        raise UsageError(
            f"--draft-model {draft.ref} is the target model itself: drafting with it costs as much as decoding",
            "use a smaller model with the same tokenizer"
            + (
                f" (--draft-model={target.packaged.suggested_draft})"
                if target.packaged and target.packaged.suggested_draft
                else ""
            )
            + ", or --ngram-speculation-length=N / --suffix-speculation, which need no model",
        )
    # Packaged models know their tokenizer family: refuse a mismatched pair before anything is written. Other
    # pairs are checked by the daemon when it loads them (vocabularies compared token by token).
    if target.packaged and draft.packaged and target.packaged.family != draft.packaged.family:
        suggestion = target.packaged.suggested_draft
        raise UsageError(
            f"--draft-model {draft.ref} ({draft.packaged.family} tokenizer) cannot draft for {target.ref} "
            f"({target.packaged.family} tokenizer): draft and target must share a tokenizer",
            f"use --draft-model={suggestion}" if suggestion else "use --ngram-speculation-length=N instead",
        )
    return draft


def _check_device(device: str | None, engine: str) -> None:
    """``--device cuda`` where torch sees no GPU fails before anything is written, like every other check."""
    if device != "cuda" or engine != "depctl":  # vLLM runs in an environment of its own, with its own torch
        return
    import torch

    if not torch.cuda.is_available():
        raise UsageError(
            f"--device cuda: torch {torch.__version__} sees no CUDA GPU here "
            f"({'a CUDA build' if torch.version.cuda else 'a CPU-only build'})",
            "use --device auto (the GPU when there is one, else the CPU) or --device cpu",
        )


def _changes(old: DeploymentSpec, new: DeploymentSpec) -> str:
    """What an update changed, as ``field: old -> new`` (the speculation described, timestamps left out)."""
    skip = {"created_at", "updated_at", "speculation"}
    before, after = old.model_dump(mode="json"), new.model_dump(mode="json")
    parts = []
    if old.speculation != new.speculation:
        parts.append(f"speculation: {describe_speculation(old.speculation)} -> {describe_speculation(new.speculation)}")
    shown = {"keep_alive": describe_duration, "prefix_cache_bytes": describe_size}  # as the flags take them
    for key in after:
        if key not in skip and before.get(key) != after[key]:
            show = shown.get(key, str)
            parts.append(f"{key}: {show(before.get(key))} -> {show(after[key])}")
    return "; ".join(parts) or "nothing changed"


def _checked(make: typing.Callable[[], DeploymentSpec]) -> DeploymentSpec:
    """Build a spec; the cross-field rules (quantization, engine) come back as a UsageError naming the flags."""
    try:
        return make()
    except ValidationError as exc:
        messages = [str(e.get("ctx", {}).get("error") or e["msg"]).removeprefix("Value error, ") for e in exc.errors()]
        raise UsageError("; ".join(messages)) from None


def record(spec: DeploymentSpec, status: dict | None, daemon_up: bool) -> dict:
    """The user's intent merged with what the daemon observes (its status is never written into the spec)."""
    rec = spec.model_dump(mode="json")
    if status is not None:
        rec["status"] = {k: v for k, v in status.items() if k not in ("id", "model", "speculation")}
    else:
        reason = (
            "the daemon has not picked it up yet" if daemon_up else "the daemon is not running (`depctl daemon start`)"
        )
        rec["status"] = {"state": "UNKNOWN", "reason": reason}
    return rec


def _records(store: SpecStore, client) -> list[dict]:
    specs, broken = store.list()
    statuses = {s["id"]: s for s in client.deployments()} if client else {}
    rows = [record(spec, statuses.get(spec.id), client is not None) for spec in specs]
    for b in broken:
        output.message(("Warning: ", "yellow"), b.problem)
        rows.append(
            {"id": b.id, "path": str(b.path), "status": {"state": "FAILED", "reason": f"broken spec file: {b.problem}"}}
        )
    return rows


def _apply(dep_id: str, wait: bool, timeout: float, fmt: Format, store: SpecStore, verb: str) -> None:
    """Tell the daemon (starting it if needed), optionally wait for READY/FAILED, print the deployment."""
    try:
        client = connect(autostart=True)
        client.reconcile()
    except DepctlError as exc:
        raise type(exc)(
            f"deployment {dep_id!r} was {verb}, but the daemon is unavailable: {exc.message}", exc.hint
        ) from None
    status = client.deployment(dep_id)
    if wait:
        with output.progress() as progress:
            task = progress.add_task(f"{dep_id}: waiting for the daemon", total=None)

            def show(s):
                if s:
                    description, fraction = views.wait_line(dep_id, s)
                    progress.update(task, description=description, total=1 if fraction is not None else None)
                    progress.update(task, completed=fraction or 0)

            status = client.wait_settled(dep_id, timeout, on_poll=show)
    rec = record(store.get(dep_id), status, True)
    output.emit(rec, fmt, views.detail_table)
    if status and status["state"] == "FAILED":
        raise DepctlError(
            f"deployment {dep_id!r} FAILED: {status.get('reason')}",
            f"fix it with `depctl deployment update {dep_id} ...`, "
            f"or remove it with `depctl deployment delete {dep_id}`",
        )


@app.command()
@handle_errors
def create(
    model: str = typer.Argument(
        ..., metavar="MODEL", help="A local model directory, a .gguf file, a packaged alias or a hub id."
    ),
    deployment_id: Optional[str] = typer.Option(
        None, "--deployment-id", metavar="ID", help="Default: derived from MODEL."
    ),
    display_name: Optional[str] = typer.Option(
        None, "--display-name", metavar="NAME", help="A name to show beside the id."
    ),
    draft_model: Optional[str] = DRAFT_MODEL,
    draft_token_count: Optional[int] = DRAFT_COUNT,
    ngram_speculation_length: Optional[int] = NGRAM,
    suffix_speculation: bool = SUFFIX,
    suffix_cache_tokens: Optional[int] = SUFFIX_CACHE,
    suffix_scope: Optional[SuffixScope] = SUFFIX_SCOPE,
    draft_precision: Optional[DraftPrecision] = DRAFT_PRECISION,
    max_batch_size: int = _batch_option(DEFAULT_BATCH_SIZE),
    device: Device = typer.Option(Device.auto, "--device", metavar="[auto|cpu|cuda]", help=DEVICE_HELP),
    dtype: Dtype = typer.Option(
        Dtype.auto,
        "--dtype",
        metavar="[auto|float32|bfloat16|float16]",
        help="auto: bfloat16 on CUDA and on CPUs with bf16 instructions, else float32.",
    ),
    quantization: Quantization = typer.Option(
        Quantization.none, "--quantization", metavar="[none|int8|int4]", help=QUANTIZATION_HELP
    ),
    compile_passes: bool = typer.Option(True, "--compile/--no-compile", help=COMPILE_HELP),
    engine: Engine = typer.Option(Engine.depctl, "--engine", metavar="[depctl|vllm]", help=ENGINE_HELP),
    max_context_length: Optional[int] = CONTEXT,
    tensor_parallel_size: int = _parallel_option("--tensor-parallel-size", 1, TP_WHAT),
    pipeline_parallel_size: int = _parallel_option("--pipeline-parallel-size", 1, PP_WHAT),
    ray_address: Optional[str] = RAY,
    keep_alive: Optional[str] = KEEP_ALIVE,
    prefix_cache_size: Optional[str] = PREFIX_CACHE,
    prefix_cache_scope: Optional[PrefixCacheScope] = PREFIX_CACHE_SCOPE,
    record_prompts: bool = typer.Option(False, "--record-prompts/--no-record-prompts", help=RECORD_HELP),
    learn_draft_head: bool = typer.Option(False, "--learn-draft-head/--no-learn-draft-head", help=LEARN_HELP),
    learn_disk_size: Optional[str] = LEARN_DISK,
    learn_draft_head_from: Optional[str] = LEARN_FROM,
    temperature: Optional[float] = TEMPERATURE,
    top_p: Optional[float] = TOP_P,
    top_k: Optional[int] = TOP_K,
    validate_only: bool = typer.Option(
        False, "--validate-only", help="Print the spec that would be written; write nothing."
    ),
    wait: bool = WAIT,
    wait_timeout: float = WAIT_TIMEOUT,
    fmt: Format = OUTPUT,
) -> None:
    """Create a deployment of MODEL, optionally with speculative decoding."""
    speculation = speculation_from_flags(
        SpeculationFlags(
            draft_model=draft_model,
            draft_token_count=draft_token_count,
            ngram_speculation_length=ngram_speculation_length,
            draft_precision=draft_precision.value if draft_precision else None,
            suffix=suffix_speculation,
            suffix_cache_tokens=suffix_cache_tokens,
            suffix_scope=suffix_scope and suffix_scope.value,
        )
    )
    target = models.resolve(model, "MODEL")
    start = _check_head_start(target, learn_draft_head_from) if learn_draft_head_from else None
    learning = learn_from_flags(learn_draft_head or None, learn_disk_size, start)
    if isinstance(speculation, DraftModelSpeculation):
        draft = _check_draft(target, speculation.draft_model)
        speculation = speculation.model_copy(update={"draft_model": draft.ref})
    dep_id = deployment_id if deployment_id is not None else new_deployment_id(model)
    try:
        check_deployment_id(dep_id)
    except ValueError as exc:
        raise UsageError(f"--deployment-id: {exc}") from None
    spec = _checked(
        lambda: DeploymentSpec(
            id=dep_id,
            display_name=display_name,
            model=target.ref,
            speculation=speculation,
            max_batch_size=max_batch_size,
            device=device.value,
            dtype=dtype.value,
            quantization=quantization.value,
            compile=compile_passes,
            engine=engine.value,
            max_context_length=max_context_length,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            ray_address=ray_address or None,
            keep_alive=parse_duration(keep_alive) if keep_alive is not None else None,
            record_prompts=record_prompts,
            prefix_cache_bytes=parse_size(prefix_cache_size) if prefix_cache_size is not None else None,
            prefix_cache_scope=(prefix_cache_scope or PrefixCacheScope.user).value,
            learn_draft_head=None if learning is ... else learning,
            sampling=SamplingDefaults(temperature=temperature, top_p=top_p, top_k=top_k),
        )
    )
    _check_device(spec.device, spec.engine)
    store = SpecStore()
    if validate_only:
        store.check_new(spec.id)
        output.emit(spec.model_dump(mode="json"), Format.yaml if fmt == Format.table else fmt, lambda d: d)
        output.message("Valid. Nothing was written (--validate-only).")
        return
    store.create(spec)
    engine_note = "" if spec.engine == "depctl" else f", engine: {describe_engine(spec)}"
    output.message(
        "Created deployment ",
        (dep_id, "bold"),
        f" ({target.ref}, speculation: {describe_speculation(speculation)}{engine_note})",
    )
    _apply(dep_id, wait, wait_timeout, fmt, store, "created")


@app.command("list")
@handle_errors
def list_(fmt: Format = OUTPUT) -> None:
    """List deployments with their state and speculation statistics."""
    store = SpecStore()
    client = connect(autostart=False)
    rows = _records(store, client)
    output.emit(rows, fmt, views.list_table)


@app.command()
@handle_errors
def get(deployment_id: str = DEPLOYMENT_ID, fmt: Format = OUTPUT) -> None:
    """Show one deployment: its spec, state and speculation statistics."""
    store = SpecStore()
    spec = store.get(deployment_id)
    client = connect(autostart=False)
    status = client.deployment(deployment_id) if client else None
    output.emit(record(spec, status, client is not None), fmt, views.detail_table)


@app.command()
@handle_errors
def update(
    deployment_id: str = DEPLOYMENT_ID,
    draft_model: Optional[str] = DRAFT_MODEL,
    draft_token_count: Optional[int] = DRAFT_COUNT,
    ngram_speculation_length: Optional[int] = NGRAM,
    suffix_speculation: bool = SUFFIX,
    suffix_cache_tokens: Optional[int] = SUFFIX_CACHE,
    suffix_scope: Optional[SuffixScope] = SUFFIX_SCOPE,
    draft_precision: Optional[DraftPrecision] = DRAFT_PRECISION,
    disable_speculative_decoding: bool = typer.Option(
        False, "--disable-speculative-decoding", help="Turn speculation off."
    ),
    display_name: Optional[str] = typer.Option(
        None, "--display-name", metavar="NAME", help="A name to show beside the id."
    ),
    max_batch_size: Optional[int] = _batch_option(None),
    device: Optional[Device] = typer.Option(None, "--device", metavar="[auto|cpu|cuda]", help=DEVICE_HELP),
    dtype: Optional[Dtype] = typer.Option(
        None,
        "--dtype",
        metavar="[auto|float32|bfloat16|float16]",
        help="auto: bfloat16 on CUDA and on CPUs with bf16 instructions, else float32.",
    ),
    quantization: Optional[Quantization] = typer.Option(
        None, "--quantization", metavar="[none|int8|int4]", help=QUANTIZATION_HELP
    ),
    compile_passes: Optional[bool] = typer.Option(None, "--compile/--no-compile", help=COMPILE_HELP),
    engine: Optional[Engine] = typer.Option(None, "--engine", metavar="[depctl|vllm]", help=ENGINE_HELP),
    max_context_length: Optional[int] = CONTEXT,
    tensor_parallel_size: Optional[int] = _parallel_option("--tensor-parallel-size", None, TP_WHAT),
    pipeline_parallel_size: Optional[int] = _parallel_option("--pipeline-parallel-size", None, PP_WHAT),
    ray_address: Optional[str] = RAY,
    keep_alive: Optional[str] = KEEP_ALIVE,
    prefix_cache_size: Optional[str] = PREFIX_CACHE,
    prefix_cache_scope: Optional[PrefixCacheScope] = PREFIX_CACHE_SCOPE,
    record_prompts: Optional[bool] = typer.Option(None, "--record-prompts/--no-record-prompts", help=RECORD_HELP),
    learn_draft_head: Optional[bool] = typer.Option(None, "--learn-draft-head/--no-learn-draft-head", help=LEARN_HELP),
    learn_disk_size: Optional[str] = LEARN_DISK,
    learn_draft_head_from: Optional[str] = LEARN_FROM,
    temperature: Optional[float] = TEMPERATURE,
    top_p: Optional[float] = TOP_P,
    top_k: Optional[int] = TOP_K,
    wait: bool = WAIT,
    wait_timeout: float = WAIT_TIMEOUT,
    fmt: Format = OUTPUT,
) -> None:
    """Change a deployment's speculation (or name, engine, device, dtype, quantization, context, parallelism). On
    depctl's engine a new --draft-token-count applies without a reload. --ray-address "" clears it."""
    store = SpecStore()
    current = store.get(deployment_id)
    flags = SpeculationFlags(
        draft_model=draft_model,
        draft_token_count=draft_token_count,
        ngram_speculation_length=ngram_speculation_length,
        draft_precision=draft_precision.value if draft_precision else None,
        disable=disable_speculative_decoding,
        suffix=suffix_speculation,
        suffix_cache_tokens=suffix_cache_tokens,
        suffix_scope=suffix_scope and suffix_scope.value,
    )
    speculation = speculation_from_flags(flags, current.speculation)
    others = {
        "display_name": display_name,
        "max_batch_size": max_batch_size,
        "device": device and device.value,
        "dtype": dtype and dtype.value,
        "quantization": quantization and quantization.value,
        "compile": compile_passes,
        "engine": engine and engine.value,
        "max_context_length": max_context_length,
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
        "ray_address": ray_address,
        "record_prompts": record_prompts,
        "prefix_cache_scope": prefix_cache_scope and prefix_cache_scope.value,
    }
    others = {k: v for k, v in others.items() if v is not None}
    if keep_alive is not None:
        others["keep_alive"] = parse_duration(keep_alive)  # None: forever
    if prefix_cache_size is not None:
        others["prefix_cache_bytes"] = parse_size(prefix_cache_size)  # None: auto
    start = learn_draft_head_from
    if start:
        start = _check_head_start(models.resolve(current.model, "MODEL"), start)
    learning = learn_from_flags(learn_draft_head, learn_disk_size, start, current.learn_draft_head)
    if learning is not ...:
        others["learn_draft_head"] = learning
    if "ray_address" in others and not others["ray_address"]:
        others["ray_address"] = None  # --ray-address "": back to one machine
    sampling = {k: v for k, v in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k)) if v is not None}
    if speculation is None and not others and not sampling:
        raise UsageError(
            "nothing to update",
            "pass --draft-model/--ngram-speculation-length/--suffix-speculation with --draft-token-count, "
            "--draft-token-count, --suffix-cache-tokens, --suffix-scope, --draft-precision, "
            "--disable-speculative-decoding, --max-batch-size, --display-name, --device, --dtype, --quantization, "
            "--compile/--no-compile, --engine, --max-context-length, --tensor-parallel-size, "
            "--pipeline-parallel-size, --ray-address, --keep-alive, --prefix-cache-size, --prefix-cache-scope, "
            "--record-prompts/--no-record-prompts, --learn-draft-head/--no-learn-draft-head, --learn-disk-size, "
            "--learn-draft-head-from, "
            "--temperature, --top-p or --top-k",
        )
    if sampling:
        others["sampling"] = {**current.sampling.model_dump(), **sampling}
    checked = _checked(
        lambda: DeploymentSpec.model_validate(
            {**current.model_dump(), **({"speculation": speculation} if speculation is not None else {}), **others}
        )
    )
    if "device" in others or "engine" in others:
        _check_device(checked.device, checked.engine)
    if isinstance(speculation, DraftModelSpeculation) and draft_model is not None:
        draft = _check_draft(models.resolve(current.model, "MODEL"), speculation.draft_model)
        flags = dataclasses.replace(flags, draft_model=draft.ref)

    def change(spec: DeploymentSpec) -> DeploymentSpec:
        # recomputed under the store's lock from the spec as it is now, so concurrent updates compose
        fields = dict(others)
        if sampling:
            fields["sampling"] = {**spec.sampling.model_dump(), **sampling}
        new = speculation_from_flags(flags, spec.speculation)
        if new is not None:
            fields["speculation"] = new
        # validated as a whole against the spec as it is now (model_copy would skip the cross-field rules)
        return _checked(lambda: DeploymentSpec.model_validate({**spec.model_dump(), **fields}))

    before = store.get(deployment_id)
    updated = store.update(deployment_id, change)
    output.message("Updated deployment ", (deployment_id, "bold"), f" ({_changes(before, updated)})")
    _apply(deployment_id, wait, wait_timeout, fmt, store, "updated")


@app.command()
@handle_errors
def delete(
    deployment_id: str = DEPLOYMENT_ID,
    wait: bool = typer.Option(True, "--wait/--no-wait", help="Wait until the daemon has unloaded it."),
) -> None:
    """Delete a deployment: its spec is removed and the daemon unloads it."""
    store = SpecStore()
    store.delete(deployment_id)
    client = connect(autostart=False)
    if client is not None:
        client.reconcile()
        if wait:
            client.wait_settled(deployment_id, 120.0, gone=True)
    output.message("Deleted deployment ", (deployment_id, "bold"))


class ExportFormat(str, enum.Enum):
    vllm = "vllm"
    ray_serve = "ray-serve"
    kserve = "kserve"


class ModelSource(str, enum.Enum):
    hub = "hub"
    local = "local"


@app.command()
@handle_errors
def export(
    deployment_id: str = DEPLOYMENT_ID,
    fmt: ExportFormat = typer.Option(
        ...,
        "--format",
        "-f",
        metavar="[vllm|ray-serve|kserve]",
        help="vllm: the `vllm serve` command; ray-serve: a Ray Serve LLM config; kserve: an InferenceService.",
    ),
    model_source: ModelSource = typer.Option(
        ModelSource.hub,
        "--model-source",
        metavar="[hub|local]",
        help="hub: packaged models as their original hub checkpoints (for a cluster); local: depctl's local copies.",
    ),
    min_replicas: int = typer.Option(
        1, "--min-replicas", metavar="N", min=0, help="ray-serve and kserve: fewest replicas."
    ),
    max_replicas: int = typer.Option(
        4, "--max-replicas", metavar="N", min=1, help="ray-serve and kserve: most replicas."
    ),
) -> None:
    """Print what a cluster takes to run this deployment on vLLM: the same model, speculation, context, batch size
    and parallelism. Works for either --engine."""
    from depctl.export import export as render

    if max_replicas < min_replicas:
        raise UsageError(f"--max-replicas {max_replicas} is less than --min-replicas {min_replicas}")
    spec = SpecStore().get(deployment_id)
    typer.echo(
        render(spec, fmt.value, model_source=model_source.value, min_replicas=min_replicas, max_replicas=max_replicas),
        nl=False,
    )
