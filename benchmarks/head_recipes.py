"""Recipes for a learning draft head, side by side: held-out acceptance against minutes of training, from one folder of
recorded traffic. One table.

    .venv/bin/python benchmarks/head_recipes.py --traffic $DEPCTL_HOME/learning/<deployment>/traffic --minutes 8
    .venv/bin/python benchmarks/head_recipes.py --traffic DIR --recipes current,2-steps --minutes 20 --every 4
    .venv/bin/python benchmarks/head_recipes.py --traffic DIR --start-from HEAD --recipes deployment,continued-lr-1e-4 \
        --workload chat

The traffic is what a deployment with ``--learn-draft-head`` recorded (its answers and idle answers: the target's
layer features and tokens). Each recipe trains a new head from it as the deployment trains one in idle time
(``training.online._Trainer``: windows of an answer, prompt positions included, the training-time test's chained
steps), for ``--minutes`` of training time; every ``--every`` minutes the head drafts greedily over every held-out
answer at K (the mean accepted length, and the share of first drafts accepted), which is not counted as training;
where the recipe keeps a running average of the weights (``LearnOptions.average``), the average is measured too,
beside the weights as trained (the same run: averaging never changes the training). With ``--start-from``, every
recipe goes on from a trained head (``--learn-draft-head-from``: its weights and draft vocabulary) instead of a new
one, and minute 0 measures that head. With ``--workload``, every measurement is made on the target's greedy answers
to that prompt set too: a head given to a deployment may have trained on the prompts its traffic answered, and only
prompts none of them saw tell what it learned.
Recipes run one after another in this process: run on a quiet machine.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

# what each recipe changes in the deployment's own: ``LearnOptions`` fields, the draft vocabulary's size, and the
# answers it is chosen from (all of them by default)
RECIPES = {
    "deployment": {},  # as a learning deployment trains now
    # with --start-from, as it trained on from a given head before: at a new head's rate, the average's memory short
    "continued-as-new": {"continued_lr": 5e-4, "continued_full_memory": False},
    "4-steps-vocab-8192": {"train_steps": 4, "draft_vocab": 8192},  # as it trained before (K=4)
    "4-steps": {"train_steps": 4},  # a pass of the head and its output layer per chained step
    "vocab-8192": {"draft_vocab": 8192},
    "lr-1e-3": {"lr": 1e-3},
    "lr-2e-3": {"lr": 2e-3},  # the running average smooths what a faster rate adds in noise
    "batch-256": {"batch_rows": 256},  # twice the optimizer steps
    "average-0.995": {"average": 0.995},  # a shorter running average of the weights
    "no-average": {"average": 0.0},  # the weights as trained are the candidate
    # the vocabulary chosen from the first answers recorded, as a deployment chose it once, when training started
    "first-16-vocabulary": {"vocabulary_answers": 16},
    "hard-labels": {"soft_labels": False},  # every position labelled with the token the target chose
    # with --start-from: a head trained already, going on from where its annealing left it, more slowly, and its
    # running average's memory full from the first step
    "continued-lr-1e-4": {"continued_lr": 1e-4},
    "continued-lr-1e-4-full-memory": {"continued_lr": 1e-4, "continued_full_memory": True},
    "continued-lr-2e-5-full-memory": {"continued_lr": 2e-5, "continued_full_memory": True},
    "continued-full-memory": {"continued_full_memory": True},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--traffic", type=Path, required=True)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--minutes", type=float, default=8.0, help="training time a recipe")
    parser.add_argument("--every", type=float, default=2.0, help="minutes of training between measurements")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--start-from", type=Path, default=None, help="a trained head every recipe goes on from")
    parser.add_argument(
        "--workload",
        default=None,
        help="also measure on the target's greedy answers to this prompt set of depctl/data/prompts (chat, code, ...): "
        "prompts unlike the shipped ones the traffic may have answered",
    )
    parser.add_argument("--max-tokens", type=int, default=192, help="of each --workload answer")
    parser.add_argument(
        "--label",
        action="store_true",
        help="where the traffic kept no distributions, compute the target's at every answer position first",
    )
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from depctl_runtime.backends.weights import resolve_source
    from depctl_runtime.model import eagle_format
    from depctl_runtime.model.eagle import EagleConfig, EagleHead
    from depctl_runtime.training.eagle import DRAFT_VOCAB, _vocabulary, evaluate
    from depctl_runtime.training.online import SLICE, LearnOptions, _Trainer, trainable_copy
    from depctl_runtime.training.traffic import read_answer

    source = resolve_source(args.model, "MODEL", lambda stage: None)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    embeddings = model.get_input_embeddings().weight.detach()
    final_norm = model.model.norm.weight.detach()
    files = sorted(args.traffic.glob("*.safetensors"), key=lambda p: int(p.stem.split("-")[1]))  # as recorded
    train = [p for p in files if p.name.startswith("train-")]
    held = [a.example() for a in map(read_answer, (p for p in files if p.name.startswith("held-"))) if a is not None]
    examples = [a.example() for a in map(read_answer, train) if a is not None]
    positions = sum(len(e["tokens"]) for e in examples)
    labels = _label(model, train) if args.label else {}
    if args.label:
        read_answer = _labelled(read_answer, labels)
    print(
        f"{args.model}: {len(examples)} recorded answers ({positions:,} positions), {len(held)} held out; K={args.k}, "
        f"torch threads {torch.get_num_threads()}"
    )
    measured_on = {"": held}
    if args.workload:
        measured_on[f" on {args.workload}"] = workload_answers(
            args.model, args.workload, args.max_tokens, EagleConfig.for_target(model.config, DRAFT_VOCAB).aux_layers
        )
        print(f"  {len(measured_on[f' on {args.workload}'])} greedy answers to the {args.workload!r} prompts")
    answer_tokens = torch.cat([e["tokens"][e["start"] :] for e in held])
    chosen = {(r.get("draft_vocab", DRAFT_VOCAB), r.get("vocabulary_answers", len(examples))) for r in RECIPES.values()}
    for size, n in sorted(chosen):
        vocabulary = _vocabulary(examples[:n], size, model.config.vocab_size)
        covered = torch.isin(answer_tokens, vocabulary).float().mean()
        print(
            f"  a {size}-token draft vocabulary chosen from {min(n, len(examples))} answers covers {covered:.1%} of "
            "the held-out answers' tokens"
        )

    results: dict[str, list[dict]] = {}
    for name in args.recipes.split(","):
        recipe = dict(RECIPES[name])
        size = recipe.pop("draft_vocab", DRAFT_VOCAB)
        chosen_from = examples[: recipe.pop("vocabulary_answers", len(examples))]
        options = LearnOptions(steps=args.k, **recipe)
        config = EagleConfig.for_target(model.config, size)
        if args.start_from is not None:  # its weights and vocabulary, as a learning deployment goes on from it
            given, _ = eagle_format.load(args.start_from, embeddings)
            given.embed_tokens.weight = torch.nn.Parameter(embeddings, requires_grad=False)
            head = trainable_copy(given)
            trainer = _Trainer(head, options, continued=True)
        else:
            head = EagleHead(config)
            head.embed_tokens.weight = torch.nn.Parameter(embeddings, requires_grad=False)
            trainer = _Trainer(head, options, _vocabulary(chosen_from, size, config.vocab_size), final_norm)
        rng, queue = random.Random(0), []

        def next_answer():
            while True:
                if not queue:
                    queue.extend(train)
                    rng.shuffle(queue)
                answer = read_answer(queue.pop())
                if answer is not None:
                    return answer

        rows, due = [], 0.0
        while True:
            if trainer.seconds >= due:
                trainer.flush()
                row = {"minutes": trainer.seconds / 60, "positions": trainer.rows}
                heads = {"": head} if trainer.average is None else {" (weights)": head, " (average)": trainer.average}
                for label, measured_head in heads.items():
                    for on, examples in measured_on.items():
                        t0 = time.perf_counter()
                        measured = row[label + on] = evaluate(measured_head, examples, args.k)
                        print(
                            f"  [{name}{label}{on}] {trainer.seconds / 60:.1f} min, {trainer.rows:,} positions: mean "
                            f"accepted {measured['mean_accepted']}, first {measured['acceptance'][0]:.1%} "
                            f"(measured in {time.perf_counter() - t0:.0f} s)",
                            flush=True,
                        )
                rows.append(row)
                if trainer.seconds >= args.minutes * 60:
                    break
                due += args.every * 60
            trainer.train_window(next_answer, SLICE)
        results[name] = rows

    names = list(results)
    columns = [(n, label) for n in names for label in results[n][0] if label not in ("minutes", "positions")]
    print("\nmean accepted length at K on the held-out answers (first drafts accepted), by minutes of training\n")
    print("| minutes | " + " | ".join(n + label for n, label in columns) + " |")
    print("|---:|" + "---|" * len(columns))
    for i in range(max(len(r) for r in results.values())):
        cells = []
        for name, label in columns:
            row = results[name][i][label] if i < len(results[name]) else None
            cells.append(f"{row['mean_accepted']:.3f} ({row['acceptance'][0]:.0%})" if row else "")
        minutes = next(results[n][i]["minutes"] for n in names if i < len(results[n]))
        print(f"| {minutes:.0f} | " + " | ".join(cells) + " |")
    print(
        "| positions a minute | "
        + " | ".join(f"{results[n][-1]['positions'] / max(results[n][-1]['minutes'], 1e-9):,.0f}" for n, _ in columns)
        + " |"
    )


def workload_answers(model: str, workload: str, max_tokens: int, layers: tuple[int, ...]) -> list[dict]:
    """The target's greedy answers to a prompt set, with the layer features its engine computed while answering (as a
    learning deployment records them): held-out answers no traffic trained on."""
    from depctl import workloads
    from depctl.spec import DeploymentSpec, NoSpeculation
    from depctl_runtime.backends.loader import load_deployment
    from depctl_runtime.speculation import GenerationParams, Scheduler, SpeculativeEngine
    from depctl_runtime.training.capture import FeatureRecorder

    spec = DeploymentSpec(id="recipes", model=model, speculation=NoSpeculation(), max_batch_size=8)
    loaded = load_deployment(spec, calibrate=False, features=tuple(layers))
    try:
        recorder = FeatureRecorder(torch.float32)
        engine = SpeculativeEngine(loaded.engine.target, recorder, loaded.engine.config)
        scheduler = Scheduler(engine, max_batch_size=8)
        tokenizer, pending = loaded.tokenizer, {}
        for text in workloads.load(workload):
            chat = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
            prompt = tokenizer(chat, add_special_tokens=False)["input_ids"]
            seq = engine.new_sequence(prompt, GenerationParams(max_tokens=max_tokens, speculate=False))
            pending[seq.id] = (prompt, [])
            scheduler.add(seq)
        examples = []
        while scheduler.has_work():
            for seq, out in scheduler.step():
                prompt, answer = pending[seq.id]
                answer.extend(out.token_ids)
                if out.finish_reason:
                    ids = prompt + answer
                    features = recorder.take(seq.id)["features"][: len(ids) - 1]
                    examples.append({"start": len(prompt), "tokens": torch.tensor(ids), "features": features})
        return examples
    finally:
        loaded.release()


@torch.inference_mode()
def _label(model, files: list[Path]) -> dict:
    """The target's top tokens at every answer position of each file that kept none (a pass over its tokens), as a
    learning deployment keeps them (``capture.keep_top``)."""
    from depctl_runtime.training.capture import Recorded, keep_top
    from depctl_runtime.training.traffic import Top, read_answer

    out, t0 = {}, time.perf_counter()
    for path in files:
        answer = read_answer(path)
        if answer is None or answer.top is not None:
            continue
        kept = Recorded()
        keep_top(kept, model(input_ids=answer.tokens[None].long()).logits[0, answer.prompt_len - 1 : -1])
        out[path] = Top(kept.top_ids[0], kept.top_logp[0], answer.prompt_len - 1)
    print(f"  labelled {len(out)} answers with the target's distribution in {time.perf_counter() - t0:.0f} s")
    return out


def _labelled(read, labels: dict):
    """``read_answer`` that attaches the distributions ``_label`` computed."""

    def read_labelled(path):
        answer = read(path)
        if answer is not None and path in labels:
            answer.top = labels[path]
        return answer

    return read_labelled


if __name__ == "__main__":
    main()
