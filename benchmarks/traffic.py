"""Repeated and agentic traffic: plain decoding, n-gram and suffix speculation side by side, and predicted outputs
(simpler trackers against the re-aligning one) on an edit loop.

    .venv/bin/python benchmarks/traffic.py                       # SmolLM2, every workload, 1 and 8 clients
    .venv/bin/python benchmarks/traffic.py --workload edit-loop --concurrency 1
    .venv/bin/python benchmarks/traffic.py --workload chat,code --concurrency 1,8,16 --draft-head ./smol-head

Workloads (greedy, chat template applied, ``--max-tokens`` each):

- ``grounded-twice``: the grounded prompts (edits of code and text given in the prompt), then the same prompts again,
  as users re-ask and agents retry;
- ``multi-turn``: three-turn conversations whose later turns quote and rework the model's earlier answers; each
  script is run by two users, as an agent runs the same flow for different tickets;
- ``edit-loop``: a file revised by a chain of edit requests, each sending the current file in the prompt (and as the
  predicted output, in the rows that use predictions) and taking the answer as the next file (SmolLM2-135M rewrites
  the file once and then returns the same answer to every later edit: an agent loop that keeps retrying);
- ``predicted-edits``: the grounded prompts with OpenAI's predicted outputs, where the prediction is the answer
  with three small edits (two tokens replaced at a quarter of the way, three inserted at half, three deleted at
  three quarters): the client's expected file differs from what comes back in a few places. SmolLM2-135M does
  not make faithful edits of the prompts' code (it rewrites and comments), so the prediction is built from its
  own plain answer, fixed per prompt; the plain row runs first to get it. Rows compare the prediction tracker
  before and after re-alignment, alone and over n-gram lookup;
- ``chat``: open-ended chat, where nothing repeats: speculation must not cost anything here;
- ``code``: the code prompts (write a function, explain a snippet), open-ended too.

``--draft-head DIR`` adds a row for an EAGLE-3 head trained for the model (``depctl draft train``), at K=``--head-k``;
``--draft-model NAME`` one for a draft model (``--draft-precision``), at the same K, and both rows print the memory
their proposer holds beside the target (its weights and its caches, at the end of the run).

The "suffix" rows share one index across clients (``--suffix-scope deployment``); "suffix, scoped per user" gives
every client its own ``user`` (the default ``--suffix-scope user``), so a client drafts only from its own earlier
requests: in ``grounded-twice`` each repeat is sent by another user, in ``multi-turn`` each conversation is one.

Every configuration runs the same engine code in this process, through the scheduler (continuous batching), with
N clients in a closed loop: a client sends its next request when the previous one ends (a conversation or edit
chain stays with its client, so its turns stay in order). Every row gets a fresh engine over the same loaded target
and its calibration: plain rows are requests with speculation off, and each suffix row starts from an empty index,
so nothing is learned from another row.
Outputs are compared across configurations (they must be identical: greedy speculation is exact), then one table
per workload: tokens/s, the ratio to plain at the same concurrency, and acceptance. Every row runs ``--rounds``
times (3), the rows interleaved, and the table shows each row's median round: on a shared 2-core machine one
run's plain rate can move by a third from run to run.

The "before re-alignment" rows run depctl's earlier tracker (``LegacyTracker`` below, kept as the reference): after a
mismatch it looked up the last 4 generated tokens, falling back to 3, 2, then 1, in the prediction and drafted from
the first match at or after the furthest point reached, ahead of the deployment's proposer. The "stops at the first
mismatch" row (``FirstMismatchTracker``) is the simplest tracker, which never re-syncs; both are shown.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from depctl.spec import DeploymentSpec, DraftModelSpeculation, NgramSpeculation  # noqa: E402
from depctl.workloads import prompts_dir  # noqa: E402
from depctl_runtime.model.runner import held_bytes  # noqa: E402
from depctl_runtime.speculation import (
    EngineConfig,
    GenerationParams,
    NgramProposer,
    Scheduler,
    SpeculativeEngine,
    SuffixProposer,
    Tenant,
)  # noqa: E402
from depctl_runtime.speculation.eagle import EagleProposer  # noqa: E402
from depctl_runtime.speculation.proposers import PredictionTracker  # noqa: E402

PROMPTS = prompts_dir()

MULTI_TURN = [
    [
        "Explain in four sentences how a hash table works.",
        "Rewrite your previous answer as a bulleted list, keeping your wording.",
        "Repeat the second bullet exactly, then give a one-line example in Python.",
    ],
    [
        "Write a Python function that checks whether a string is a palindrome.",
        "Now add a docstring and type hints to that function, and return the whole function.",
        "Rename the function to `is_palindrome_text` and return the whole function again.",
    ],
    [
        "Give me a three-item checklist for reviewing a pull request.",
        "Expand each item of your checklist with one sentence of explanation, keeping the items as they are.",
        "Turn the expanded checklist into a Markdown table with columns Item and Why.",
    ],
    [
        "Describe the water cycle in three short paragraphs.",
        "Quote your first paragraph exactly, then summarise the other two in one sentence.",
        "Repeat your previous answer, but in the second person.",
    ],
]

EDIT_FILE = """def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for v in values:
        total += (v - m) ** 2
    return total / len(values)


def describe(values):
    return {"mean": mean(values), "variance": variance(values)}
"""

EDITS = [
    "Rename the parameter `values` to `samples` everywhere.",
    "Add a one-line docstring to each function.",
    "Make `variance` raise ValueError when the list is empty.",
    "Add a `count` key to the dictionary returned by `describe`.",
    "Rename the loop variable `v` to `x` in every function.",
    "Add type hints (list[float] and float) to every function.",
]


def edit_prompt(code: str, instruction: str) -> str:
    return f"{instruction} Return the whole file and nothing else.\n\n```python\n{code}```"


def strip_fence(text: str) -> str:
    """The next file: the answer's code block when it has one."""
    if "```" in text:
        body = text.split("```", 2)[1]
        return body.split("\n", 1)[1] if body.startswith("python") else body
    return text


@dataclass
class Request:
    messages: list[dict]
    prediction: str | None = None


# A client is a generator of requests: it receives each answer's text and yields the next request (or stops).
Client = Callable[[], Iterator[Request]]


def single(prompts: list[str]) -> list[Client]:
    def client(p):
        def run():
            yield Request([{"role": "user", "content": p}])

        return run

    return [client(p) for p in prompts]


def conversation(turns: list[str]) -> Client:
    def run():
        messages = []
        for turn in turns:
            messages.append({"role": "user", "content": turn})
            answer = yield Request(list(messages))
            messages.append({"role": "assistant", "content": answer})

    return run


def edit_chain() -> Client:
    def run():
        code = EDIT_FILE
        for instruction in EDITS:
            answer = yield Request([{"role": "user", "content": edit_prompt(code, instruction)}], prediction=code)
            code = strip_fence(answer) or code

    return run


def edited(tokens: list[int]) -> list[int]:
    """``tokens`` with three small edits: 2 replaced (at 1/4), 3 inserted (at 1/2), 3 deleted (at 3/4)."""
    n = len(tokens)
    if n < 16:
        return list(tokens)
    a, b, c = n // 4, n // 2, 3 * n // 4
    filler = tokens[:3]  # tokens from elsewhere in the text, so the edit is plausible text, not noise
    return tokens[:a] + filler[:2] + tokens[a + 2 : b] + filler + tokens[b:c] + tokens[c + 3 :]


def predicted(prompt: str, prediction: str) -> Client:
    def run():
        yield Request([{"role": "user", "content": prompt}], prediction=prediction)

    return run


def workload(name: str, concurrency: int = 1) -> list[Client]:
    if name == "grounded-twice":
        prompts = [json.loads(line)["prompt"] for line in (PROMPTS / "grounded.jsonl").read_text().splitlines()]
        return single(prompts + prompts)
    if name in ("chat", "code"):  # cycled to twice the clients, so every client stays busy (suffix rows see repeats)
        prompts = [json.loads(line)["prompt"] for line in (PROMPTS / f"{name}.jsonl").read_text().splitlines()]
        return single([prompts[i % len(prompts)] for i in range(max(len(prompts), 2 * concurrency))])
    if name == "multi-turn":
        return [conversation(script) for script in MULTI_TURN for _ in range(2)]
    if name == "edit-loop":
        return [edit_chain()]
    if name == "predicted-edits":  # the plain pass (predictions not used); see predicted_edits for the rest
        return single([json.loads(line)["prompt"] for line in (PROMPTS / "grounded.jsonl").read_text().splitlines()])
    raise SystemExit(f"unknown workload {name!r}")


@dataclass
class Result:
    tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    outputs: list = field(default_factory=list)
    by_client: dict = field(default_factory=dict)  # client -> its last answer's tokens

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def run(
    engine,
    tokenizer,
    clients: list[Client],
    concurrency: int,
    max_tokens: int,
    speculate: bool,
    use_prediction: bool = True,
    per_client_tenant: bool = False,
) -> Result:
    """Clients in a closed loop over one scheduler: at most ``concurrency`` run at once, each sending its next
    request when its previous one ends. Every answer is fed back to its client (multi-turn, edit chains)."""
    scheduler = Scheduler(engine, max_batch_size=concurrency)
    pending = list(range(len(clients)))
    gens: dict[int, Iterator[Request]] = {}
    active: dict[int, tuple] = {}  # seq id -> (client, seq, tokens)
    result = Result()

    def submit(c: int, request: Request | None) -> None:
        if request is None:
            return
        text = tokenizer.apply_chat_template(request.messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        prediction = ()
        if request.prediction and use_prediction:
            prediction = tuple(tokenizer(request.prediction, add_special_tokens=False)["input_ids"])
        tenant = Tenant(user=f"client-{c}") if per_client_tenant else Tenant()
        params = GenerationParams(max_tokens=max_tokens, speculate=speculate, prediction=prediction, tenant=tenant)
        seq = engine.new_sequence(ids, params)
        active[seq.id] = (c, seq, [])
        scheduler.add(seq)

    def start_next() -> None:
        while pending and len(active) < concurrency:
            c = pending.pop(0)
            gens[c] = clients[c]()
            submit(c, next(gens[c], None))

    t0 = time.perf_counter()
    start_next()
    while scheduler.has_work():
        for seq, out in scheduler.step():
            c, _, tokens = active[seq.id]
            tokens += out.token_ids
            result.drafted += out.drafted
            result.accepted += out.accepted
            if out.finish_reason:
                del active[seq.id]
                result.tokens += len(tokens)
                result.outputs.append(tokens)
                result.by_client[c] = tokens
                answer = tokenizer.decode(tokens, skip_special_tokens=True)
                try:
                    submit(c, gens[c].send(answer))
                except StopIteration:
                    start_next()
    result.seconds = time.perf_counter() - t0
    return result


class FirstMismatchTracker(PredictionTracker):
    """A prediction that stops helping at its first mismatch (the baseline for re-alignment)."""

    def propose(self, generated, k):
        start = self.expected
        return start, (self.prediction[start : start + k] if k > 0 and start >= 0 else [])

    def observe(self, start, accepted, next_token):
        pos = start + accepted if start >= 0 else -1
        if 0 <= pos < len(self.prediction) and self.prediction[pos] == next_token:
            self.expected = pos + 1
            self.matched += accepted + 1
            return accepted + 1
        self.expected = -1
        self.matched += accepted
        return accepted


class LegacyTracker(PredictionTracker):
    """The earlier predicted-output tracker: an n-gram lookup past the furthest point reached (the reference for the
    re-alignment rows)."""

    NGRAM = 4

    def __init__(self, prediction):
        super().__init__(prediction)
        self.last = 0

    following = True  # its guesses drafted ahead of the deployment's proposer, on the prediction or off it

    def propose(self, generated, k):
        start = self.expected
        if start < 0 or start >= len(self.prediction):
            start = self._lookup(generated) if generated else -1
        return start, (self.prediction[start : start + k] if k > 0 and start >= 0 else [])

    def _lookup(self, generated) -> int:
        length, reference = len(generated), self.prediction
        for size in range(min(self.NGRAM, length), 0, -1):
            suffix = list(generated[length - size :])
            ends = [i + size for i in range(len(reference) - size) if list(reference[i : i + size]) == suffix]
            if ends:
                later = [e for e in ends if e >= self.last]
                return later[0] if later else ends[-1]
        return -1

    def observe(self, start, accepted, next_token):
        pos = start + accepted if start >= 0 else -1
        if 0 <= pos < len(self.prediction) and self.prediction[pos] == next_token:
            self.expected = pos + 1
            self.last = max(self.last, self.expected)
            self.matched += accepted + 1
            return accepted + 1
        self.expected = -1
        self.matched += accepted
        return accepted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="none", help="the deployment's --quantization (none or int8)")
    parser.add_argument("--workload", default="grounded-twice,multi-turn,edit-loop,predicted-edits,chat")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=8, help="--draft-token-count for n-gram and suffix")
    parser.add_argument("--ngram", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="runs of every row, interleaved; the median is shown")
    parser.add_argument(
        "--draft-head",
        default=None,
        metavar="DIR",
        help="an EAGLE-3 head for the model (depctl draft train): its rows join every workload's table",
    )
    parser.add_argument("--head-k", type=int, default=4, help="--draft-token-count for the head or draft model")
    parser.add_argument(
        "--draft-model", default=None, metavar="NAME", help="a draft model for the model: its row joins every table"
    )
    parser.add_argument("--draft-precision", default="auto", help="the draft model's --draft-precision")
    parser.add_argument(
        "--methods",
        default="plain,ngram,suffix,suffix-user,head,draft",
        help="the rows of the chat, code, grounded-twice and multi-turn tables (plain always runs: the baseline)",
    )
    args = parser.parse_args()
    if args.draft_head and args.draft_model:
        raise SystemExit("--draft-head and --draft-model: give one (each loads the model with its own passes)")

    from depctl_runtime.backends.loader import load_deployment

    rows = max(int(c) for c in args.concurrency.split(","))
    spec = DeploymentSpec(
        id="traffic",
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        max_batch_size=rows,
        speculation=NgramSpeculation(ngram_length=args.ngram, num_draft_tokens=args.k),
    )
    if args.draft_head or args.draft_model:  # with a head, the target's passes return its layers for every row
        model = DraftModelSpeculation(
            draft_model=args.draft_head or args.draft_model,
            num_draft_tokens=args.head_k,
            draft_precision=args.draft_precision,
        )
        spec = spec.model_copy(update={"speculation": model})
    loaded = load_deployment(spec)
    ngram_engine, tok = loaded.engine, loaded.tokenizer
    head = getattr(ngram_engine.proposer, "head", None)
    draft = ngram_engine.draft_model if head is None else None  # reused by every draft row: runs release its rows

    def fresh(proposer, tracker=PredictionTracker) -> SpeculativeEngine:
        """An engine over the same target (and its calibration) with another proposer: a new suffix index."""
        k = args.head_k if proposer is not None and hasattr(proposer, "accepted") else args.k
        config = EngineConfig(**{**vars(ngram_engine.config), "num_draft_tokens": k})
        e = SpeculativeEngine(ngram_engine.target, proposer, config, tracker)
        e.policy.verify_cost.samples = dict(ngram_engine.policy.verify_cost.samples)
        e.policy.draft_cost.samples = dict(ngram_engine.policy.draft_cost.samples)  # the head's, where one is loaded
        return e

    print(
        f"# {args.model} ({loaded.target.precision}), greedy, {args.max_tokens} tokens a request, K={args.k}, "
        f"n-gram n={args.ngram}",
        file=sys.stderr,
    )
    tables, model_proposers = [], {}
    ngram_label = f"n-gram (n={args.ngram})"
    for name in args.workload.split(","):
        for c in (int(x) for x in args.concurrency.split(",")):
            if name in ("edit-loop", "predicted-edits") and c > 1:
                continue  # one chain (each request waits for the previous answer); predictions are measured alone
            # (label, proposer: "ngram" | "suffix" | None, speculate, prediction: None | "first" | "legacy" | "realign")
            configs = [
                ("plain", "ngram", False, None),
                (ngram_label, "ngram", True, None),
                ("suffix", "suffix", True, None),
                ("suffix, scoped per user", "suffix-user", True, None),
            ]
            if head is not None:
                configs.append((f"EAGLE head (K={args.head_k})", "head", True, None))
            if draft is not None:
                label = f"draft {args.draft_model} ({loaded.draft.precision}, K={args.head_k})"
                configs.append((label, "draft", True, None))
            wanted = set(args.methods.split(",")) | {"plain"}
            configs = [c for c in configs if (c[1] if c[2] else "plain") in wanted or c[3] is not None]
            if name == "predicted-edits":
                configs = [
                    ("plain", "ngram", False, None),
                    ("prediction, stops at the first mismatch", None, True, "first"),
                    ("prediction, before re-alignment", None, True, "legacy"),
                    ("prediction, re-aligning", None, True, "realign"),
                    (ngram_label, "ngram", True, None),
                    (f"{ngram_label} + prediction, before re-alignment", "ngram", True, "legacy"),
                    (f"{ngram_label} + prediction, re-aligning", "ngram", True, "realign"),
                    ("suffix + prediction, re-aligning", "suffix", True, "realign"),
                ]
            if name == "edit-loop":  # each request sends the file it edits as the prediction: rows that use it
                configs += [
                    ("prediction, stops at the first mismatch", None, True, "first"),
                    ("prediction, before re-alignment", None, True, "legacy"),
                    ("prediction, re-aligning", None, True, "realign"),
                    (f"{ngram_label} + prediction, before re-alignment", "ngram", True, "legacy"),
                    (f"{ngram_label} + prediction, re-aligning", "ngram", True, "realign"),
                    ("suffix + prediction, re-aligning", "suffix", True, "realign"),
                ]
            clients = workload(name, c)
            trackers = {"first": FirstMismatchTracker, "legacy": LegacyTracker}
            runs: dict[str, list[Result]] = {label: [] for label, *_ in configs}
            for _ in range(args.rounds):  # rounds interleave the rows, so a slow minute hits all of them alike
                for label, proposer, speculate, prediction in configs:
                    # a fresh engine for every row (the same target and calibration): no row inherits another's
                    # learned acceptance, and each suffix row starts from an empty index
                    engine = fresh(
                        {
                            "ngram": lambda: NgramProposer(args.ngram),
                            "suffix": lambda: SuffixProposer(1 << 20, "deployment"),
                            "suffix-user": lambda: SuffixProposer(1 << 20, "user"),
                            "head": lambda: EagleProposer(head, rows, ngram_engine.target.vocab_size),
                            "draft": lambda: draft,
                            None: lambda: None,
                        }[proposer](),
                        trackers.get(prediction, PredictionTracker),
                    )
                    if engine.draft_model is not None:  # its caches as the last run left them, for the memory line
                        model_proposers[proposer] = engine.draft_model
                    r = run(
                        engine,
                        tok,
                        clients,
                        c,
                        args.max_tokens,
                        speculate=speculate,
                        use_prediction=prediction is not None,
                        per_client_tenant=proposer == "suffix-user",
                    )
                    if name == "predicted-edits" and label == "plain" and not runs[label]:
                        # the first plain pass: the predictions are its answers, edited
                        prompts = [
                            json.loads(line)["prompt"] for line in (PROMPTS / "grounded.jsonl").read_text().splitlines()
                        ]
                        clients = [
                            predicted(p, tok.decode(edited(r.by_client[i]), skip_special_tokens=True))
                            for i, p in enumerate(prompts)
                        ]
                    runs[label].append(r)
                    print(f"  [{name} c={c} {label}] {r.rate:.1f} tok/s", file=sys.stderr)
            base_outputs = sorted(map(tuple, runs["plain"][0].outputs))
            same = all(sorted(map(tuple, r.outputs)) == base_outputs for rs in runs.values() for r in rs)
            # each row's median round by tokens/s (its acceptance is that round's)
            results = [(label, sorted(rs, key=lambda r: r.rate)[len(rs) // 2]) for label, rs in runs.items()]
            base = results[0][1]
            lines = [
                f"### {name}, {c} client{'s' if c > 1 else ''}"
                + ("" if same else "  (OUTPUTS DIFFER ACROSS CONFIGURATIONS)"),
                "",
                "| configuration | tok/s | vs plain | acceptance | tokens |",
                "|---|---|---|---|---|",
            ]
            for label, r in results:
                acc = f"{r.accepted / r.drafted:.0%} of {r.drafted}" if r.drafted else "-"
                lines.append(f"| {label} | {r.rate:.1f} | {r.rate / base.rate:.2f}x | {acc} | {r.tokens} |")
            tables.append("\n".join(lines))
            print(tables[-1] + "\n", flush=True)
    if model_proposers:
        target = held_bytes(ngram_engine.target)
        for what, proposer in model_proposers.items():
            extra = held_bytes(ngram_engine.target, proposer) - target
            print(f"memory: the target {target / 2**20:.0f} MiB; {what}: {extra / 2**20:.0f} MiB more (weights, cache)")


if __name__ == "__main__":
    main()
