"""What one answer costs a draft head's training step, recipe by recipe, on this machine. One table.

    .venv/bin/python benchmarks/train_step.py
    .venv/bin/python benchmarks/train_step.py --answer 170 --prompt 60 --repeat 20

A head shaped for SmolLM2-135M (one decoder layer, a 4,096-token draft vocabulary, two chained steps trained) over
random answers of ``--answer`` tokens after a ``--prompt``-token prompt, with the target's top-16 distribution at
every answer position, as ``depctl draft train`` trains on them. Each recipe runs ``--repeat`` answers after a warm-up;
the recipes alternate, twice through, and the table keeps each one's faster pass. No model is loaded: the numbers are
the head's products and the optimizer's, the part of a training minute that a recipe changes.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from depctl_runtime.model.eagle import EagleConfig, EagleHead
from depctl_runtime.training.eagle import BATCH_ROWS, DRAFT_VOCAB, _loss, adamw, training_precision

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.random_model import SHAPES  # noqa: E402

# label -> (bf16 products, fused AdamW, positions a step: 0 for one step an answer)
RECIPES = {
    "float32, a step an answer, AdamW": ("float32", False, 0),
    "float32, a step an answer, fused AdamW": ("float32", True, 0),
    "float32, a step per 512 positions": ("float32", True, BATCH_ROWS),
    "bf16 products, a step per 512 positions": ("bfloat16", True, BATCH_ROWS),
}


def head_for_smollm2() -> EagleHead:
    from transformers import AutoConfig

    shape = dict(SHAPES["smollm2-135m-instruct"])
    config = EagleConfig.for_target(AutoConfig.for_model(shape.pop("model_type"), **shape), DRAFT_VOCAB)
    head = EagleHead(config)
    head.set_vocabulary(torch.arange(DRAFT_VOCAB) * 12)
    head.embed_tokens.weight.requires_grad_(False)
    return head.train()


def answers(n: int, prompt: int, answer: int, vocab: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, vocab, (prompt + answer,), generator=gen) // 12 * 12  # in the draft vocabulary
        top_ids = torch.randint(0, vocab, (answer, 16), generator=gen) // 12 * 12
        top_ids[:, 0] = tokens[prompt:]
        out.append(
            {
                "tokens": tokens,
                "start": prompt,
                "features": torch.randn(prompt + answer - 1, 3 * 576, generator=gen).bfloat16(),
                "top_ids": top_ids.int(),
                "top_logp": torch.log_softmax(torch.randn(answer, 16, generator=gen), -1).half(),
            }
        )
    return out


def run(recipe: tuple, examples: list[dict], warmup: int) -> float:
    """Seconds an answer, over ``examples`` after ``warmup`` of them."""
    dtype, fused, batch = recipe
    head = head_for_smollm2()
    params = [p for n, p in head.named_parameters() if not n.startswith("embed_tokens")]
    cpu = torch.device("cpu")
    optimizer = adamw(params, 5e-4, cpu) if fused else torch.optim.AdamW(params, lr=5e-4, weight_decay=0.0)
    precision = training_precision(cpu, dtype)
    pending = 0
    started = None
    for i, example in enumerate(examples):
        if i == warmup:
            started = time.perf_counter()
        with precision:
            loss, counted = _loss(head, example, 2)
        (loss / max(batch, counted)).backward()
        pending += counted
        if pending >= batch:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            pending = 0
    return (time.perf_counter() - started) / (len(examples) - warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--answer", type=int, default=170, help="answer tokens (the shipped prompts' mean is ~130)")
    parser.add_argument("--prompt", type=int, default=60)
    parser.add_argument("--repeat", type=int, default=20, help="answers timed a recipe")
    args = parser.parse_args()
    warmup = 6
    examples = answers(warmup + args.repeat, args.prompt, args.answer, 49152)
    best: dict[str, float] = {}
    for _ in range(2):
        for label, recipe in RECIPES.items():
            took = run(recipe, examples, warmup)
            best[label] = min(best.get(label, took), took)
    first = next(iter(best.values()))
    print(f"{torch.get_num_threads()} threads, answers of {args.answer} tokens after {args.prompt}\n")
    print("| recipe | ms an answer | positions a second | vs the first |")
    print("|---|---:|---:|---:|")
    for label, took in best.items():
        print(f"| {label} | {took * 1000:.1f} | {args.answer / took:,.0f} | {first / took:.2f}x |")


if __name__ == "__main__":
    main()
