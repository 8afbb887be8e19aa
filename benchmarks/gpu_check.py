"""The GPU check's table: depctl's engine on random-weight models of real shapes, eager beside CUDA graphs.

``scripts/gpu_check.sh`` runs this on a GPU machine after the ``gpu`` tests. For each model shape it loads
deployments through the same loader a daemon uses (``load_deployment``) with the passes eager and with the passes
CUDA graphs, each plain, with n-gram speculation and with a draft model, and runs 1, 8 and 32 rows at once. Every
cell's greedy output is compared with plain decoding's on the same passes (speculation must change nothing), and
each model's plain output on the GPU with transformers' own greedy decoding of the same weights on the CPU in
float32.

Random weights give true step costs (a step's cost depends on shapes, not values) but no true acceptance: a draft
model of random weights is rejected, so its cells show what drafting costs, and the SmolLM2 shape drafts with itself
(every draft accepted: the most a draft can bring). The packaged models are too big to carry to such a machine.

    python benchmarks/gpu_check.py --out gpu_check.md                 # on a GPU: the full table (about 5 minutes)
    python benchmarks/gpu_check.py --device cpu --shapes tiny --rows 1,2 --tokens 8 --passes eager   # its logic, here
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.random_model import SHAPES, save_random

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # a log of tables, not of progress bars

DRAFTS = {  # the draft model each target shape is paired with
    "smollm2-135m-instruct": "smollm2-135m-instruct",  # itself: every draft accepted, the upper bound
    "qwen2.5-coder-1.5b-instruct": "qwen2.5-coder-0.5b-instruct",  # the packaged pair's shapes
    "tiny": "tiny",
}
METHODS = ("plain", "ngram", "draft")
K = 4


@dataclass
class Cell:
    shape: str
    passes: str  # "eager" | "graphs"
    method: str
    rows: int
    tok_s: float = 0.0
    drafted: int = 0  # draft tokens verified, over the timed run
    accepted: int = 0
    same_as_plain: str = ""
    note: str = ""


@dataclass
class Report:
    device: str
    cells: list[Cell] = field(default_factory=list)
    references: list[tuple[str, str]] = field(default_factory=list)  # (shape, the CPU comparison's result)
    loads: list[tuple[str, str, str, str]] = field(default_factory=list)  # (shape, passes, method, compiled status)


def prompts(rows: int, vocab: int) -> list[list[int]]:
    """Byte-level prompts with repeats in them, as chat and code have (what an n-gram proposer feeds on)."""
    texts = [
        f"def f{i}(x):\n    return x * {i} + f{i}(x - 1)\n# call f{i} with x = {i}, then f{i} again with x = "
        for i in range(rows)
    ]
    return [[b % vocab for b in text.encode()] for text in texts]


def spec_for(model_dir: Path, draft_dir: Path, method: str, graphs: bool, device: str, rows: int):
    from depctl.spec import DeploymentSpec, DraftModelSpeculation, NgramSpeculation, NoSpeculation

    speculation = {
        "plain": NoSpeculation(),
        "ngram": NgramSpeculation(ngram_length=3, num_draft_tokens=K),
        "draft": DraftModelSpeculation(draft_model=str(draft_dir), num_draft_tokens=K),
    }[method]
    return DeploymentSpec(
        id=f"check-{method}",
        model=str(model_dir),
        speculation=speculation,
        device=device,
        max_batch_size=rows,
        compile=graphs,
    )


def run_rows(engine, rows: int, tokens: int, vocab: int) -> tuple[list[list[int]], float, int, int]:
    """(each row's output, tok/s, draft tokens verified, of them accepted) for ``rows`` requests at once."""
    import torch

    from depctl_runtime.speculation import GenerationParams, Scheduler

    params = GenerationParams(max_tokens=tokens, ignore_eos=True)
    Scheduler(engine, rows).run_all(prompts(rows, vocab), GenerationParams(max_tokens=4, ignore_eos=True))  # warm
    drafts0, accepted0 = _counters(engine)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = Scheduler(engine, rows).run_all(prompts(rows, vocab), params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    drafted, accepted = (a - b for a, b in zip(_counters(engine), (drafts0, accepted0)))
    return outs, sum(map(len, outs)) / seconds, drafted, accepted


def _counters(engine) -> tuple[int, int]:
    return engine.stats.num_draft_tokens, engine.stats.num_accepted_tokens


NEAR_TIE = 1e-3  # float32 logits this close to the top one are a tie that the order of additions may break


def cpu_gaps(model_dir: Path, prompt: list[int], got: list[int]) -> list[float]:
    """Transformers' own float32 forward of the same weights on the CPU over ``prompt + got``: for each token depctl
    chose, how far its logit lies below that position's largest (0.0 where it is the argmax). Teacher-forced, so one
    broken tie does not turn every later position into a mismatch. Over the tokenizer's ids only: depctl never emits
    the embedding table's padding rows past them (the random shapes' tables are far larger than their tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    real = len(AutoTokenizer.from_pretrained(model_dir))
    with torch.no_grad():
        logits = model(torch.tensor([prompt + got])).logits[0, len(prompt) - 1 : -1, :real]
    chosen = logits.gather(1, torch.tensor(got)[:, None])[:, 0]
    return (logits.max(dim=1).values - chosen).tolist()


def judge(gaps: list[float]) -> str:
    worst = max(gaps, default=0.0)
    ties = sum(g > 0 for g in gaps)
    if worst == 0.0:
        return f"yes ({len(gaps)} tokens)"
    if worst <= NEAR_TIE:
        return f"yes, up to near ties: {ties} of {len(gaps)} tokens within {worst:.1e} of the top logit"
    first = next(i for i, g in enumerate(gaps) if g > NEAR_TIE)
    return f"NO: token {first} lies {gaps[first]:.3g} below the top logit ({ties} of {len(gaps)} off the argmax)"


def check_shape(shape: str, args, report: Report, work: Path, deadline: float) -> None:
    import torch

    from depctl_runtime.backends.loader import load_deployment

    target = save_random(SHAPES[shape], work / shape, seed=0)
    draft_shape = DRAFTS[shape]
    draft = target if draft_shape == shape else save_random(SHAPES[draft_shape], work / draft_shape, seed=1)
    vocab = SHAPES[shape]["vocab_size"]
    most = max(args.rows)
    plain_out: dict[str, dict[int, list[list[int]]]] = {}
    for passes in args.passes:
        for method in METHODS:
            if time.monotonic() > deadline:
                report.cells.append(Cell(shape, passes, method, 0, note="skipped: out of time"))
                continue
            spec = spec_for(target, draft, method, passes == "graphs", args.device, most)
            t0 = time.perf_counter()
            try:
                loaded = load_deployment(spec)
            except Exception as exc:  # a failed load is a finding, not the end of the check
                report.cells.append(Cell(shape, passes, method, 0, note=f"load failed: {exc}"[:200]))
                continue
            report.loads.append((shape, passes, method, f"{loaded.compiled} ({time.perf_counter() - t0:.0f}s)"))
            for rows in args.rows:
                cell = Cell(shape, passes, method, rows)
                try:
                    outs, cell.tok_s, cell.drafted, cell.accepted = run_rows(loaded.engine, rows, args.tokens, vocab)
                except Exception as exc:  # noqa: BLE001
                    cell.note = f"failed: {type(exc).__name__}: {exc}"[:200]
                    report.cells.append(cell)
                    continue
                if method == "plain":
                    plain_out.setdefault(passes, {})[rows] = outs
                    alone = plain_out[passes].get(1)
                    cell.same_as_plain = "reference" if rows == 1 else _same(outs[:1], alone)
                else:
                    cell.same_as_plain = _same(outs, plain_out.get(passes, {}).get(rows))
                report.cells.append(cell)
            loaded.release()
            del loaded
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    if args.cpu_tokens and time.monotonic() < deadline:
        report.references.append((shape, against_the_cpu(target, args.device, args.cpu_tokens, vocab)))


def against_the_cpu(model_dir: Path, device: str, tokens: int, vocab: int) -> str:
    """depctl's plain greedy decoding on ``device`` in float32 (eager, as the reference is) against transformers' on
    the CPU: the same weights and dtype, so only the order of additions differs between them."""
    from depctl.spec import DeploymentSpec
    from depctl_runtime.backends.loader import load_deployment
    from depctl_runtime.speculation import GenerationParams, generate

    spec = DeploymentSpec(id="check-cpu", model=str(model_dir), device=device, dtype="float32", compile=False)
    loaded = load_deployment(spec, calibrate=False)
    prompt = prompts(1, vocab)[0]
    params = GenerationParams(max_tokens=tokens, ignore_eos=True)
    got = [t for out in generate(loaded.engine, prompt, params) for t in out.token_ids]
    loaded.release()
    return judge(cpu_gaps(model_dir, prompt, got))


def _same(outs: list[list[int]] | None, reference: list[list[int]] | None) -> str:
    if reference is None or outs is None:
        return "no reference"
    pairs = list(zip(outs, reference))
    differ = sum(a != b for a, b in pairs)
    return "yes" if differ == 0 else f"NO: {differ} of {len(pairs)} rows differ"


def table(report: Report, args) -> str:
    plain = {(c.shape, c.rows): c.tok_s for c in report.cells if c.passes == "eager" and c.method == "plain"}
    lines = [
        f"### depctl on {report.device}: random weights, greedy, {args.tokens} tokens a row, K={K}",
        "",
        "| model shape | passes | method | rows | tok/s | vs eager plain | drafts accepted | output = plain | note |",
        "|---|---|---|---:|---:|---:|---:|---|---|",
    ]
    for c in report.cells:
        base = plain.get((c.shape, c.rows))
        ratio = f"{c.tok_s / base:.2f}x" if base and c.tok_s else ""
        tok_s = f"{c.tok_s:.1f}" if c.tok_s else ""
        lines.append(
            f"| {c.shape} | {c.passes} | {c.method} | {c.rows or ''} | {tok_s} | {ratio} | "
            f"{c.accepted}/{c.drafted} | {c.same_as_plain} | {c.note} |"
        )
    if report.references:
        lines += [
            "",
            "| model shape | float32 greedy tokens here = transformers' argmax on the CPU (teacher-forced)? |",
            "|---|---|",
        ]
        lines += [f"| {shape} | {result} |" for shape, result in report.references]
    lines += ["", "| model shape | passes | method | how the passes ran (load time) |", "|---|---|---|---|"]
    lines += [f"| {s} | {p} | {m} | {status} |" for s, p, m, status in report.loads]
    return "\n".join(lines) + "\n"


def describe_device(device: str) -> str:
    import torch
    import transformers

    if device == "cuda":
        name = torch.cuda.get_device_name(0)
    else:
        name = platform.processor() or platform.machine()
    return f"{name} (torch {torch.__version__}, transformers {transformers.__version__})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--shapes", default="smollm2-135m-instruct,qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--rows", default="1,8,32", help="requests at once, comma-separated")
    parser.add_argument("--tokens", type=int, default=64, help="output tokens a request")
    parser.add_argument("--passes", default="eager,graphs", help="eager, graphs or both")
    parser.add_argument(
        "--cpu-tokens", type=int, default=32, help="tokens compared with transformers on the CPU (0: no)"
    )
    parser.add_argument("--budget", type=float, default=330.0, help="seconds; cells past it are skipped and say so")
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    args.rows = [int(r) for r in args.rows.split(",")]
    args.passes = args.passes.split(",")
    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown or not set(args.passes) <= {"eager", "graphs"}:
        parser.error(f"unknown shape or passes: {unknown or args.passes}; shapes: {', '.join(sorted(SHAPES))}")

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run it on a GPU machine (or --device cpu to check the script)")
        return 0
    torch.manual_seed(0)
    report = Report(describe_device(args.device))
    deadline = time.monotonic() + args.budget
    with tempfile.TemporaryDirectory(prefix="depctl-gpu-check-") as tmp:
        for shape in shapes:
            check_shape(shape, args, report, Path(tmp), deadline)
    text = table(report, args)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    bad = [c for c in report.cells if c.same_as_plain.startswith("NO") or c.note.startswith(("failed", "load failed"))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
