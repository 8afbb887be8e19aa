"""Loading an EAGLE-3 head for a deployment's target (``--draft-model DIR`` where DIR is a speculators checkpoint).

A head reads the target's own layer outputs, so it belongs to one target: the head records its verifier's name and a
fingerprint of its embeddings (``model.eagle_format``), and a head trained for another model is refused, naming both,
before anything runs. It also needs depctl's fused decoder, which returns those layer outputs from the pass it runs.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from depctl.errors import first_line
from depctl_runtime.backends.base import Stage
from depctl_runtime.backends.weights import Report
from depctl_runtime.kernels import native
from depctl_runtime.kernels.quantized import QuantizedLinear, quantized_linears
from depctl_runtime.model import compiled_head, decoder, eagle_format
from depctl_runtime.model.eagle import EagleHead
from depctl_runtime.speculation.eagle import EagleProposer

log = logging.getLogger("depctl.loader")


# a draft step reads the head's weights cold, right after a target pass has streamed through the caches: its layer's
# linears in 4-bit groups read a sixth of float32's bytes; its output layer, whose best token is the draft, keeps 8
# bits (at 4 it cost the mean accepted length up to 4%). Drafts only propose, so this never changes the output
# (BENCHMARKS.md, "A head's products at 4 bits")
HEAD_BITS = 4
OUTPUT_BITS = 8


class HeadLoadError(Exception):
    pass


def is_head(source: str | None) -> bool:
    return source is not None and eagle_format.is_head(Path(source))


def head_bytes(source: str) -> int:
    """The head's weights as stored (float32 at most, as it runs on a CPU): its share of the memory check."""
    return sum(p.stat().st_size for p in Path(source).glob("*.safetensors"))


def measured(source: str) -> tuple[float, int] | None:
    """The held-out mean accepted length the head in ``source`` recorded, and the draft steps it was measured at."""
    return eagle_format.measured(eagle_format.read_config(Path(source)))


def load_head(source: str, model: torch.nn.Module, target_ref: str, draft_ref: str, bits: int = HEAD_BITS) -> EagleHead:
    """The head in ``source`` over ``model``'s embeddings, on its device, after checking it was trained for it, ready
    to serve (``for_serving``)."""
    return for_serving(read_head(source, model, target_ref, f"--draft-model {draft_ref!r}"), model, bits)


def read_head(source: str, model: torch.nn.Module, target_ref: str, given: str) -> EagleHead:
    """The head in ``source`` in float32 over a copy of ``model``'s embeddings, after checking it was trained for
    ``model``; ``given`` names where it came from in errors (``--draft-model './head'``)."""
    try:
        config = eagle_format.read_config(Path(source))
    except eagle_format.HeadError as exc:
        raise HeadLoadError(f"{given}: {exc}") from None
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    trained_for = verifier.get("name_or_path") or "an unnamed model"
    expected = verifier.get("fingerprint")
    retrain = f"train one for this target: depctl draft train {target_ref} --out DIR"
    if expected is not None and expected != eagle_format.fingerprint(model):
        raise HeadLoadError(
            f"{given} is an EAGLE head trained for {trained_for}, and MODEL {target_ref!r} is another model (its "
            f"weights differ from the ones the head was trained on); {retrain}"
        )
    if not decoder.is_fused(model):
        raise HeadLoadError(
            f"{given} is an EAGLE head, which drafts from the layer outputs of depctl's own decoder; MODEL "
            f"{target_ref!r} ({model.config.model_type}) runs through transformers' forward (heads serve "
            f"{', '.join(decoder.ARCHITECTURES)} without sliding windows); use --ngram-speculation-length or a draft "
            "model"
        )
    layers = len(model.model.layers)
    aux = config.get("eagle_aux_hidden_state_layer_ids") or []
    if any(not 0 <= i < layers for i in aux):
        raise HeadLoadError(f"{given} reads layers {aux} and MODEL {target_ref!r} has {layers}; {retrain}")
    embeddings = model.get_input_embeddings().weight
    try:
        head, _ = eagle_format.load(Path(source), embeddings.detach())
    except eagle_format.HeadError as exc:
        raise HeadLoadError(f"{given} was trained for {trained_for}: {exc}; {retrain}") from None
    return head


def for_serving(head: EagleHead, model: torch.nn.Module, bits: int = HEAD_BITS) -> EagleHead:
    """``head`` made ready to draft for ``model``: on its device, over its own embedding module, frozen, on a CPU its
    linears in ``bits`` (its output layer in ``OUTPUT_BITS`` at least). The head given is changed in place."""
    if head.embed_tokens is model.get_input_embeddings():  # its own table is dropped below: here, the target's
        raise ValueError("this head is already ready to serve its target")
    embeddings = model.get_input_embeddings().weight
    dtype = torch.float32 if embeddings.device.type == "cpu" else embeddings.dtype
    head.embed_tokens.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    head.to(device=embeddings.device, dtype=dtype)
    head.inv_freq = head.inv_freq.float()  # RoPE's frequencies stay float32, as the target's do
    head.requires_grad_(False)
    head.eval()
    # the target's own embedding module, never a copy of its table: a compiled pass may later give the target's
    # weights new storage (a copy of tables mapped from a file), and the head then reads that one too
    head.embed_tokens = model.get_input_embeddings()
    if embeddings.device.type == "cpu" and native.available():
        quantize_products(head, bits)
    return head


def quantize_products(head: EagleHead, bits: int = HEAD_BITS) -> None:
    """The head's linears in ``bits``, its output layer in ``OUTPUT_BITS`` at least, as it drafts on a CPU."""
    head.lm_head = QuantizedLinear(head.lm_head, max(bits, OUTPUT_BITS))
    quantized_linears(head, bits)


class HeadSteps:
    """How a deployment's serving heads run their draft step: through the libraries built for heads of their shape
    (``model.compiled_head``) where the deployment's passes compile, else eagerly. Decided once at load (``prepare``);
    every head the deployment serves (a learning head's every generation) drafts through the same choice."""

    def __init__(self):
        self.root: Path | None = None  # where the libraries are (None: eagerly)
        self.detail = ""  # what ``deployment get`` says of it

    def prepare(self, head: EagleHead, root: Path, build: bool, report: Report) -> None:
        """Use the libraries under ``root`` for heads shaped like the serving ``head``, building them first where
        none exist yet (``build``; a minute or so); a failure leaves heads drafting eagerly and says why."""
        paths = compiled_head.package_paths(head, root)
        built = ""
        try:
            if not all(path.exists() for path in paths.values()):
                if not build:
                    self.detail = (
                        "; the draft head drafts eagerly: its step is not compiled yet, and this load builds none"
                    )
                    return
                report(
                    Stage("compiling", "the draft head's step (once per head shape and machine; later loads reuse it)")
                )
                built = f", built in {compiled_head.build(head, root):.0f}s"
            compiled_head.CompiledHead(paths, head).release()  # it opens: the next proposer takes it back
        except Exception as exc:  # noqa: BLE001 - any failure here means: the head drafts eagerly
            log.warning("compiling the draft head's step failed; it drafts eagerly", exc_info=exc)
            self.detail = f"; the draft head drafts eagerly (compiling its step failed: {first_line(exc, 160)})"
            return
        self.root = root
        self.detail = f"; the draft head's step compiled{built}"

    def proposer(self, head: EagleHead, rows: int, vocab: int) -> EagleProposer:
        """A proposer for ``head`` (made ready by ``for_serving``) over ``rows`` rows."""
        step = None
        if self.root is not None:
            try:
                step = compiled_head.CompiledHead(compiled_head.package_paths(head, self.root), head)
            except Exception as exc:  # noqa: BLE001 - this head drafts eagerly
                log.warning("the draft head's compiled step does not open; it drafts eagerly", exc_info=exc)
        return EagleProposer(head, rows, vocab, step)
