"""How a deployment's decode and verify passes run: through a compiled library (an AOTInductor package, on a CPU),
replayed from CUDA graphs (a GPU), or eagerly. A fast pass is kept only once a verify pass through it has equalled
one-token steps through it bit for bit on this machine; anything that fails leaves the eager pass and says why."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from pathlib import Path

from depctl import config
from depctl.errors import first_line
from depctl_runtime.backends.base import Stage
from depctl_runtime.backends.precision import INT4_WEIGHTS, INT8_WEIGHTS
from depctl_runtime.backends.weights import Report, free_bytes, log_progress
from depctl_runtime.kernels.surgery import SplitKLinear, WeightMajorLinear, plain_stand_in_bytes
from depctl_runtime.model import compiled, graphs
from depctl_runtime.model.runner import ModelRunner
from depctl_runtime.model.screened_head import ScreenedHead

log = logging.getLogger("depctl.loader")


def libraries() -> Path:  # where the compiled libraries live (the cache directory is read when asked)
    return config.cache_dir() / "compiled"


COMPILED_PRECISIONS = (INT8_WEIGHTS, INT4_WEIGHTS, "float32", "bfloat16")  # compiled where faster: see compile_passes


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


def graph_passes(runner: ModelRunner, width: int, draft: ModelRunner | None = None, record: bool = True) -> Passes:
    """On CUDA: the target's decode and verify passes at one fixed shape, ``max_rows x width`` tokens (width = 1 +
    the most drafts a row verifies), replayed from CUDA graphs (``model.graphs``) once proven exact on this
    GPU; a draft model's one- and two-token forwards likewise (its output only proposes, so no check).

    ``record=False`` (a spec's ``compile: false``) runs the same fixed-shape passes eagerly. cuBLAS picks its kernels
    by the product's shape, so an eager pass of 5 tokens rounds differently from 5 passes of one: only one shape for
    every decode and verify pass keeps speculation exact on a GPU."""
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
        lambda: graphs.FixedShapePass(
            runner.model,
            runner.cache,
            runner.max_rows,
            (width,),
            capture=None if record else False,
            features=runner.features,
        ),
        "recording CUDA graphs failed" if record else "the fixed-shape pass failed",
        "a verify pass through the CUDA graphs" if record else "a fixed-shape verify pass",
        "GPU",
    )
    if refused:
        return Passes(runner, draft, PassKind.EAGER, refused)
    if not record:
        return Passes(target, draft, PassKind.EAGER, f"the spec says compile: false; {target.fast_pass.describe()}")
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
    build: bool = True,
) -> Passes:
    """The fastest exact pass strategy for this runner: a compiled library on a CPU where it is faster
    (benchmarks/passes.py), CUDA graphs on a GPU, else eager. Split-K and weight-major linears (where oneDNN is not
    row-invariant) would become inductor's own, slower products: those stay eager. A compile that fails leaves the
    eager pass and says why; it never fails the deployment. ``build``: False uses a library built before and never
    builds one (a caller whose time budget a build would eat)."""

    def eager(why: str) -> Passes:
        return Passes(runner, draft, PassKind.EAGER, why)

    if runner.device.type == "cuda":
        return graph_passes(runner, width, draft, record=wanted)
    if not wanted:
        return eager("the spec says compile: false")
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
    if not build and not compiled.package_path(runner.model, precision, libraries(), runner.features).exists():
        return eager("no compiled library for this model and precision yet, and this load builds none")
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
    if compiled.package_path(runner.model, precision, libraries(), runner.features).exists():
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
    package = compiled.package_path(runner.model, precision, libraries(), runner.features)
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
