"""A learning draft head over time: chat speed at one client, against plain decoding, as the deployment serves its own
traffic and trains in its idle time. Prints one table row a round, then what training in idle time costs requests.

    .venv/bin/python benchmarks/learning.py --minutes 60
    .venv/bin/python benchmarks/learning.py --model qwen2.5-coder-1.5b-instruct --quantization int4 --workload code

In process, as the daemon runs it: a plain deployment and a learning one (``--learn-draft-head`` beside n-gram
speculation, n=3, K as the CLI gives n-gram unless ``--k``: n-gram drafts never come from another request, so no
measuring request teaches the next),
each loaded as the daemon loads it (compiled passes where they pay). A round:

1. **traffic**: the learning deployment answers ``--traffic`` prompts from the set depctl ships for training heads
   (``depctl/data/train/prompts.jsonl``: chat, instructions and code), ``--clients`` at a time, greedy on the first
   pass over the set and sampled at temperature 0.7 after;
2. **idle time**: ``--idle`` seconds in which the engine thread does what it does when no request waits
   (``Scheduler.idle``: write the answers recorded, answer prompts of its own (the shipped set, then requests the
   target writes: the "requests written" column), train, compare, swap in a better generation);
3. **measure**: the held-out workload (``--workload``, a prompt set of ``depctl/data/prompts``, none of them in the
   training set), one request at a time, each prompt on the plain deployment then on the learning one, greedy:
   output tokens a second over the whole set, the ratio, and whether every output is the plain one. These requests
   are not recorded (the head never trains on what measures it); the serving head's mean accepted length at K over
   their answers, every position, as the deployment measures heads on its held-out answers, is the "held-out
   workload accepted" column (the deployment's own figure is on the most recent answers to its held-out prompts,
   here prompts of the shipped set, like the ones it trains on). That column is always at K=4, the measure of a
   head's quality the draft-head tables use, whatever K the deployment drafts with.

After the last round, the learned deployment under load (``--load``, 8 and 16 clients): the held-out workload's
prompts queued at once, each level ``--repeat`` times with the modes alternating, against the plain deployment
(not recorded either, but the learning deployment still keeps their features as it would to record them), and the
learning deployment's requests once more asking for no drafts: what it costs apart from its speculation. After
the table, the guard's view of each level: per band of batch sizes, each kind of drafting step against plain ones.

Round 0 measures before any traffic (the n-gram index alone). Run on a quiet machine: both deployments share the
process's threads, and nothing else should run. With ``--home`` of an earlier run, the deployment resumes what it
learned and the minutes go on from where that run stopped.

Beside the speed, each round shows the head's own drafts while measuring (how many steps drafted from it, and their
mean accepted length, apart from the n-gram index's copies) and what the policy's guard measured at one row: the
head's steps and the index's against plain steps, in tokens a second ("off": that kind stopped drafting there).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time

import torch

HEAD_K = 4  # the K a head's mean accepted length on the held-out workload is measured at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--workload", default="chat")
    parser.add_argument("--minutes", type=float, default=60.0, help="traffic and idle time in all")
    parser.add_argument("--traffic", type=int, default=24, help="requests served a round")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--idle", type=float, default=120.0, help="seconds of idle time a round")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--k", type=int, default=None, help="the deployment's K (default: the CLI's for n-gram)")
    parser.add_argument("--home", default=None, help="DEPCTL_HOME for the learned head (default: a new folder)")
    parser.add_argument("--load", default="8,16", help="clients of the load test after the last round ('' for none)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each load level, the modes alternating")
    parser.add_argument(
        "--start-from", default=None, metavar="DIR", help="a trained head to learn on from (--learn-draft-head-from)"
    )
    parser.add_argument(
        "--whole-drafts", action="store_true", help="verify every draft the policy asks for, however unsure the head"
    )
    args = parser.parse_args()
    os.environ["DEPCTL_HOME"] = args.home or tempfile.mkdtemp(prefix="depctl-learning-")
    clock = os.path.join(os.environ["DEPCTL_HOME"], "learning-benchmark.json")  # minutes of earlier runs
    earlier = json.load(open(clock))["minutes"] if os.path.exists(clock) else 0.0

    from depctl import workloads
    from depctl.spec import default_draft_tokens
    from depctl_runtime.speculation import GenerationParams, SamplingParams, Scheduler
    from depctl_runtime.speculation.scheduler import generate
    from depctl_runtime.training.data import load_conversations
    from depctl_runtime.training.eagle import acceptance, reach
    from depctl_runtime.training.traffic import TrafficRecorder

    k = args.k or default_draft_tokens("--ngram-speculation-length")
    levels = [int(c) for c in args.load.split(",") if c.strip()]
    start = os.path.abspath(args.start_from) if args.start_from else None
    plain, learning = load_pair(args.model, args.quantization, max([args.clients, *levels]), k, start)
    # as the daemon does after a load: a full collection over the loaded models' objects stalls whichever pass it
    # hits, and the deployment that allocates more (the learning one) triggers more of them
    gc.collect()
    gc.freeze()
    tokenizer, learner, engine = learning.tokenizer, learning.learner, learning.engine
    engine.config.cut_unsure_drafts &= not args.whole_drafts

    traffic = [chat_ids(tokenizer, c) for c in load_conversations(None)]
    held = [chat_ids(tokenizer, [{"role": "user", "content": p}]) for p in workloads.load(args.workload)]
    scheduler = Scheduler(engine, args.clients, background=learner)
    greedy = GenerationParams(max_tokens=args.max_tokens)

    def run(eng, prompt) -> tuple[list[int], float]:
        start = time.perf_counter()
        out = [t for o in generate(eng, prompt, greedy) for t in o.token_ids]
        return out, time.perf_counter() - start

    def measure() -> dict:
        # the measuring requests are not recorded for training: their answers only measure the serving head
        answers = _Answers()
        observer, engine.observer = engine.observer, TrafficRecorder(answers, torch.float32)
        stats = engine.stats
        before = (stats.num_drafts, stats.num_accepted_tokens, stats.num_model_drafts, stats.num_model_accepted_tokens)
        times, tokens, exact = {"plain": 0.0, "learning": 0.0}, 0, True
        try:
            for prompt in held:
                want, t_plain = run(plain.engine, prompt)
                got, t_learn = run(engine, prompt)
                times["plain"] += t_plain
                times["learning"] += t_learn
                tokens += len(want)
                exact &= got == want
        finally:
            engine.observer = observer
        drafts, accepted, head_drafts, head_accepted = (
            now - then
            for now, then in zip(
                (stats.num_drafts, stats.num_accepted_tokens, stats.num_model_drafts, stats.num_model_accepted_tokens),
                before,
            )
        )
        guard = engine.policy.snapshot()["drafting_over_plain"].get(1, {})
        workload_accepted = None
        if learner.serving is not None:
            reached, positions = [0] * HEAD_K, 0
            for answer in answers.kept:
                r, n = reach(learner.serving, answer.example(), HEAD_K)
                reached, positions = [a + b for a, b in zip(reached, r)], positions + n
            workload_accepted = acceptance(reached, positions)["mean_accepted"] if positions else None
        return {
            "plain": tokens / times["plain"],
            "learning": tokens / times["learning"],
            "mean_accepted": 1 + accepted / drafts if drafts else None,
            "head_drafts": head_drafts,
            "workload_accepted": workload_accepted,
            "head_accepted": 1 + head_accepted / head_drafts if head_drafts else None,
            "guard": " / ".join(
                f"{kind} {g['ratio']:.2f}{' off' if g['off'] else ''}"
                for kind, g in guard.items()
                if kind in ("model", "free")
            )
            or "-",
            "exact": exact,
        }

    print(
        f"{args.model} ({args.quantization}), held-out workload {args.workload!r} ({len(held)} prompts, "
        f"{args.max_tokens} tokens, 1 client), traffic {args.traffic} requests x {args.clients} clients a round, "
        f"{args.idle:g} s idle a round; K={k}; torch threads {torch.get_num_threads()}",
        flush=True,
    )
    header = (
        "| minutes | answers recorded | requests written | trained (min) | generation | held-out accepted "
        "| held-out workload accepted (K=4) | live accepted | head steps | head accepted | steps vs plain at 1 row "
        "| plain tok/s | learning tok/s | speedup | exact |"
    )
    print(header + "\n|" + "---:|" * 10 + "---|" + "---:|" * 3 + "---|", flush=True)
    slices: list[float] = []
    started, served, round_ = time.monotonic(), 0, 0
    while True:
        m = measure()
        status = learner.status()
        minutes = earlier + (time.monotonic() - started) / 60
        print(
            f"| {minutes:.1f} | {status['traffic']['answers'] + status['traffic']['waiting']}"
            f" | {status['training']['requests_written']}"
            f" | {status['training']['minutes']:.1f} | {status['generation']}"
            f" | {status['held_out_mean_accepted'] or '-'} | {_fmt(m['workload_accepted'])}"
            f" | {_fmt(m['mean_accepted'])}"
            f" | {m['head_drafts']} | {_fmt(m['head_accepted'])} | {m['guard']}"
            f" | {m['plain']:.1f} | {m['learning']:.1f} | {m['learning'] / m['plain']:.2f}x"
            f" | {'yes' if m['exact'] else 'NO'} |",
            flush=True,
        )
        with open(clock, "w") as f:
            json.dump({"minutes": minutes}, f)
        if minutes >= earlier + args.minutes:
            break
        batch = []
        for i in range(args.traffic):  # greedy on the first pass over the set, sampled after
            n = served + i
            sampling = SamplingParams(temperature=0.7, seed=n) if n >= len(traffic) else None
            params = GenerationParams(max_tokens=256, **({"sampling": sampling} if sampling else {}))
            batch.append((traffic[n % len(traffic)], params))
        served += args.traffic
        for prompt, params in batch:
            scheduler.add(engine.new_sequence(prompt, params))
        while scheduler.has_work():
            scheduler.step()
        idle_until = time.monotonic() + args.idle
        while time.monotonic() < idle_until:
            if scheduler.has_idle_work():
                t0 = time.perf_counter()
                scheduler.idle()
                slices.append(time.perf_counter() - t0)
            else:
                time.sleep(0.05)
        round_ += 1
    if slices:
        slices.sort()
        print(
            f"\nidle-time slices: {len(slices)}, median {statistics.median(slices) * 1000:.0f} ms, "
            f"p99 {slices[int(len(slices) * 0.99)] * 1000:.0f} ms, longest {slices[-1] * 1000:.0f} ms "
            "(a request arriving in idle time waits for the slice under way, at most)"
        )
    print("\nthe comparisons (held-out mean accepted length at K, candidate against the serving generation):")
    for h in learner.history:
        print(
            f"  {h['at']}  trained {h['trained_minutes']:.1f} min  answers {h['answers']}  candidate {h['candidate']}"
            f"  serving {h['serving']}  -> generation {h['generation']}{'  (promoted)' if h['promoted'] else ''}"
        )
    if levels:
        print(
            f"\nunder load: the held-out workload's prompts, {args.repeat} runs a level, the modes alternating; each "
            "run queues max(2 x clients, prompts) requests at once, so the batch stays full until the queue drains"
        )
        print(
            "\n| clients | plain tok/s | learning tok/s | vs plain | each run | head steps | exact "
            "| learning, no drafts: vs plain |"
        )
        print("|---:|---:|---:|---:|---|---:|---|---:|")
        # the learning deployment's requests asking for no drafts too: what the deployment costs apart from its
        # speculation (recording its traffic, reading prompts whole)
        undrafted = GenerationParams(max_tokens=args.max_tokens, speculate=False)
        observer, engine.observer = engine.observer, TrafficRecorder(_Answers(), torch.float32)  # not trained on
        guards = []
        for level in levels:
            rates, exact = {"plain": [], "learning": [], "no drafts": []}, True
            drafts_before = engine.stats.num_model_drafts
            for r in range(args.repeat):
                runs = {}
                for name in ("plain", "learning", "no drafts") if r % 2 == 0 else ("no drafts", "learning", "plain"):
                    eng = plain.engine if name == "plain" else engine
                    params = undrafted if name == "no drafts" else greedy
                    rate, runs[name] = _closed_loop(eng, Scheduler(eng, level), held, level, params)
                    rates[name].append(rate)
                exact &= runs["plain"] == runs["learning"] == runs["no drafts"]
            ratios = [a / b for a, b in zip(rates["learning"], rates["plain"])]
            print(
                f"| {level} | {statistics.mean(rates['plain']):.1f} | {statistics.mean(rates['learning']):.1f}"
                f" | {statistics.mean(rates['learning']) / statistics.mean(rates['plain']):.2f}x"
                f" | {min(ratios):.2f}-{max(ratios):.2f} | {engine.stats.num_model_drafts - drafts_before}"
                f" | {'yes' if exact else 'NO'}"
                f" | {statistics.mean(rates['no drafts']) / statistics.mean(rates['plain']):.2f}x |",
                flush=True,
            )
            guards.append((level, engine.policy.snapshot()["drafting_over_plain"]))
        engine.observer = observer
        for level, guard in guards:  # where each kind of drafting step gained or lost, and whether it is off there
            bands = ", ".join(
                f"{g['sizes']}: {kind} {k['ratio']:.2f}{' off' if k['off'] else ''}"
                for g in guard.values()
                for kind, k in g.items()
                if kind in ("free", "model")
            )
            print(f"\nafter {level} clients, drafting over plain steps by batch size: {bands or '-'}")
    learning.release()
    plain.release()


def load_pair(model: str, quantization: str, rows: int, k: int, start: str | None = None):
    """A plain deployment and a learning one (``--learn-draft-head`` beside n-gram speculation, n=3, K=k; from the
    head in ``start`` where given) of ``model``, each loaded as the daemon loads it. No prefix cache on either:
    held-out prompts come back every round, and a learning deployment reads prompts whole (its head needs every
    position's features)."""
    from depctl.spec import DeploymentSpec, LearnDraftHead, NgramSpeculation
    from depctl_runtime.backends.loader import load_deployment

    common = dict(model=model, quantization=quantization, max_batch_size=rows, prefix_cache_bytes=0)
    plain = load_deployment(DeploymentSpec(id="plain", **common))
    speculation = NgramSpeculation(ngram_length=3, num_draft_tokens=k)
    learning = load_deployment(
        DeploymentSpec(
            id="learning", speculation=speculation, learn_draft_head=LearnDraftHead(start_from=start), **common
        )
    )
    return plain, learning


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """A conversation's prompt tokens as a chat request reads them: the template, then the generation prompt."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def queue_requests(engine, scheduler, prompts, level: int, params) -> tuple[dict[int, list[int]], dict[int, int]]:
    """max(2 x level, len(prompts)) requests over ``prompts``, queued at once on ``scheduler`` (of ``level`` rows: a
    closed loop of that many clients): an empty output per request number, and each sequence's number by its id."""
    outputs: dict[int, list[int]] = {}
    number = {}
    for i in range(max(2 * level, len(prompts))):
        seq = engine.new_sequence(prompts[i % len(prompts)], params)
        number[seq.id], outputs[i] = i, []
        scheduler.add(seq)
    return outputs, number


def _closed_loop(engine, scheduler, prompts, level: int, params) -> tuple[float, dict[int, list[int]]]:
    """``queue_requests``, run to the end: output tokens a second, and each request's tokens."""
    outputs, number = queue_requests(engine, scheduler, prompts, level, params)
    start = time.perf_counter()
    while scheduler.has_work():
        for seq, out in scheduler.step():
            outputs[number[seq.id]].extend(out.token_ids)
    return sum(map(len, outputs.values())) / (time.perf_counter() - start), outputs


class _Answers:
    """Where the measuring requests' answers go (a ``TrafficRecorder``'s store): kept in memory, never trained on."""

    def __init__(self):
        self.kept = []

    def put(self, answer) -> None:
        self.kept.append(answer)


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
