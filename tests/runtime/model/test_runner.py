"""The model runner (depctl_runtime.model.runner): what it owns of a model's memory."""

from __future__ import annotations

import torch

from depctl_runtime.kernels.surgery import onednn_linears
from depctl_runtime.model.runner import ModelRunner
from tests.tiny import tiny_llama


def test_release_empties_plain_weights_and_passes_over_onednn_packed_ones():
    # float32: oneDNN packs it on any x86 CPU (bf16 packing needs AVX-512 or AVX-NE-CONVERT)
    model = tiny_llama()
    assert onednn_linears(model, torch.float32) > 0  # packed weights are opaque: they have no storage to ask about
    runner = ModelRunner(model, max_rows=2)
    runner.release()
    embeddings = model.get_input_embeddings().weight
    assert embeddings.untyped_storage().nbytes() == 0
