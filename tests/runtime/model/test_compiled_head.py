"""A head's draft step through compiled libraries (depctl_runtime.model.compiled_head): the drafts of the eager step."""

from __future__ import annotations

import pytest
import torch

from depctl_runtime.backends.eagle import for_serving
from depctl_runtime.kernels import native
from depctl_runtime.kernels.quantized import QuantizedLinear, quantized_linears
from depctl_runtime.model import compiled_head
from depctl_runtime.model.eagle import EagleConfig, EagleHead
from depctl_runtime.model.runner import ModelRunner
from depctl_runtime.speculation import EngineConfig, SpeculativeEngine
from depctl_runtime.speculation.eagle import EagleProposer
from tests.driving import BATCH_PROMPTS as PROMPTS
from tests.driving import GREEDY


def random_head(model) -> EagleHead:
    head = EagleHead(EagleConfig.for_target(model.config, 96))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name != "embed_tokens.weight":
                p.normal_(0, 0.3)
    head.set_vocabulary(torch.arange(0, 192, 2))
    return head.eval()


def serving_head(model) -> EagleHead:
    """A random head for ``model`` made ready to serve, as the loader makes one (4- and 8-bit products on a CPU)."""
    return for_serving(random_head(model), model)


def engine(model, proposer: EagleProposer) -> SpeculativeEngine:
    runner = ModelRunner(model, max_rows=2, max_context=512, features=proposer.head.config.aux_layers)
    return SpeculativeEngine(runner, proposer, EngineConfig(num_draft_tokens=4, max_context=512, adaptive=False))


def test_heads_whose_products_read_other_bits_take_other_libraries(fused_target, tmp_path):
    # a library bakes in its products' bits and packed shapes: another width must never borrow it, nor the same
    # widths on other linears
    paths = []
    for output, layer in ((4, 4), (8, 8), (8, 4), (4, 8)):
        head = random_head(fused_target)
        head.lm_head = QuantizedLinear(head.lm_head, output)
        quantized_linears(head, layer)
        paths.append(compiled_head.package_paths(head, tmp_path))
    for part in ("keys", "attend"):
        assert len({p[part] for p in paths}) == len(paths)


@pytest.mark.slow  # AOTInductor builds: tens of seconds
def test_a_compiled_head_step_drafts_what_the_eager_step_drafts(fused_target, tmp_path):
    assert native.available()  # a head's products are depctl's 4- and 8-bit ones, and its attention depctl's op
    head = serving_head(fused_target)
    compiled_head.build(head, tmp_path)
    step = compiled_head.CompiledHead(compiled_head.package_paths(head, tmp_path), head)
    vocab = fused_target.config.vocab_size
    engines = [
        engine(fused_target, EagleProposer(head, 2, vocab)),
        engine(fused_target, EagleProposer(head, 2, vocab, step)),
    ]
    rows = []
    for eng in engines:
        seqs = [eng.new_sequence(PROMPTS[i], GREEDY) for i in (4, 0)]
        for row, seq in enumerate(seqs):
            seq.row = row
            while eng.prefill(seq, 7) is None:
                pass
        rows.append(seqs)
    for width in (4, 3, 2):  # a catch-up over every prompt position, then over what each step accepted
        eager, fast = (eng.draft_model.propose(seqs, width).tokens for eng, seqs in zip(engines, rows))
        assert fast == eager
        for eng, seqs in zip(engines, rows):
            eng.step(seqs)
    assert [s.tokens for s in rows[0]] == [s.tokens for s in rows[1]]
    step.release()
