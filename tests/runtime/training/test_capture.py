"""The features kept while the engine answers are the target's layer outputs at every position it read."""

from __future__ import annotations

import torch

from depctl.spec import DeploymentSpec
from depctl_runtime.backends.loader import load_deployment
from depctl_runtime.model.eagle import layer_outputs
from depctl_runtime.speculation import GenerationParams, SamplingParams, Scheduler, SpeculativeEngine
from depctl_runtime.training.capture import FeatureRecorder


def test_recorded_features_are_the_layer_outputs_at_each_position(tiny_model_dir):
    layers = (0, 1, 1)
    loaded = load_deployment(
        DeploymentSpec(
            id="t", model=str(tiny_model_dir), device="cpu", dtype="float32", compile=False, max_batch_size=2
        ),
        calibrate=False,
        features=layers,
    )
    recorder = FeatureRecorder(torch.float32)
    engine = SpeculativeEngine(loaded.engine.target, recorder, loaded.engine.config)
    prompts = [list(range(40, 60)), [7, 8, 9]]
    params = [
        GenerationParams(max_tokens=9, speculate=False),
        GenerationParams(max_tokens=12, speculate=False, sampling=SamplingParams(temperature=0.9, seed=1)),
    ]
    seqs = [engine.new_sequence(p, q) for p, q in zip(prompts, params)]
    scheduler = Scheduler(engine, 2, prefill_chunk=8)  # a prompt in chunks, beside another row's steps
    for seq in seqs:
        scheduler.add(seq)
    while scheduler.has_work():
        scheduler.step()
    for seq in seqs:
        got = recorder.take(seq.id)
        assert got["features"].shape[0] == len(seq.tokens) - 1  # every token but the last was read
        with torch.no_grad():
            logits, expected = layer_outputs(loaded.target.model, torch.tensor([seq.tokens]), layers)
        torch.testing.assert_close(got["features"], expected[:-1], atol=1e-4, rtol=1e-4)
        # the target's distribution from the prompt's last position on: what each answer token was drawn from
        top = torch.log_softmax(logits[0, seq.prompt_len - 1 : -1], dim=-1).topk(16)
        assert torch.equal(got["top_ids"][:, 0].long(), top.indices[:, 0])
        torch.testing.assert_close(got["top_logp"].float(), top.values, atol=2e-2, rtol=1e-2)
