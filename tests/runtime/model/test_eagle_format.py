"""A head's files (depctl_runtime.model.eagle_format): what reading a target for them leaves of the target."""

from __future__ import annotations

import torch

from depctl_runtime.model import eagle_format
from tests.tiny import tiny_llama


def test_a_targets_fingerprint_leaves_its_embedding_table_as_it_was():
    # the table a compiled library borrowed must keep its storage: one that turned unresizable (numpy's view of it
    # makes it so) was given a new one by the next library that borrowed it, and the first read freed memory
    for dtype in (torch.bfloat16, torch.float32):
        model = tiny_llama().to(dtype)
        table = model.get_input_embeddings().weight
        storage = table.untyped_storage()
        first = eagle_format.fingerprint(model)
        assert storage.resizable()
        assert eagle_format.fingerprint(model) == first
