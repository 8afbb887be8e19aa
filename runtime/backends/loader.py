"""Turn a deployment spec into a ready engine: resolve the models, check they fit, load them, pair the tokenizers, pick
the passes and the proposer.

Everything here may take seconds to minutes (downloads, GGUF conversion, weights, a compile) and runs on a load
thread, never on a request path. Failures raise ``LoadError`` with a message the user can act on; the deployment
then goes to FAILED with that message as its reason. The steps live beside it:

- ``weights``: fetching and reading a model's weights and tokenizer, and whether they fit in memory;
- ``precision``: the device, the dtype, and the module surgery that keeps a CPU's products exact under speculation;
- ``passes``: how decode and verify passes run (a compiled library, CUDA graphs, or eager), proven exact first;
- ``eagle``: an EAGLE-3 head, checked against the target it was trained for.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from depctl.errors import first_line
from depctl.spec import DeploymentSpec, DraftModelSpeculation, NgramSpeculation, SuffixSpeculation
from depctl_runtime.backends import eagle, learning
from depctl_runtime.backends.base import Stage
from depctl_runtime.backends.calibration import kept_costs_path, read_costs, write_costs
from depctl_runtime.backends.passes import Passes, PassKind, compile_passes, libraries
from depctl_runtime.backends.precision import (
    QUANTIZED,
    load_dtype,
    pick_device,
    pick_draft_precision,
    pick_dtype,
    surgery,
)
from depctl_runtime.backends.weights import (
    MAX_CONTEXT_CAP,
    LoadedModel,
    LoadError,
    Report,
    check_draft_compatible,
    check_memory,
    estimate_bytes,
    free_bytes,
    load_model,
    log_progress,
    real_vocab_size,
    resolve_source,
)
from depctl_runtime.kernels import native
from depctl_runtime.kernels.surgery import products
from depctl_runtime.model.eagle import EagleHead
from depctl_runtime.model.runner import ModelRunner
from depctl_runtime.speculation.engine import EngineConfig, SpeculativeEngine
from depctl_runtime.speculation.grammar import GrammarCompiler
from depctl_runtime.speculation.proposers import DraftModelProposer, NgramProposer, Proposer, SuffixProposer
from depctl_runtime.training.online import HeadLearner

log = logging.getLogger("depctl.loader")

__all__ = ["LoadError", "LoadedDeployment", "load_deployment"]


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
    costs_file: Path | None = None  # where the policy's pass costs are kept for the next load (None: not calibrated)
    learner: HeadLearner | None = None  # a head learning from the traffic (``--learn-draft-head``)

    def release(self) -> None:
        """Free the weights now that nothing will run this engine again (a reload, a delete, a stale load): a compiled
        library would otherwise keep them (``ModelRunner.release``). The pass costs serving refined are kept."""
        if self.costs_file is not None:
            write_costs(self.costs_file, self.engine.policy.snapshot())
        if self.learner is not None:
            self.learner.release()
        self.engine.target.release()
        if self.engine.draft_model is not None:
            self.engine.draft_model.release()


def load_deployment(
    spec: DeploymentSpec,
    calibrate: bool = True,
    report: Report = log_progress,
    features: tuple[int, ...] = (),
    build_passes: bool = True,
) -> LoadedDeployment:
    """``report`` hears each stage of a long load (shown by ``deployment get`` while it runs). ``features``: layers
    whose outputs the target's passes return, as for an EAGLE head (``depctl draft train`` records them).
    ``build_passes``: False runs compiled passes only where their library was built before."""
    device = pick_device(spec.device)
    if device.type == "cpu":  # the products, the attention and the compiled passes use them; say so if they build
        native.available(building=lambda: report(Stage("building", "depctl's C++ ops (once per machine)")))
    dtype = pick_dtype(spec.dtype, device, spec.quantization)
    spec_method = spec.speculation
    draft_ref = spec_method.draft_model if isinstance(spec_method, DraftModelSpeculation) else None

    # fetch/convert first, then check memory, then load: a deployment too big fails before it is half-loaded
    report(Stage("resolving", spec.model))
    target_source = resolve_source(spec.model, "MODEL", report)
    draft_source = resolve_source(draft_ref, "--draft-model", report) if draft_ref else None
    head_source = draft_source if eagle.is_head(draft_source) else None  # an EAGLE head, not a draft model
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
        needs.append(("EAGLE head", eagle.head_bytes(head_source)))
    check_memory(needs, device)

    report(Stage("loading", "the weights"))
    target = load_model(spec.model, "MODEL", device, dtype)
    if spec.quantization != "none":
        target.precision = QUANTIZED[spec.quantization]
    surgery(target)
    draft = None
    head = None
    head_measured = None  # the head's held-out mean accepted length and its K: where its drafts' rate starts
    if head_source:
        try:
            head = eagle.load_head(head_source, target.model, spec.model, draft_ref)
        except eagle.HeadLoadError as exc:
            raise LoadError(str(exc)) from None
        head_measured = eagle.measured(head_source)
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
    learner = None
    head_steps = eagle.HeadSteps()  # how the heads it serves draft: decided once its passes are
    if spec.learn_draft_head is not None:
        learner = learning.learner(spec, target.model, rows, vocab, head_steps)
        served = learner.initial_head()  # the generation that served before a restart, if any
        head = eagle.for_serving(served, target.model) if served is not None else None
        head_measured = (learner.serving_mean_accepted(), learner.options.steps)
        features = learner.config.aux_layers
    features = head.config.aux_layers if head is not None else features
    passes = compile_passes(
        ModelRunner(target.model, vocab, max_rows=rows, max_context=max_context, features=features),
        target.precision,
        spec.compile,
        width=1 + num_draft_tokens,
        draft=draft_runner,
        report=report,
        draft_precision=precision,
        build=build_passes,
    )
    if passes.kind is PassKind.COMPILED and (head is not None or learner is not None):
        # a head's step compiles where the target's passes do: heads of one shape share the libraries
        shape = head if head is not None else eagle.for_serving(EagleHead(learner.config), target.model)
        head_steps.prepare(shape, libraries(), build_passes, report)
    eos_ids = end_token_ids(target)
    engine = SpeculativeEngine(
        passes.target,
        pick_proposer(spec_method, passes, head, rows, vocab, head_steps),
        EngineConfig(
            num_draft_tokens=num_draft_tokens,
            max_context=max_context,
            eos_token_ids=eos_ids,
            prefix_cache_bytes=(
                spec.prefix_cache_bytes if spec.prefix_cache_bytes is not None else prefix_cache_budget(device)
            ),
            # on a CPU every verified token and draft forward costs; on a GPU a wider verify is nearly free, and the
            # check would wait on the device after every draft forward
            cut_unsure_drafts=device.type == "cpu",
        ),
        observer=learner.recorder if learner is not None else None,
    )
    if head is not None and head_measured is not None:
        # as a head swapped in while serving does: an unmeasured rate drafts a weak head long, and its first steps
        # lose until the guard turns it off
        engine.policy.new_draft_model(*head_measured)
    if learner is not None:
        if head is not None:  # a generation served before a restart: the n-gram or suffix index drafts beside it
            engine.free = pick_proposer(spec_method, passes, None, rows, vocab, head_steps)
        learner.attach(engine)
        # a compiled library takes the caches as inputs: idle answers pass through an instance of their own
        another = passes.target.fast_pass.another if passes.kind is PassKind.COMPILED else None
        answers = learning.idle_answers(learner, target.model, target.tokenizer, vocab, eos_ids, another)
        if answers is not None:
            learner.answer(answers)
    grammars = None
    try:  # llguidance's table of every token's bytes: structured outputs and logprobs' token bytes
        grammars = GrammarCompiler(target.tokenizer, vocab, list(eos_ids))
    except ValueError as exc:  # a slow (Python) tokenizer: requests that need it get a 400 saying so
        log.warning("no structured outputs for %s: %s", spec.id, exc)
    compiled_status = passes.describe() + head_steps.detail
    kernels = products(target.model)
    costs_file = None
    if calibrate:
        costs_file = kept_costs_path(spec, target.model, target.precision, passes.kind.value, kernels)
        kept = read_costs(costs_file)
        if kept is not None:
            report(Stage("warming up", "the passes, with the costs an earlier load measured here"))
            engine.policy.restore(kept)
            engine.calibrate(measure=False)
        else:
            report(Stage("calibrating", "the pass costs for the speculation policy (once per model and machine)"))
            engine.calibrate()
            write_costs(costs_file, engine.policy.snapshot())
    calibration = engine.policy.snapshot() if calibrate else {}
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
        engine,
        target.tokenizer,
        target,
        draft,
        max_context,
        calibration,
        compiled_status,
        kernels,
        grammars,
        costs_file,
        learner,
    )


PREFIX_CACHE_MAX = 1 << 30  # the prefix cache's default budget: a tenth of free memory, at most 1 GiB


def prefix_cache_budget(device) -> int:
    """Bytes for cached prompt blocks: a tenth of what is free after the weights load, at most 1 GiB (a 2k-token
    prefix of SmolLM2 in float32 is about 95 MB); 64 MiB where free memory cannot be read."""
    free = free_bytes(device)
    return min(PREFIX_CACHE_MAX, free // 10) if free is not None else 64 << 20


def pick_proposer(method, passes: Passes, head, rows: int, vocab: int, head_steps: eagle.HeadSteps) -> Proposer | None:
    """What drafts for the spec's speculation method: the EAGLE head (its step as ``head_steps`` runs it) or the draft
    model loaded for it (the draft through its own passes), the n-gram or suffix index; None for plain decoding."""
    if head is not None:
        return head_steps.proposer(head, rows, vocab)
    if passes.draft is not None:
        return DraftModelProposer(passes.draft)
    if isinstance(method, NgramSpeculation):
        return NgramProposer(method.ngram_length)
    if isinstance(method, SuffixSpeculation):
        return SuffixProposer(method.cache_tokens, method.scope)
    return None


def end_token_ids(target: LoadedModel) -> tuple[int, ...]:
    """The tokens that end an answer: the tokenizer's end of sequence and the generation config's (chat models
    often name several there, such as Qwen's <|im_end|> beside <|endoftext|>)."""
    eos = target.tokenizer.eos_token_id
    configured = getattr(getattr(target.model, "generation_config", None), "eos_token_id", None)
    ids = {eos} if eos is not None else set()
    ids |= set(configured if isinstance(configured, list) else [configured] if configured is not None else [])
    return tuple(sorted(ids))
