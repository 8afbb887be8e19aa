"""The model runner (depctl_runtime.model.runner): what it owns of a model's memory."""

from __future__ import annotations

import torch

from depctl_runtime.kernels.surgery import onednn_linears
from depctl_runtime.model.runner import ModelRunner
from tests.tiny import tiny_llama


def test_release_empties_plain_weights_and_passes_over_onednn_packed_ones():
    model = tiny_llama().to(torch.bfloat16)
    assert onednn_linears(model, torch.bfloat16) > 0  # packed weights are opaque: they have no storage to ask about
    runner = ModelRunner(model, max_rows=2)
    runner.release()
    embeddings = model.get_input_embeddings().weight
    assert embeddings.untyped_storage().nbytes() == 0
