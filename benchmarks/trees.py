"""Do draft trees pay on this machine? A draft model's trees against its chains: replayed, then decoded.

    .venv/bin/python benchmarks/trees.py                                          # the Qwen pair, 4-bit
    .venv/bin/python benchmarks/trees.py --quantization none --draft-precision float32 --dtype float32
    .venv/bin/python benchmarks/trees.py --rows 1,4 --max-tokens 128 --workload code,chat

A tree (what the engine drafts) is the draft model's best b tokens at the first position and a greedy chain under
each, w deep; the target verifies every node in one pass and keeps the longest branch it agrees with.

1. **Replayed.** Under greedy decoding which branch a tree keeps follows from two things, both computed here
   exactly: the target's greedy output ``y`` for each prompt (plain decoding, our engine), and the draft's choices
   at every position of ``prompt + y`` in one teacher-forced pass (while a branch agrees with ``y`` its prefix *is*
   ``y``, so the draft's next choices there are the teacher-forced ones). Speculative decoding replayed over ``y``
   with each shape gives its mean accepted length (tokens a step), and the step is priced with passes timed here on
   the deployment as the daemon loads it: the target's pass over a chain as it runs one (compiled where the loader
   compiled), over a tree as it runs one (eagerly), and the draft's forwards (over b tokens a row below the first
   depth of a tree). Draft forwards are priced as chains: a tree's are attended by mask, which this leaves out.
2. **Decoded.** The engine itself, one request at a time: plain, chains of K every step, trees of 2 branches K
   deep every step, and the policy's own choice; tokens a second, target passes, tree steps, and whether each
   output is plain decoding's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from depctl.spec import DeploymentSpec, DraftModelSpeculation  # noqa: E402
from depctl.workloads import prompts_dir  # noqa: E402
from depctl_runtime.speculation.verify import DraftTree  # noqa: E402


@dataclass(frozen=True)
class Shape:
    """A draft shape: top-``branch`` at the first ``levels`` depths, then chains, ``depth`` tokens deep in all."""

    depth: int
    branch: int = 1
    levels: int = 0

    @property
    def name(self) -> str:
        if self.branch == 1 or self.levels == 0:
            return f"chain K={self.depth}"
        return f"top-{self.branch} x {self.levels} then chains, depth {self.depth}"

    def nodes_at(self, d: int) -> int:
        """Draft tokens at depth d (1-based): branching multiplies them down to ``levels``, chains keep the count."""
        if self.branch == 1 or self.levels == 0:
            return 1
        return self.branch ** min(d, self.levels)

    @property
    def nodes(self) -> int:
        return sum(self.nodes_at(d) for d in range(1, self.depth + 1))

    def accepted(self, ranks: list[int], t: int) -> int:
        """Draft tokens accepted at position t: ``ranks[i]`` is y[i]'s rank among the draft's choices there."""
        n = 0
        while n < self.depth and t + n < len(ranks):
            allowed = self.branch if n < self.levels else 1
            if ranks[t + n] >= allowed:
                break
            n += 1
        return n


def ranks_of(model, ids: list[int], start: int, k: int) -> list[int]:
    """For each i >= start: the rank of ids[i] among the draft's top-k given ids[:i] (k where it is not among them)."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0, start - 1 : len(ids) - 1].float()
    top = logits.topk(k, dim=-1).indices  # [n, k]
    truth = torch.tensor(ids[start:])[:, None]
    hit = top == truth
    return torch.where(hit.any(-1), hit.float().argmax(-1), torch.tensor(k)).tolist()


def replay(shape: Shape, ranks: list[int]) -> tuple[int, int]:
    """Speculative decoding over one greedy output with this shape: (steps, tokens)."""
    t = steps = 0
    while t < len(ranks):
        t += shape.accepted(ranks, t) + 1
        steps += 1
    return steps, len(ranks)


def timed(fn, repeats: int = 3) -> float:
    fn()  # warm-up: a new shape's first call
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft-model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="int4")
    parser.add_argument("--draft-precision", default="auto")
    parser.add_argument("--workload", default="code,chat")
    parser.add_argument("--prompts", type=int, default=6, help="prompts a workload")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rows", default="1,4", help="rows a pass: each verifies a tree (or a chain) of its own")
    parser.add_argument("--eager", action="store_true", help="no compiled passes (chains run as trees do)")
    parser.add_argument("--decode-only", action="store_true", help="skip the replay: the engine's decoding only")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from depctl_runtime.backends.loader import load_deployment
    from depctl_runtime.speculation import GenerationParams
    from depctl_runtime.speculation.scheduler import generate

    rows_list = [int(r) for r in args.rows.split(",")]
    spec = DeploymentSpec(
        id="trees",
        model=args.model,
        compile=not args.eager,
        prefix_cache_bytes=0,
        dtype=args.dtype,
        quantization=args.quantization,
        max_batch_size=max(rows_list),
        speculation=DraftModelSpeculation(
            draft_model=args.draft_model, num_draft_tokens=4, draft_precision=args.draft_precision
        ),
    )
    loaded = load_deployment(spec)
    engine, tok = loaded.engine, loaded.tokenizer
    draft_model = loaded.draft.model
    shapes = [Shape(k) for k in (2, 3, 4, 6, 8)]
    shapes += [Shape(d, b, 1) for d in (1, 2, 3, 4, 6) for b in (2, 3, 4)]  # the trees the engine drafts

    # the greedy outputs and each output token's rank among the draft's choices
    ranks: dict[str, list[list[int]]] = {}
    prompts_by_workload: dict[str, list[list[int]]] = {}
    for workload in args.workload.split(","):
        prompts = [json.loads(line)["prompt"] for line in (prompts_dir() / f"{workload}.jsonl").open()]
        ranks[workload], prompts_by_workload[workload] = [], []
        for prompt in prompts[: args.prompts]:
            chat = [{"role": "user", "content": prompt}]
            text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            prompts_by_workload[workload].append(ids)
            if args.decode_only:
                continue
            params = GenerationParams(max_tokens=args.max_tokens, speculate=False)
            y = [t for o in generate(engine, ids, params) for t in o.token_ids]
            ranks[workload].append(ranks_of(draft_model, ids + y, len(ids), 4))
        print(f"# {workload}: {sum(map(len, ranks[workload]))} greedy tokens replayed", file=sys.stderr)

    results = [] if args.decode_only else replayed(engine, ranks, shapes, rows_list)
    decoded = decode(engine, prompts_by_workload, args.max_tokens)
    if args.json:
        args.json.write_text(json.dumps({"results": results, "decoded": decoded}, indent=1))


def replayed(engine, ranks: dict[str, list[list[int]]], shapes: list[Shape], rows_list: list[int]) -> list[dict]:
    """Each shape replayed over the greedy outputs and priced with passes timed here: a table per row count."""
    # pass costs: a verify pass over n tokens a row (r rows), a draft forward over n tokens a row, at a 256 context
    target, draft = engine.target, engine.draft_model.runner
    context = [(i * 7919) % 1000 for i in range(256)]

    def pass_cost(runner, rows: int, n: int, tree: tuple[int, ...] | None = None) -> float:
        def run():
            runner.score(0, [context[:n]] * rows, trees=None if tree is None else [tree] * rows).argmax()
            for r in range(rows):
                runner.set_length(r, len(context))

        for r in range(rows):
            runner.set_length(r, 0)
        runner.forward(0, [context] * rows, last_only=True)
        return timed(run)

    # a chain's pass as the engine runs it (compiled where the loader compiled), a tree's as it runs one (eagerly)
    verify = {}
    for r in rows_list:
        for shape in shapes:
            tree = None
            if shape.branch > 1:
                tree = (-1,) + tuple(p + 1 for p in DraftTree.grown_parents(shape.branch, shape.depth))
            verify[(r, shape)] = pass_cost(target, r, 1 + shape.nodes, tree)
        verify[(r, None)] = pass_cost(target, r, 1)
    drafting = {(r, n): pass_cost(draft, r, n) for r in rows_list for n in sorted({1, 2, 3, 4, 9, 16})}

    def draft_cost(rows: int, n: int) -> float:
        known = sorted(m for r, m in drafting if r == rows)
        above = next((m for m in known if m >= n), known[-1])
        return drafting[(rows, above)]  # the next measured width up: an upper bound

    results = []
    for rows in rows_list:
        plain = verify[(rows, None)] / rows  # seconds a token, plain decoding
        print(f"\n{rows} row(s) a pass: plain {rows / verify[(rows, None)]:.1f} tok/s")
        print("| workload | shape | nodes | mean accepted length | step, ms | tok/s vs plain |")
        print("|---|---|---:|---:|---:|---:|")
        for workload, outputs in ranks.items():
            for shape in shapes:
                steps = tokens = 0
                for r in outputs:
                    s, t = replay(shape, r)
                    steps, tokens = steps + s, tokens + t
                per_step = tokens / steps
                seconds = verify[(rows, shape)] + sum(
                    draft_cost(rows, shape.nodes_at(d - 1) if d > 1 else 1) for d in range(1, shape.depth + 1)
                )
                ratio = per_step * rows / seconds * plain
                results.append(
                    {
                        "rows": rows,
                        "workload": workload,
                        "shape": shape.name,
                        "nodes": shape.nodes,
                        "accepted_length": per_step,
                        "step_ms": seconds * 1000,
                        "vs_plain": ratio,
                    }
                )
                cells = [workload, shape.name, shape.nodes, f"{per_step:.2f}", f"{seconds * 1000:.0f}", f"{ratio:.2f}x"]
                print("| " + " | ".join(map(str, cells)) + " |")
    passes = ", ".join(f"{r} x {1 + s.nodes if s else 1}: {v * 1000:.1f}" for (r, s), v in verify.items())
    print("\nverify pass, ms (rows x tokens a row): " + passes)
    print("draft forward, ms (rows, tokens a row): " + ", ".join(f"{k}: {v * 1000:.1f}" for k, v in drafting.items()))
    for runner in (target, draft):  # empty rows, as the engine leaves them between requests
        for r in range(runner.max_rows):
            runner.set_length(r, 0)
    return results


def decode(engine, prompts: dict[str, list[list[int]]], max_tokens: int) -> list[dict]:
    """The engine itself, one request at a time: plain decoding, chains only, a tree of 2 branches wherever
    drafting pays, and the policy's own choice; each prompt through every mode before the next (drift hits all
    alike; no prefix cache, so each reads its prompt). Tokens a second over each workload, target passes, tree
    steps, and whether every output is plain decoding's."""
    from depctl_runtime.speculation import GenerationParams
    from depctl_runtime.speculation.scheduler import generate

    # (tree branches, the policy adaptive): "always" drafts K a step whatever it costs, to show a tree step's price
    modes = {
        "plain": (None, True),
        "chains, always": (1, False),
        "trees of 2, always": (2, False),
        "policy's choice": (0, True),
    }
    out = []
    print("\n| workload | mode | tok/s | vs plain | steps | trees drafted | exact |\n|---|---|---:|---:|---:|---:|---|")
    for workload, prompt_ids in prompts.items():
        seconds, tokens, steps, outputs, trees = {m: 0.0 for m in modes}, {m: 0 for m in modes}, {}, {}, {}
        for m in modes:
            steps[m], outputs[m], trees[m] = 0, [], 0
        for ids in prompt_ids:
            for mode, (branches, adaptive) in modes.items():
                engine.policy.tree_branches, engine.policy.adaptive = branches or 0, adaptive
                before = engine.stats.num_steps
                counted = _count_trees(engine)
                t0 = time.perf_counter()
                params = GenerationParams(max_tokens=max_tokens, speculate=branches is not None)
                got = [t for o in generate(engine, ids, params) for t in o.token_ids]
                seconds[mode] += time.perf_counter() - t0
                tokens[mode] += len(got)
                steps[mode] += engine.stats.num_steps - before
                trees[mode] += counted()
                outputs[mode].append(got)
        rate = {m: tokens[m] / seconds[m] for m in modes}
        for mode in modes:
            exact = outputs[mode] == outputs["plain"]
            row = [workload, mode, f"{rate[mode]:.1f}", f"{rate[mode] / rate['plain']:.2f}x", steps[mode]]
            print("| " + " | ".join(map(str, [*row, trees[mode], "yes" if exact else "NO"])) + " |")
            out.append({"workload": workload, "mode": mode, "tok_s": rate[mode], "steps": steps[mode], "exact": exact})
    return out


def _count_trees(engine):
    """Counts the tree steps the engine takes from now: call the result to read the count (and stop counting)."""
    original, seen = engine.draft_model.propose_tree, [0]

    def counting(*args, **kwargs):
        seen[0] += 1
        return original(*args, **kwargs)

    engine.draft_model.propose_tree = counting

    def read() -> int:
        engine.draft_model.propose_tree = original
        return seen[0]

    return read


if __name__ == "__main__":
    main()
