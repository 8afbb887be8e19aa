"""Draft heads side by side on prompts none of them trained on: the mean accepted length at K, workload by workload.
One table.

    .venv/bin/python benchmarks/head_acceptance.py smollm2-135m-instruct now=DIR_A before=DIR_B
    .venv/bin/python benchmarks/head_acceptance.py smollm2-135m-instruct a=DIR --workload chat --steps 4
    .venv/bin/python benchmarks/head_acceptance.py smollm2-135m-instruct a=DIR --bits 8,4   # as a CPU serves it

Each argument after the target is LABEL=DIR, a head ``depctl draft train`` wrote for it. The target answers each
workload's benchmark prompts greedily through depctl's engine, keeping the features a deployment hands its head (the
trainer's own answering, ``training.eagle._answers``); every head then drafts greedily over the same answers, as
``draft train`` measures its held-out prompts: the share of first drafts accepted, and the mean accepted length (the
verified token plus the drafts accepted up to the first miss). The benchmark prompts are none of the shipped training
prompts, so this measures what a head learned beyond the prompts it was trained on.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from depctl import workloads  # noqa: E402
from depctl_runtime.backends.eagle import quantize_products  # noqa: E402
from depctl_runtime.backends.weights import resolve_source  # noqa: E402
from depctl_runtime.kernels import native  # noqa: E402
from depctl_runtime.model import eagle_format  # noqa: E402
from depctl_runtime.training.eagle import TrainOptions, _answers, _reference_model, evaluate  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target")
    parser.add_argument("heads", nargs="+", metavar="LABEL=DIR")
    parser.add_argument("--workload", default="chat,code,grounded", help="benchmark workloads, comma-separated")
    parser.add_argument("--steps", type=int, default=4, help="the K drafts are measured at")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--quantization", default="none", help="the target's weights while it answers")
    parser.add_argument("--bits", default="", help="also each head with its linears at these bits, comma-separated")
    args = parser.parse_args()
    heads = dict(pair.split("=", 1) for pair in args.heads)
    source = resolve_source(args.target, "TARGET", lambda stage: None)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    embeddings = _reference_model(source).get_input_embeddings().weight.detach().float().clone()
    loaded = {label: eagle_format.load(Path(path), embeddings)[0] for label, path in heads.items()}
    for bits in [int(b) for b in args.bits.split(",") if b]:
        native.load()
        for label in list(heads):
            packed = loaded[f"{label}@{bits}-bit"] = copy.deepcopy(loaded[label])
            quantize_products(packed, bits)
    layers = next(iter(loaded.values())).config.aux_layers
    rows = []
    for workload in args.workload.split(","):
        conversations = [[{"role": "user", "content": p}] for p in workloads.load(workload)]
        opts = TrainOptions(
            target=args.target,
            out=Path("."),
            samples=1,
            written=False,
            max_tokens=args.max_tokens,
            quantization=args.quantization,
        )
        with tempfile.TemporaryDirectory() as cache, contextlib.redirect_stdout(sys.stderr):  # its progress lines
            examples = _answers(opts, tokenizer, conversations, layers, Path(cache), time.monotonic(), 1e9, set())
        scores = {label: evaluate(head, examples, args.steps) for label, head in loaded.items()}
        tokens = sum(len(e["tokens"]) - e["start"] for e in examples)
        rows.append((workload, len(examples), tokens, scores))
    labels = list(loaded)
    header = "| workload | answers | tokens | " + " | ".join(f"{x}: mean accepted | first drafts" for x in labels)
    print(f"\nK={args.steps}, greedy answers of up to {args.max_tokens} tokens\n")
    print(header + " |")
    print("|---|---:|---:|" + "---:|---:|" * len(labels))
    for workload, answers, tokens, scores in rows:
        cells = " | ".join(f"{scores[x]['mean_accepted']:.3f} | {scores[x]['acceptance'][0]:.0%}" for x in labels)
        print(f"| {workload} | {answers} | {tokens} | {cells} |")


if __name__ == "__main__":
    main()
