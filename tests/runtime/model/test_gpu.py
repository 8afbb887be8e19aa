"""The CUDA path: device and dtype selection, and exactness on the GPU. Skipped, with the reason, without CUDA."""

from __future__ import annotations

import pytest
import torch

from depctl_runtime.backends.precision import cpu_bf16_exact, cpu_has_bf16, pick_device, pick_dtype
from depctl_runtime.backends.weights import LoadError
from depctl_runtime.model.runner import ModelRunner
from depctl_runtime.speculation import (
    DraftModelProposer,
    EngineConfig,
    GenerationParams,
    NgramProposer,
    Scheduler,
    SpeculativeEngine,
    generate,
)
from tests.tiny import tiny_llama

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests need one")


def test_auto_device_and_dtype_rules():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert pick_device("auto").type == expected
    assert pick_device("cpu").type == "cpu"
    fast_bf16 = cpu_has_bf16() and cpu_bf16_exact()
    assert pick_dtype("auto", torch.device("cpu")) == (torch.bfloat16 if fast_bf16 else torch.float32)
    assert pick_dtype("float16", torch.device("cpu")) == torch.float16
    if not torch.cuda.is_available():
        with pytest.raises(LoadError, match="no CUDA GPU"):
            pick_device("cuda")


@pytest.mark.gpu
@cuda
def test_auto_dtype_on_cuda_is_half_precision():
    assert pick_dtype("auto", torch.device("cuda")) in (torch.bfloat16, torch.float16)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_exact_on_cuda(dtype):
    target = tiny_llama(0).to("cuda", dtype)
    draft = tiny_llama(1, layers=1).to("cuda", dtype)
    prompt = [5, 17, 42, 99, 3, 17, 42, 99, 3, 8]

    def run(proposer, k):
        engine = SpeculativeEngine(ModelRunner(target), proposer, EngineConfig(num_draft_tokens=k, adaptive=False))
        return [
            t for o in generate(engine, prompt, GenerationParams(max_tokens=48, ignore_eos=True)) for t in o.token_ids
        ]

    plain = run(None, 0)
    for k in (1, 4, 8):
        assert run(NgramProposer(3), k) == plain
        assert run(DraftModelProposer(ModelRunner(draft)), k) == plain


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("method", ["plain", "ngram", "draft"])
def test_batched_greedy_exact_on_cuda(method):
    # bfloat16, as a GPU deployment runs: a row's output in a batch of 4 equals its output alone
    target = tiny_llama(0).to("cuda", torch.bfloat16)
    draft = tiny_llama(1, layers=1).to("cuda", torch.bfloat16)
    prompts = [[5, 17, 42, 99, 3, 17, 42, 99, 3, 8], [1, 2, 3], [200, 201, 200, 201, 200], list(range(30, 70))]
    params = GenerationParams(max_tokens=40, ignore_eos=True)

    def engine(rows):
        proposer = {
            "plain": None,
            "ngram": NgramProposer(2),
            "draft": DraftModelProposer(ModelRunner(draft, max_rows=rows)),
        }[method]
        return SpeculativeEngine(
            ModelRunner(target, max_rows=rows),
            proposer,
            EngineConfig(num_draft_tokens=4 if proposer else 0, adaptive=False),
        )

    alone = [[t for o in generate(engine(1), p, params) for t in o.token_ids] for p in prompts]
    assert Scheduler(engine(4), 4, prefill_chunk=8).run_all(prompts, params) == alone
