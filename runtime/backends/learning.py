"""A learning draft head for a deployment (``--learn-draft-head``): its folder, its shape, and how a trained generation
becomes the proposer that drafts (``depctl_runtime.training.online``)."""

from __future__ import annotations

from depctl import learning
from depctl.spec import DeploymentSpec
from depctl_runtime.backends import eagle
from depctl_runtime.backends.weights import LoadError
from depctl_runtime.model import decoder, eagle_format
from depctl_runtime.model.eagle import EagleConfig
from depctl_runtime.model.runner import ModelRunner
from depctl_runtime.speculation.eagle import EagleProposer
from depctl_runtime.training.data import load_conversations
from depctl_runtime.training.online import HeadLearner, LearnOptions
from depctl_runtime.training.shipped import ShippedAnswers

DRAFT_VOCAB = 8192  # the head's output layer: the tokens the recorded answers use most
MAX_TRAINED_STEPS = 5  # draft steps trained: later ones are reached rarely, and each costs a pass of the head


def learner(spec: DeploymentSpec, model, rows: int, vocab: int) -> HeadLearner:
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
    steps = min(spec.speculation.num_draft_tokens, MAX_TRAINED_STEPS)

    def make_proposer(head) -> EagleProposer:
        return EagleProposer(eagle.for_serving(head, model), rows, vocab)

    return HeadLearner(
        learning.path(spec.id),
        model,
        config,
        LearnOptions(steps=steps),
        spec.learn_draft_head.disk_bytes,
        make_proposer,
        verifier,
    )


def shipped_answers(learner: HeadLearner, model, tokenizer, vocab: int, stop_ids) -> ShippedAnswers | None:
    """The shipped prompts (``depctl draft train``'s set) for ``learner`` to answer while traffic is short; None for
    a model without a chat template (its answers to them would not be what it serves)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    prompts = []
    for conversation in load_conversations(None):
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])

    def make_runner(context: int) -> ModelRunner:
        # one row of its own: the engine's rows, cache and compiled passes are never touched
        return ModelRunner(model, vocab, max_rows=1, max_context=context, features=learner.config.aux_layers)

    return ShippedAnswers(make_runner, prompts, set(stop_ids))
