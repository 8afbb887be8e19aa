"""A learning draft head for a deployment (``--learn-draft-head``): its folder, its shape, and how a trained generation
becomes the proposer that drafts (``depctl_runtime.training.online``)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from depctl import learning
from depctl.spec import DeploymentSpec
from depctl_runtime.backends import eagle
from depctl_runtime.backends.weights import LoadError
from depctl_runtime.model import decoder, eagle_format
from depctl_runtime.model.eagle import EagleConfig, EagleHead
from depctl_runtime.model.runner import FastPass, ModelRunner
from depctl_runtime.model.screened_head import ScreenedHead
from depctl_runtime.speculation.eagle import EagleProposer
from depctl_runtime.training.answers import IdleAnswers, user_turn
from depctl_runtime.training.data import load_conversations
from depctl_runtime.training.eagle import DRAFT_VOCAB
from depctl_runtime.training.online import HeadLearner, HeadStart, LearnOptions

MAX_MEASURED_STEPS = 5  # draft steps heads are compared at: later ones are reached rarely, and each costs a pass


def learner(spec: DeploymentSpec, model, rows: int, vocab: int, head_steps: eagle.HeadSteps) -> HeadLearner:
    """``head_steps``: how the generations it serves run their draft step (``HeadSteps``)."""
    if not decoder.is_fused(model):
        raise LoadError(
            f"--learn-draft-head trains an EAGLE head on the layer outputs of depctl's own decoder; MODEL "
            f"{spec.model!r} ({model.config.model_type}) runs through transformers' forward (heads serve "
            f"{', '.join(decoder.ARCHITECTURES)} without sliding windows): drop --learn-draft-head"
        )
    config = EagleConfig.for_target(model.config, DRAFT_VOCAB)
    verifier = {
        "name_or_path": spec.model,
        "architectures": list(getattr(model.config, "architectures", None) or []),
        "fingerprint": eagle_format.fingerprint(model),
    }
    steps = min(spec.speculation.num_draft_tokens, MAX_MEASURED_STEPS)
    # idle answers keep the target's distribution where its passes compute every position's logits anyway: a screened
    # output layer computes them only for the rows that sample, and a float32 product a token costs a fifth of a step
    soft_labels = not isinstance(getattr(model, "lm_head", None), ScreenedHead)

    def make_proposer(head) -> EagleProposer:
        return head_steps.proposer(eagle.for_serving(head, model), rows, vocab)

    source = spec.learn_draft_head.start_from
    given = f"--learn-draft-head-from {source!r}"

    def read() -> tuple[EagleHead, dict]:
        return eagle.read_head(source, model, spec.model, given), eagle_format.read_config(Path(source))

    try:
        return HeadLearner(
            learning.path(spec.id),
            model,
            config,
            LearnOptions(steps=steps, soft_labels=soft_labels),
            spec.learn_draft_head.disk_bytes,
            make_proposer,
            verifier,
            HeadStart(source, read) if source is not None else None,
        )
    except eagle.HeadLoadError as exc:
        raise LoadError(str(exc)) from None
    except eagle_format.HeadError as exc:
        raise LoadError(f"{given}: {exc}") from None


def idle_answers(
    learner: HeadLearner, model, tokenizer, vocab: int, stop_ids, make_pass: Callable[[], FastPass] | None = None
) -> IdleAnswers | None:
    """What ``learner`` answers while traffic is short: the shipped prompts (``depctl draft train``'s set), then
    requests the target writes in a user turn of its chat template; None for a model without a chat template (its
    answers to them would not be what it serves). ``make_pass``: the deployment's compiled pass for a runner of
    their own, where it has one (eager passes answer a third as fast: BENCHMARKS.md, "An hour with idle answers")."""
    if not getattr(tokenizer, "chat_template", None):
        return None

    def tokens(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    prompts = [
        tokens(tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False))
        for conversation in load_conversations(None)
    ]

    def make_runner(rows: int, context: int) -> ModelRunner:
        # rows of its own: the engine's rows, cache and compiled passes are never touched
        fast_pass = make_pass() if make_pass is not None else None
        return ModelRunner(
            model, vocab, max_rows=rows, max_context=context, features=learner.config.aux_layers, fast_pass=fast_pass
        )

    return IdleAnswers(
        make_runner,
        prompts,
        set(stop_ids),
        user_turn(tokenizer, tokens),
        slice_seconds=learner.options.slice_seconds,  # a pass stays within the learner's slice of idle time
        top=learner.options.soft_labels,
    )
