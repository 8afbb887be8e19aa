"""Turn a deployment spec into a ready engine: resolve the models, check they fit, load them, pair the tokenizers.

Everything here may take seconds to minutes (downloads, GGUF conversion, weights) and runs on the daemon's
loader thread, never on a request path. Failures raise ``LoadError`` with a message the user can act on; the
deployment then goes to FAILED with that message as its reason.
"""

from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from depctl import config, models
from depctl.errors import DepctlError, first_line
from depctl.spec import DeploymentSpec, DraftModelSpeculation, NgramSpeculation, SuffixSpeculation
from depctl_runtime.backends import heads
from depctl_runtime.backends.base import Stage
from depctl_runtime.kernels import native
from depctl_runtime.kernels.quantized import quantized_linears
from depctl_runtime.kernels.surgery import (
    SplitKLinear,
    WeightMajorLinear,
    blocked_linears,
    int8_linears,
    int8_row_invariant,
    int8_weight_linears,
    onednn_linears,
    onednn_row_invariant,
    plain_stand_in_bytes,
    products,
    row_invariant_chunk,
    split_k_linears,
    weight_major_linears,
)
from depctl_runtime.model import compiled, graphs
from depctl_runtime.model.decoder import fuse_projections
from depctl_runtime.model.head import ScreenedHead, screen_output_layer
from depctl_runtime.model.runner import ModelRunner
from depctl_runtime.speculation import (
    DraftModelProposer,
    EngineConfig,
    NgramProposer,
    SpeculativeEngine,
    SuffixProposer,
)
from depctl_runtime.speculation.eagle import EagleProposer
from depctl_runtime.speculation.grammar import GrammarCompiler

log = logging.getLogger("depctl.loader")

MAX_CONTEXT_CAP = 32768
INT8_WEIGHTS = "int8 weights"  # a target's --quantization int8: weight-only int8 in groups (kernels.quantized)
INT4_WEIGHTS = "int4 weights"  # --quantization int4, and a draft's --draft-precision int4
QUANTIZED = {"int8": INT8_WEIGHTS, "int4": INT4_WEIGHTS}
COMPILED_PRECISIONS = (INT8_WEIGHTS, INT4_WEIGHTS, "float32", "bfloat16")  # compiled where faster: see compile_passes


class LoadError(Exception):
    pass


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    source: str  # what from_pretrained loaded (a directory or a hub id)
    device: torch.device
    dtype: torch.dtype
    # how the weights are held: the dtype's name, "int8" (a draft's dynamic int8 linears), INT8_WEIGHTS or INT4_WEIGHTS
    precision: str = ""

    def __post_init__(self):
        self.precision = self.precision or str(self.dtype).removeprefix("torch.")


@dataclass
class LoadedDeployment:
    engine: SpeculativeEngine
    tokenizer: object
    target: LoadedModel
    draft: LoadedModel | None
    max_context: int
    calibration: dict
    compiled: str = "no"  # what ``deployment get`` shows: how decode and verify passes run, and why
    products: str = ""  # and what computes the target's matrix products (``surgery.products``)
    grammars: GrammarCompiler | None = None  # compiles requests' constraints (None: the tokenizer cannot)

    def release(self) -> None:
        """Free the weights now that nothing will run this engine again (a reload, a delete, a stale load): a compiled
        library would otherwise keep them (``ModelRunner.release``)."""
        self.engine.target.release()
        if self.engine.draft_model is not None:
            self.engine.draft_model.release()


Report = Callable[[Stage], None]


def log_progress(stage: Stage) -> None:
    log.info("%s", stage)


class PassKind(enum.Enum):
    EAGER = "eager"
    COMPILED = "compiled"  # an AOTInductor library (a CPU)
    CUDA_GRAPHS = "cuda graphs"


@dataclass(frozen=True)
class Passes:
    """How a deployment's decode and verify passes run: the runners to use, and why (``deployment get``)."""

    target: ModelRunner
    draft: ModelRunner | None
    kind: PassKind
    detail: str

    def describe(self) -> str:
        return f"{'no' if self.kind == PassKind.EAGER else 'yes'} ({self.detail})"


def _exact(runner: ModelRunner, make, failed: str, what: str, device: str) -> tuple[ModelRunner, str | None]:
    """``runner`` with the pass ``make(runner)`` builds, kept only if a verify pass through it equals one-token steps
    through it bit for bit (``compiled.check``); else the eager runner and why not."""
    try:
        fast = runner.with_pass(make())
        exact = compiled.check(fast)
    except Exception as exc:  # noqa: BLE001 - any failure here means: run eagerly
        log.warning("%s; the passes run eagerly", failed, exc_info=exc)
        return runner, f"{failed}: {first_line(exc, 240)}"
    if not exact:
        return runner, f"{what} rounded differently from single steps on this {device}"
    return fast, None


def graph_passes(runner: ModelRunner, width: int, draft: ModelRunner | None = None) -> Passes:
    """On CUDA: the target's decode and verify passes at one fixed shape, ``max_rows x width`` tokens (width = 1 +
    the most drafts a row verifies), replayed from CUDA graphs (``model.graphs``) once proven exact on this
    GPU; a draft model's one- and two-token forwards likewise (its output only proposes, so no check)."""
    if not runner.fused:
        return Passes(
            runner,
            draft,
            PassKind.EAGER,
            "this architecture keeps transformers' forward, which is not recorded into CUDA graphs",
        )
    runner.forward(0, [[0]], prefill=True)  # the cache's tensors exist from the first forward
    runner.set_length(0, 0)
    target, refused = _exact(
        runner,
        lambda: graphs.FixedShapePass(runner.model, runner.cache, runner.max_rows, (width,), features=runner.features),
        "recording CUDA graphs failed",
        "a verify pass through the CUDA graphs",
        "GPU",
    )
    if refused:
        return Passes(runner, draft, PassKind.EAGER, refused)
    drafts = ""
    if draft is not None and draft.fused:
        try:
            draft.forward(0, [[0]], prefill=True)
            draft.set_length(0, 0)
            graphed = draft.with_pass(graphs.FixedShapePass(draft.model, draft.cache, draft.max_rows, (1, 2)))
            graphed.forward(0, [[1]])
            graphed.set_length(0, 0)
            draft, drafts = graphed, "; the draft model's forwards too"
        except Exception as exc:  # noqa: BLE001
            log.warning("recording the draft model's CUDA graphs failed; it runs eagerly", exc_info=exc)
    return Passes(target, draft, PassKind.CUDA_GRAPHS, f"{target.fast_pass.describe()}{drafts}")


def compile_passes(
    runner: ModelRunner,
    precision: str,
    wanted: bool,
    width: int = 1,
    draft: ModelRunner | None = None,
    report: Report = log_progress,
    draft_precision: str | None = None,
) -> Passes:
    """The fastest exact pass strategy for this runner: a compiled library on a CPU where it is faster
    (BENCHMARKS.md), CUDA graphs on a GPU, else eager. Split-K and weight-major linears (where oneDNN is not
    row-invariant) would become inductor's own, slower products: those stay eager. A compile that fails leaves the
    eager pass and says why; it never fails the deployment."""

    def eager(why: str) -> Passes:
        return Passes(runner, draft, PassKind.EAGER, why)

    if not wanted:
        return eager("the spec says compile: false")
    if runner.device.type == "cuda":
        return graph_passes(runner, width, draft)
    if runner.device.type != "cpu":
        return eager(f"no compiled passes on {runner.device.type}")
    if precision not in COMPILED_PRECISIONS:
        return eager(f"{precision} passes ran slower compiled on a CPU; int8 weights, bfloat16 and float32 compile")
    if any(isinstance(m, (SplitKLinear, WeightMajorLinear)) for m in runner.model.modules()):
        return eager(
            "this CPU's oneDNN linear is not row-invariant, so the products are split-K or weight-major ones, "
            "which ran slower compiled"
        )
    if not runner.fused:
        return eager("this architecture keeps transformers' forward, which does not compile")
    too_big = _too_big_to_build(runner, precision)
    if too_big:
        return eager(too_big)
    built = ""

    def library() -> compiled.CompiledPass:
        nonlocal built
        fast, built = _library(runner, precision, "the decode and verify passes", report)
        return fast

    target, refused = _exact(runner, library, "compiling failed", "a verify pass through the compiled library", "CPU")
    if refused:
        return eager(refused)
    screened = ""
    if isinstance(target.model.lm_head, ScreenedHead):  # the native ops are loaded now: switch the screen on
        target.model.lm_head.screen(target.vocab_size)
        screened = "; greedy tokens screened in bf16 before the float32 output layer"
    draft, drafts = _compiled_draft(draft, draft_precision, report)
    return Passes(target, draft, PassKind.COMPILED, f"{target.fast_pass.describe()}{built}{screened}{drafts}")


def _too_big_to_build(runner: ModelRunner, precision: str) -> str | None:
    """Why a library for this runner cannot be built now, if it cannot. Its cache's tensors exist afterwards."""
    runner.forward(0, [[0]], prefill=True)  # the cache's tensors exist from the first forward
    runner.set_length(0, 0)
    if compiled.package_path(runner.model, precision, config.cache_dir() / "compiled").exists():
        return None
    # the build traces over plain stand-ins of oneDNN's reordered weights (``surgery.plain_stand_ins``): the float
    # weights' size again, for as long as it compiles. Better to run eagerly than to meet the OOM killer.
    stand_ins = plain_stand_in_bytes(runner.model)
    free = free_bytes(runner.device)
    if stand_ins and free is not None and stand_ins > 0.8 * free:
        return (
            f"building the library needs about {stand_ins / 2**30:.2f} GiB free while it compiles and "
            f"{free / 2**30:.2f} GiB is; free memory and update the deployment to retry, or --no-compile"
        )
    return None


def _library(runner: ModelRunner, precision: str, what: str, report: Report) -> tuple[compiled.CompiledPass, str]:
    """The runner's compiled pass, built first where no library for its model and precision exists yet; and
    ", built in Ns" when it was."""
    package = compiled.package_path(runner.model, precision, config.cache_dir() / "compiled", runner.features)
    if package.exists():
        try:
            return compiled.CompiledPass(package, runner.model, runner.features), ""
        except Exception as exc:  # noqa: BLE001 - cut short or corrupt (a full disk, a copy): built again below
            log.warning("the compiled library %s does not open (%s); building it again", package, exc)
            package.unlink(missing_ok=True)
    report(
        Stage(
            "compiling",
            f"{what} (once per model and precision; a minute or more on a small CPU; later loads reuse it)",
        )
    )
    built = f", built in {compiled.build(runner.model, runner.cache, package, runner.features):.0f}s"
    return compiled.CompiledPass(package, runner.model, runner.features), built


def _compiled_draft(draft: ModelRunner | None, precision: str | None, report: Report) -> tuple[ModelRunner | None, str]:
    """A CPU draft model through a library of its own where its precision compiles: eager, a 0.5B draft's forward
    spent a third of its time between ops. Its output only proposes, so there is no exactness check; a failure
    leaves it eager and says why."""
    if draft is None or precision not in COMPILED_PRECISIONS or not draft.fused:
        return draft, ""
    if any(isinstance(m, (SplitKLinear, WeightMajorLinear)) for m in draft.model.modules()):
        return draft, ""  # as for the target: inductor's own products would be slower
    too_big = _too_big_to_build(draft, precision)
    if too_big:
        return draft, f"; the draft model runs eagerly: {too_big}"
    try:
        fast, built = _library(draft, precision, "the draft model's passes", report)
        return draft.with_pass(fast), f"; the draft model through {fast.describe()}{built}"
    except Exception as exc:  # noqa: BLE001 - any failure here means: draft eagerly
        log.warning("compiling the draft model failed; it runs eagerly", exc_info=exc)
        return draft, f"; the draft model runs eagerly (compiling it failed: {first_line(exc, 160)})"


def pick_device(requested: str) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise LoadError(
                "device 'cuda' was requested but torch sees no CUDA GPU "
                f"(torch {torch.__version__}, built {'with' if torch.version.cuda else 'without'} CUDA); "
                "update the deployment with --device cpu or --device auto"
            )
        return torch.device("cuda")
    return torch.device("cpu")


def pick_dtype(requested: str, device: torch.device, quantization: str = "none") -> torch.dtype:
    if quantization != "none":  # the activations' dtype around depctl's quantized products
        if device.type != "cpu":
            raise LoadError(
                f"--quantization {quantization} is a CPU kernel in this version, and this deployment resolved to "
                f"{device.type}: update it with --device cpu, or --quantization none"
            )
        if not native.available():
            return _quantized_without_native(quantization)
        if requested != "auto":
            return getattr(torch, requested)
        return torch.bfloat16 if cpu_has_bf16() and native.blocked_supports(torch.bfloat16) else torch.float32
    if requested != "auto":
        return getattr(torch, requested)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    # With bf16 dot-product instructions (AVX-512 BF16, AMX) bf16 halves the bytes a step reads and a product of a few
    # rows costs little more than one; without them bf16 is emulated and float32 is the fast choice. Either way the
    # result stays exact (surgery).
    if cpu_has_bf16() and cpu_bf16_exact():
        return torch.bfloat16
    return torch.float32


def _quantized_without_native(quantization: str) -> torch.dtype:
    """Where depctl's C++ ops cannot be built: int8 through PyTorch's own int8 weight kernel (bf16 activations,
    one scale a row); no int4."""
    if quantization == "int4":
        raise LoadError(
            "--quantization int4 runs on depctl's C++ ops, which could not be built here (the log says why): "
            "install a C++ compiler (g++ or clang++) and update the deployment to retry, or use --quantization int8"
        )
    if not int8_row_invariant(torch.bfloat16):
        raise LoadError(
            "this CPU's int8 weight kernel gives a row a different result depending on how many rows "
            "share the pass, so speculation would not be exact: update the deployment with "
            "--quantization none"
        )
    return torch.bfloat16


def cpu_bf16_exact() -> bool:
    """Whether this CPU can run a bf16 target exactly under speculation: our blocked product runs here (AVX-512 BF16:
    ``BlockedLinear``), oneDNN's linear is row-invariant from two rows (``OneDNNLinear``), or ``F.linear`` is once its
    inner dimension is cut (``SplitKLinear``)."""
    return (
        native.blocked_supports(torch.bfloat16)
        or onednn_row_invariant(torch.bfloat16)
        or row_invariant_chunk(torch.bfloat16) is not None
    )


def cpu_has_bf16() -> bool:
    """bf16 dot products in hardware: AVX-512 BF16 (Zen 4, Cooper Lake on) or AMX tiles (Sapphire Rapids on)."""
    cpu = getattr(torch, "cpu", None)
    return any(
        bool(getattr(cpu, name, lambda: False)()) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    )


def pick_draft_precision(requested: str, device: torch.device, target_dtype: torch.dtype) -> str:
    """How the draft's weights are held: "int8" or a dtype name. The draft only proposes, so this never changes
    the output. auto: int8 on a CPU (a draft token about 3x faster than float32), the target's dtype on a GPU (dynamic
    int8 is a CPU kernel)."""
    if requested == "auto":
        return "int8" if device.type == "cpu" else str(target_dtype).removeprefix("torch.")
    if requested in ("int8", "int4") and device.type != "cpu":
        raise LoadError(
            f"--draft-precision {requested} runs on a CPU only, and this deployment is on {device.type}; "
            "update it with --draft-precision auto (the target's dtype) or bfloat16"
        )
    if requested == "int4":
        if not native.available():
            raise LoadError(
                "--draft-precision int4 runs on depctl's C++ ops, which could not be built here (the log says why): "
                "install a C++ compiler and update the deployment to retry, or use --draft-precision int8"
            )
        return INT4_WEIGHTS
    return requested


def load_dtype(precision: str) -> torch.dtype:
    """The dtype a model of this precision is loaded in: an int8 or int4 draft is loaded in float32, then
    quantized."""
    return torch.float32 if precision in ("int8", INT4_WEIGHTS) else getattr(torch, precision)


def quantize_int8(model: torch.nn.Module) -> torch.nn.Module:
    """The draft's int8 surgery (``surgery.int8_linears``), with a load error the user can act on."""
    try:
        return int8_linears(model)
    except RuntimeError as exc:
        raise LoadError(
            f"int8 drafting is not available in torch {torch.__version__} ({exc}); "
            "update the deployment with --draft-precision float32"
        ) from exc


def surgery(loaded: LoadedModel, exact: bool = True) -> None:
    """The loader's model surgery, explicit and in one place: fused projections for Llama-family models on any device
    (``model.decoder``: the runner then steps our own forward), then on a CPU the module swaps that make it
    fast and keep it exact (``kernels.surgery``). ``exact``: the model's numerics reach the output (a target),
    so its products must not depend on how many rows share a pass; a draft's never do."""
    if loaded.device.type == "cpu":
        loaded.model = surgery_for(loaded.model, loaded.precision, exact)
    else:
        fuse_projections(loaded.model)


def surgery_for(model: torch.nn.Module, precision: str, exact: bool, fuse: bool = True) -> torch.nn.Module:
    """A CPU's surgery: fused projections where the architecture allows (then the swaps below apply to the fused
    linears); weight-only int8 linears for an int8 target (exact under speculation); dynamic int8 linears for an int8
    draft; for a bf16/fp16 target, oneDNN linears with at least two rows a product where that is row-invariant here
    (bf16 on AVX-512 machines), else split inner dimensions where the CPU's GEMM would round a row differently with
    more rows beside it (a half-precision draft needs neither); for float32, our own blocked linears where depctl's
    C++ ops build (else oneDNN linears where row-invariant, else weight-major linears: a handful of rows cost close
    to one), and with them, on a CPU with bf16 instructions, a target's output layer tied to its embeddings becomes a
    ``ScreenedHead`` (greedy choices without the full float32 product, once
    the compiled passes switch it on: ``depctl_runtime.model.head``)."""
    if fuse:
        fuse_projections(model)
    if precision in (INT8_WEIGHTS, INT4_WEIGHTS):
        if not native.available():  # pick_dtype let only int8 through: PyTorch's kernel
            int8_weight_linears(model, torch.bfloat16)
            return model
        quantized_linears(model, 4 if precision == INT4_WEIGHTS else 8)
        # a linear the groups do not fit (inputs not a multiple of 32) keeps the dtype's own product
        dtype = next(model.parameters()).dtype
        return surgery_for(model, str(dtype).removeprefix("torch."), exact, fuse=False)
    if precision == "int8":
        return quantize_int8(model)
    if precision in ("bfloat16", "float16"):
        dtype = getattr(torch, precision)
        if native.blocked_supports(dtype):  # our own product: row-invariant, and faster than oneDNN's here
            blocked_linears(model, dtype)
            return model
        if exact:
            if onednn_row_invariant(dtype):
                onednn_linears(model, dtype)
                return model
            chunk = row_invariant_chunk(dtype)
            if chunk is None:
                raise LoadError(
                    f"{precision} matrix products on this CPU give a row a different result depending on how many "
                    "rows share the pass, so speculation would not be exact: update the deployment with --dtype float32"
                )
            split_k_linears(model, chunk)
        return model
    if native.available():  # our own row-invariant product (surgery.BlockedLinear), faster than oneDNN's here
        if (
            exact and cpu_has_bf16()
        ):  # greedy choices from a bf16 screen of the output layer (depctl_runtime.model.head)
            screen_output_layer(model)
        blocked_linears(model)
    elif onednn_row_invariant():
        onednn_linears(model)
    else:
        weight_major_linears(model)
    return model


def resolve_source(ref: str, flag: str, report: Report = log_progress) -> str:
    """A model reference -> what ``from_pretrained`` loads, fetching/converting first when needed (each step reported
    as a stage, with how far it is)."""

    def progress(step: str, done: int, total: int) -> None:
        report(Stage(step, ref, done / total if total else None))

    try:
        resolved = models.resolve(ref, flag)
        return models.materialize(resolved, progress)
    except DepctlError as exc:
        raise LoadError(exc.message + (f" ({exc.hint})" if exc.hint else "")) from None


def load_model(ref: str, flag: str, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_source(ref, flag)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        # safetensors only: pickled weights (pytorch_model.bin) can run code when they are read
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, use_safetensors=True)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError... for unloadable models
        first = first_line(exc)
        if Path(source).is_dir() and not any(Path(source).glob("*.safetensors")):
            first = (
                "it has no .safetensors weights, and depctl never reads pickled ones (.bin, .pt), which can run "
                "code when loaded: convert them where you trust them (transformers' save_pretrained writes safetensors)"
            )
        offline = " (HF_HUB_OFFLINE is set: hub ids cannot be fetched)" if os.environ.get("HF_HUB_OFFLINE") else ""
        damaged = ""
        if Path(source).is_relative_to(models.models_cache()):  # our copy: a spec change cannot mend it
            damaged = (
                f"; the cached copy may be damaged or cut short: `depctl model pull {ref} --force` fetches it "
                "again, and the deployment loads it when the daemon restarts (`depctl daemon stop`, then start)"
            )
        raise LoadError(f"{flag} {ref!r} failed to load from {source}{offline}: {first}{damaged}") from exc
    model.to(device).eval()
    return LoadedModel(model, tokenizer, source, device, dtype)


def real_vocab_size(tokenizer) -> int:
    return len(tokenizer)


def check_draft_compatible(target: LoadedModel, draft: LoadedModel, target_ref: str, draft_ref: str) -> None:
    """A draft must speak the target's tokens: identical vocabularies (token -> id). Embedding tables may differ
    in size (Qwen pads them); rows past the tokenizer's vocabulary are padding and are sliced off the logits."""
    target_vocab = target.tokenizer.get_vocab()
    draft_vocab = draft.tokenizer.get_vocab()
    if target_vocab == draft_vocab:
        return
    only_target = len(target_vocab.keys() - draft_vocab.keys())
    only_draft = len(draft_vocab.keys() - target_vocab.keys())
    moved = sum(1 for t, i in target_vocab.items() if t in draft_vocab and draft_vocab[t] != i)
    suggestion = models.suggest_draft(target_ref)
    hint = (
        f"use --draft-model={suggestion}, which shares this target's tokenizer"
        if suggestion
        else "use a draft model from the target's family (same tokenizer), or --ngram-speculation-length instead"
    )
    raise LoadError(
        f"draft model {draft_ref!r} does not use the target's tokenizer ({len(target_vocab)} vs {len(draft_vocab)} "
        f"tokens; {only_target} only in the target, {only_draft} only in the draft, {moved} with different ids), "
        f"so its drafts would be meaningless: {hint}"
    )


# ---- memory ---------------------------------------------------------------------------------------------------


def estimate_bytes(source: str, dtype: torch.dtype, context: int) -> int:
    """Weights (from the safetensors on disk, rescaled to ``dtype``) + a KV cache of ``context`` positions."""
    from transformers import AutoConfig

    path = Path(source)
    if not path.is_dir():
        return 0  # a hub id: nothing on disk to measure before the download
    cfg = AutoConfig.from_pretrained(source)
    stored = 4 if str(getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", "float32")).endswith("32") else 2
    weights = sum(p.stat().st_size for p in path.glob("*.safetensors")) * dtype.itemsize // stored
    return weights + kv_cache_bytes(cfg, dtype.itemsize, context)


def kv_cache_bytes(cfg, itemsize: int, positions: int) -> int:
    """Keys and values of every layer for ``positions`` cached tokens (summed over rows)."""
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = getattr(cfg, "num_attention_heads", 1)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return 2 * getattr(cfg, "num_hidden_layers", 0) * kv_heads * head_dim * positions * itemsize


def free_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None  # unknown (macOS, Windows): do not block the load


def check_memory(needs: list[tuple[str, int]], device: torch.device) -> None:
    total = sum(n for _, n in needs)
    free = free_bytes(device)
    if free is None or total == 0:
        return
    if total > free * 0.9:  # leave room for activations and the process itself
        parts = ", ".join(f"{name} {n / 2**30:.2f} GiB" for name, n in needs)
        raise LoadError(
            f"not enough memory on {device.type}: need about {total / 2**30:.2f} GiB ({parts}, weights + KV cache) "
            f"but {free / 2**30:.2f} GiB is free; free memory, use a smaller model or dtype, or delete other "
            "deployments"
        )


# ---- the deployment -------------------------------------------------------------------------------------------


def load_deployment(
    spec: DeploymentSpec, calibrate: bool = True, report: Report = log_progress, features: tuple[int, ...] = ()
) -> LoadedDeployment:
    """``report`` hears each stage of a long load (shown by ``deployment get`` while it runs). ``features``: layers
    whose outputs the target's passes return, as for an EAGLE head (``depctl draft train`` records them)."""
    device = pick_device(spec.device)
    dtype = pick_dtype(spec.dtype, device, spec.quantization)
    spec_method = spec.speculation
    draft_ref = spec_method.draft_model if isinstance(spec_method, DraftModelSpeculation) else None

    # fetch/convert first, then check memory, then load: a deployment too big fails before it is half-loaded
    report(Stage("resolving", spec.model))
    target_source = resolve_source(spec.model, "MODEL", report)
    draft_source = resolve_source(draft_ref, "--draft-model", report) if draft_ref else None
    head_source = draft_source if heads.is_head(draft_source) else None  # an EAGLE head, not a draft model
    if head_source:
        draft_source = None
    from transformers import AutoConfig

    try:
        max_context = min(
            getattr(AutoConfig.from_pretrained(target_source), "max_position_embeddings", 2048), MAX_CONTEXT_CAP
        )
    except Exception as exc:
        first = first_line(exc, 300)
        raise LoadError(
            f"MODEL {spec.model!r} failed to load: cannot read its config.json in {target_source}: {first}"
        ) from exc
    needs = [("target", estimate_bytes(target_source, dtype, max_context))]
    precision = pick_draft_precision(spec_method.draft_precision, device, dtype) if draft_source else None
    if draft_source:  # an int8 draft is loaded in float32 first: its peak is the float32 size
        needs.append(("draft", estimate_bytes(draft_source, load_dtype(precision), max_context)))
    if head_source:
        needs.append(("EAGLE head", heads.head_bytes(head_source)))
    check_memory(needs, device)

    report(Stage("loading", "the weights"))
    target = load_model(spec.model, "MODEL", device, dtype)
    if spec.quantization != "none":
        target.precision = QUANTIZED[spec.quantization]
    surgery(target)
    draft = None
    head = None
    if head_source:
        try:
            head = heads.load_head(head_source, target.model, spec.model, draft_ref)
        except heads.HeadLoadError as exc:
            raise LoadError(str(exc)) from None
    elif draft_ref:
        draft = load_model(draft_ref, "--draft-model", device, load_dtype(precision))
        draft.precision = precision
        surgery(draft, exact=False)
    vocab = real_vocab_size(target.tokenizer)
    rows = spec.max_batch_size
    draft_runner = None
    if draft is not None:
        check_draft_compatible(target, draft, spec.model, draft_ref)
        draft_runner = ModelRunner(draft.model, vocab, max_rows=rows, max_context=max_context)
    num_draft_tokens = getattr(spec_method, "num_draft_tokens", 0)
    features = head.config.aux_layers if head is not None else features
    passes = compile_passes(
        ModelRunner(target.model, vocab, max_rows=rows, max_context=max_context, features=features),
        target.precision,
        spec.compile,
        width=1 + num_draft_tokens,
        draft=draft_runner,
        report=report,
        draft_precision=precision,
    )
    proposer = None
    if head is not None:
        proposer = EagleProposer(head, rows, vocab)
    elif passes.draft is not None:
        proposer = DraftModelProposer(passes.draft)
    elif isinstance(spec_method, NgramSpeculation):
        proposer = NgramProposer(spec_method.ngram_length)
    elif isinstance(spec_method, SuffixSpeculation):
        proposer = SuffixProposer(spec_method.cache_tokens, spec_method.scope)
    eos = target.tokenizer.eos_token_id
    gen_eos = getattr(getattr(target.model, "generation_config", None), "eos_token_id", None)
    eos_ids = {eos} if eos is not None else set()
    eos_ids |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    engine = SpeculativeEngine(
        passes.target,
        proposer,
        EngineConfig(num_draft_tokens=num_draft_tokens, max_context=max_context, eos_token_ids=tuple(sorted(eos_ids))),
    )
    grammars = None
    try:  # llguidance's table of every token's bytes: structured outputs and logprobs' token bytes
        grammars = GrammarCompiler(target.tokenizer, vocab, sorted(eos_ids))
    except ValueError as exc:  # a slow (Python) tokenizer: requests that need it get a 400 saying so
        log.warning("no structured outputs for %s: %s", spec.id, exc)
    compiled_status = passes.describe()
    if calibrate:
        report(Stage("calibrating", "measuring pass costs for the speculation policy"))
    calibration = engine.calibrate() if calibrate else {}
    kernels = products(target.model)
    log.info(
        "loaded %s on %s/%s%s, products: %s; calibration %s",
        spec.id,
        device,
        dtype,
        f" (draft {draft.precision})" if draft else "",
        kernels,
        calibration,
    )
    return LoadedDeployment(
        engine, target.tokenizer, target, draft, max_context, calibration, compiled_status, kernels, grammars
    )
