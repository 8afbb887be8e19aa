"""Time to first token with and without the prefix cache, in process (depctl's engine, no HTTP): a shared system
prompt read cold and then warm by other questions, and a conversation's turns. Prints a table; the outputs with and
without a hit are compared token for token.

    .venv/bin/python benchmarks/prefix_cache.py                                  # SmolLM2, float32
    .venv/bin/python benchmarks/prefix_cache.py --quantization int4 --prefix-tokens 4096
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from importlib import resources

from depctl.spec import DeploymentSpec
from depctl_runtime.backends.loader import load_deployment
from depctl_runtime.speculation import GenerationParams
from depctl_runtime.speculation.scheduler import Scheduler


def first_token(engine, prompt: list[int], max_tokens: int = 1, scheduler=None) -> tuple[float, list[int], int]:
    """Seconds to the first token, the output, and the prompt tokens read from the cache."""
    scheduler = scheduler or Scheduler(engine, 1)
    seq = engine.new_sequence(prompt, GenerationParams(max_tokens=max_tokens, ignore_eos=True))
    t0 = time.perf_counter()
    scheduler.add(seq)
    first, out, cached = None, [], 0
    while scheduler.has_work():
        for _, o in scheduler.step():
            if first is None and o.token_ids:
                first = time.perf_counter() - t0
            out += o.token_ids
            cached += o.cached_tokens
    return first, out, cached


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=6)
    args = parser.parse_args()
    spec = DeploymentSpec(id="bench", model=args.model, quantization=args.quantization, max_batch_size=1)
    loaded = load_deployment(spec)
    engine, tokenizer = loaded.engine, loaded.tokenizer
    lines = resources.files("depctl").joinpath("data/prompts/grounded.jsonl").read_text().splitlines()
    texts = [json.loads(line)["prompt"] for line in lines]
    system = ""
    while len(tokenizer(system)["input_ids"]) < args.prefix_tokens:
        system += texts[len(system) % len(texts)] + "\n"

    def chat(messages) -> list[int]:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    store = engine.prefix
    questions = [f"Question {i}: what is the main point of passage {i}?" for i in range(args.questions)]
    rows = []
    # a shared system prompt: cold (nothing cached) for each question, then warm
    cold, warm, same = [], [], True
    for q in questions:
        prompt = chat([{"role": "system", "content": system}, {"role": "user", "content": q}])
        store.clear()
        engine.prefix = None
        t_cold, out_cold, _ = first_token(engine, prompt, 8)
        engine.prefix = store
        first_token(engine, chat([{"role": "system", "content": system}, {"role": "user", "content": "hi"}]))
        t_warm, out_warm, cached = first_token(engine, prompt, 8)
        cold.append(t_cold)
        warm.append(t_warm)
        same &= out_cold == out_warm
    n = len(prompt)
    rows.append(
        (
            f"shared {n}-token system prompt, first token (median of {len(questions)})",
            statistics.median(cold),
            statistics.median(warm),
            same,
            cached,
        )
    )
    # a conversation: each turn adds the answer and a new question; between turns, the idle time the scheduler takes
    # to read the answer into the cache (a user reading it and typing takes longer)
    idle = []
    for use_cache in (False, True):
        store.clear()
        engine.prefix = store if use_cache else None
        scheduler = Scheduler(engine, 1)
        messages = [{"role": "system", "content": "You are a helpful assistant."}]
        times = []
        for turn in range(args.turns):
            messages.append({"role": "user", "content": texts[turn % len(texts)][:600]})
            t, out, cached = first_token(engine, chat(messages), 64, scheduler)
            times.append((t, len(chat(messages)), cached))
            messages.append({"role": "assistant", "content": tokenizer.decode(out, skip_special_tokens=True)})
            t0 = time.perf_counter()
            while scheduler.has_idle_work():
                scheduler.idle()
            if use_cache:
                idle.append(time.perf_counter() - t0)
        if use_cache:
            warm_turns = times
        else:
            cold_turns = times
    engine.prefix = store
    print(f"\n{args.model}, {loaded.target.precision}, passes: {loaded.compiled.split(' (')[0]}")
    print("| what | no prefix cache, s | prefix cache, s | ratio | same output | cached tokens |")
    print("|---|---:|---:|---:|---|---:|")
    for what, c, w, s, k in rows:
        print(f"| {what} | {c:.3f} | {w:.3f} | {w / c:.2f}x | {'yes' if s else 'NO'} | {k} |")
    for i, ((tc, n, _), (tw, _, k)) in enumerate(zip(cold_turns, warm_turns)):
        print(
            f"| conversation turn {i + 1} ({n} prompt tokens), first token "
            f"| {tc:.3f} | {tw:.3f} | {tw / tc:.2f}x | | {k} |"
        )
    print(
        f"\nturn {args.turns} against turn 1 with the cache: {warm_turns[-1][0] / warm_turns[0][0]:.2f}x; without: "
        f"{cold_turns[-1][0] / cold_turns[0][0]:.2f}x; idle time reading each answer into the cache: "
        + ", ".join(f"{t:.2f}" for t in idle[:-1])
        + " s"
    )


if __name__ == "__main__":
    main()
