"""What one answer costs a draft head's training step, recipe by recipe, on this machine. One table.

    .venv/bin/python benchmarks/train_step.py
    .venv/bin/python benchmarks/train_step.py --answer 170 --prompt 60 --repeat 60

A head shaped for SmolLM2-135M (one decoder layer, a 4,096-token draft vocabulary, two chained steps trained) over
random answers of ``--answer`` tokens on average (each its own length, as real answers are: the lengths are what
makes bf16 slow unpadded) after prompts of ``--prompt`` on average, with the target's top-16 distribution at every
answer position, as ``depctl draft train`` trains on them. Each recipe runs ``--repeat`` answers after a warm-up;
the recipes alternate, twice through, each run in a fresh process, and the table keeps each one's faster run. No
model is loaded: the numbers are the head's products and the optimizer's, the part of a training minute that a
recipe changes. The last two rows are a learning deployment's trainer (``training.online._Trainer``: windows of
about a slice, the prompt's positions trained too, a running average of the weights), so they compare with each
other, not with the rows above.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from depctl_runtime.model.eagle import EagleConfig, EagleHead
from depctl_runtime.training.eagle import BATCH_ROWS, DRAFT_VOCAB, SHAPE_BUCKET, _loss, adamw

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.random_model import SHAPES  # noqa: E402

# label -> (products' dtype, fused AdamW, positions a step (0: a step an answer), answers padded to a multiple of), or
# the products' dtype of a learning deployment's trainer
RECIPES = {
    "float32, a step an answer, AdamW": ("float32", False, 0, 0),
    "float32, a step an answer, fused AdamW": ("float32", True, 0, 0),
    "float32, a step per 512 positions": ("float32", True, BATCH_ROWS, 0),
    "bf16 products, a step per 512 positions": ("bfloat16", True, BATCH_ROWS, 0),
    f"bf16, 512 positions, padded to {SHAPE_BUCKET}": ("bfloat16", True, BATCH_ROWS, SHAPE_BUCKET),
    # a learning deployment's trainer (``training.online``): windows of an answer, its prompt's positions too
    "learning head's windows, float32": "float32",
    f"learning head's windows, bf16, padded to {SHAPE_BUCKET}": "bfloat16",
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
        p = int(torch.randint(prompt // 2, prompt * 3 // 2 + 1, (1,), generator=gen))
        a = int(torch.randint(answer // 2, answer * 3 // 2 + 1, (1,), generator=gen))
        tokens = torch.randint(0, vocab, (p + a,), generator=gen) // 12 * 12  # in the draft vocabulary
        top_ids = torch.randint(0, vocab, (a, 16), generator=gen) // 12 * 12
        top_ids[:, 0] = tokens[p:]
        out.append(
            {
                "tokens": tokens,
                "start": p,
                "features": torch.randn(p + a - 1, 3 * 576, generator=gen).bfloat16(),
                "top_ids": top_ids.int(),
                "top_logp": torch.log_softmax(torch.randn(a, 16, generator=gen), -1).half(),
            }
        )
    return out


def run(recipe: tuple, examples: list[dict], warmup: int) -> float:
    """Seconds an answer, over ``examples`` after ``warmup`` of them."""
    dtype, fused, batch, bucket = recipe
    head = head_for_smollm2()
    params = [p for n, p in head.named_parameters() if not n.startswith("embed_tokens")]
    optimizer = adamw(params, 5e-4) if fused else torch.optim.AdamW(params, lr=5e-4, weight_decay=0.0)
    precision = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16")
    pending = 0
    started = None
    for i, example in enumerate(examples):
        if i == warmup:
            started = time.perf_counter()
        with precision:
            loss, counted = _loss(head, example, 2, bucket)
        (loss / max(batch, counted)).backward()
        pending += counted
        if pending >= batch:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            pending = 0
    return (time.perf_counter() - started) / (len(examples) - warmup)


def run_learning(dtype: str, examples: list[dict], warmup: int) -> float:
    """Seconds an answer for a learning deployment's trainer: windows of about a slice each, prompts included."""
    from depctl_runtime.training.online import SLICE, LearnOptions, _Trainer
    from depctl_runtime.training.traffic import Answer, Top

    trainer = _Trainer(head_for_smollm2(), LearnOptions(steps=4, train_dtype=dtype))
    queue = [
        Answer(e["tokens"], e["features"], e["start"], top=Top(e["top_ids"], e["top_logp"], e["start"] - 1))
        for e in examples
    ]
    fed = 0

    def next_answer() -> Answer:
        nonlocal fed
        fed += 1
        return queue[fed - 1]

    while fed <= warmup:
        trainer.train_window(next_answer, SLICE)
    started, first = time.perf_counter(), fed
    while fed < len(queue):
        trainer.train_window(next_answer, SLICE)
    return (time.perf_counter() - started) / (fed - first)


def timed(recipe: tuple | str, prompt: int, answer: int, n: int, warmup: int) -> float:
    examples = answers(n, prompt, answer, 49152)
    return run_learning(recipe, examples, warmup) if isinstance(recipe, str) else run(recipe, examples, warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--answer", type=int, default=120, help="answer tokens, on average (draft train's: ~120)")
    parser.add_argument("--prompt", type=int, default=40, help="prompt tokens, on average (draft train's: ~40)")
    parser.add_argument("--repeat", type=int, default=20, help="answers timed a recipe")
    args = parser.parse_args()
    warmup = 6
    best: dict[str, float] = {}
    for _ in range(2):
        for label, recipe in RECIPES.items():
            # each recipe in a process of its own: oneDNN keeps the kernels it built for each shape process-wide, and
            # the unpadded recipe's hundreds of shapes would evict the padded one's
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                took = pool.submit(timed, recipe, args.prompt, args.answer, warmup + args.repeat, warmup).result()
            best[label] = min(best.get(label, took), took)
    first = next(iter(best.values()))
    print(f"{torch.get_num_threads()} threads, answers of {args.answer} tokens after {args.prompt}, on average\n")
    print("| recipe | ms an answer | positions a second | vs the first |")
    print("|---|---:|---:|---:|")
    for label, took in best.items():
        print(f"| {label} | {took * 1000:.1f} | {args.answer / took:,.0f} | {first / took:.2f}x |")


if __name__ == "__main__":
    main()
