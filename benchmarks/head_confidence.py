"""What a draft head's own confidence is worth: of its drafts, grouped by the head's probability of its chain up to
each, the share the target accepted. One table.

    .venv/bin/python benchmarks/head_confidence.py --head DIR
    .venv/bin/python benchmarks/head_confidence.py --head $DEPCTL_HOME/learning/<deployment>/head --clients 8

``--head`` is a head's folder (`depctl draft train --out DIR`, or a learning deployment's ``head``). The held-out
workload (``--workload``, a prompt set of ``depctl/data/prompts``) runs at ``--clients`` rows in process, greedy,
every step drafting ``--k`` tokens a row from the head, none cut for being unsure, so every confidence is verified.
The output is the target's whatever is drafted; only the drafts' fate is counted. A head is calibrated where the
share accepted matches the confidence; the deployment's policy keeps the same record while it serves
(``policy.DraftConfidence``, the ``draft_confidence`` of its status), from the drafts it verifies.
"""

from __future__ import annotations

import argparse
import time

BINS = 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head", required=True)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--workload", default="chat")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=160)
    args = parser.parse_args()

    from depctl import workloads
    from depctl.spec import DeploymentSpec, DraftModelSpeculation
    from depctl_runtime.backends.loader import load_deployment
    from depctl_runtime.speculation import GenerationParams, Scheduler

    spec = DeploymentSpec(
        id="head-confidence",
        model=args.model,
        max_batch_size=args.clients,
        prefix_cache_bytes=0,
        speculation=DraftModelSpeculation(draft_model=args.head, num_draft_tokens=args.k),
    )
    loaded = load_deployment(spec, calibrate=False)
    tokenizer, engine = loaded.tokenizer, loaded.engine
    policy = engine.policy
    policy.width = lambda rows, trees=False: (args.k, policy.expected(rows, args.k))  # every step drafts K
    policy.draft_threshold = lambda batch: 1e-9  # a threshold asks for each chain's probability; none is cut
    counts = [[0, 0] for _ in range(BINS)]  # per tenth of confidence: [accepted, verified]

    def observe(chain: list[float], accepted: int) -> None:
        for j, p in enumerate(chain):
            counts[min(int(p * BINS), BINS - 1)][0] += j < accepted
            counts[min(int(p * BINS), BINS - 1)][1] += 1

    policy.observe_confidence = observe
    prompts = []
    for text in workloads.load(args.workload):
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        prompts.append(tokenizer(chat, add_special_tokens=False)["input_ids"])
    scheduler = Scheduler(engine, args.clients)
    for i in range(2 * args.clients):
        scheduler.add(engine.new_sequence(prompts[i % len(prompts)], GenerationParams(max_tokens=args.max_tokens)))
    start = time.perf_counter()
    while scheduler.has_work():
        scheduler.step()
    print(
        f"{args.model}, head {args.head}: {args.workload!r} workload, {2 * args.clients} requests over "
        f"{args.clients} rows, K={args.k}, greedy, {time.perf_counter() - start:.0f} s\n"
    )
    print("| head's probability of its chain | drafts verified | share accepted |")
    print("|---|---:|---:|")
    for i, (accepted, verified) in enumerate(counts):
        if verified:
            print(f"| {i / BINS:.1f}-{(i + 1) / BINS:.1f} | {verified} | {accepted / verified:.2f} |")
    loaded.release()


if __name__ == "__main__":
    main()
