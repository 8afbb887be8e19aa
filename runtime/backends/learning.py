"""A learning draft head for a deployment (``--learn-draft-head``): its folder, its shape, and how a trained generation
becomes the proposer that drafts (``depctl_runtime.training.online``)."""

from __future__ import annotations

from depctl import learning
from depctl.spec import DeploymentSpec
from depctl_runtime.backends import eagle
from depctl_runtime.backends.weights import LoadError
from depctl_runtime.model import decoder, eagle_format
from depctl_runtime.model.eagle import EagleConfig
from depctl_runtime.speculation.eagle import EagleProposer
from depctl_runtime.training.online import HeadLearner, LearnOptions

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
