"""What one target pass costs, eager and through the compiled library, for the shapes a step takes.

    .venv/bin/python benchmarks/passes.py                                  # SmolLM2, int8 weights and float32
    .venv/bin/python benchmarks/passes.py --precision float32 --shapes 1x1,1x9 --context 200
    .venv/bin/python benchmarks/passes.py --precision bfloat16 --bf16-kernels   # AMX against vdpbf16ps, where AMX is
    .venv/bin/python benchmarks/passes.py --device cuda --precision bfloat16 --model qwen2.5-coder-1.5b-instruct
    .venv/bin/python benchmarks/passes.py --precision bfloat16,float32 --weight-prefetch   # prefetch on against off

A pass is ``rows x tokens``: 1x1 a plain step of one request, 1x9 a verify pass of 8 drafts, 8x1 a plain step of a
batch of 8, 8x5 that batch verifying 4 drafts a row. Each precision loads the deployment as the daemon would (the
loader's surgery, fused forward, its compile where it compiles), then times every shape with the compiled library
attached and detached, the two interleaved run by run so a slow minute on a shared machine hits both; the table
shows medians. The eager column is what a deployment with ``--no-compile`` runs. ``--weight-prefetch`` adds the
compiled passes with the vector loops' software prefetch of the weights on and off, interleaved the same way (the
products choose it by CPU vendor: ``blocked_weight_prefetch``). On CUDA the compiled column is
the CUDA graphs' pass (``depctl_runtime.model.graphs``), whose one shape is the widest rows x tokens asked for.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from depctl.spec import DeploymentSpec, NgramSpeculation, NoSpeculation  # noqa: E402


def time_pass(runner, rows: int, tokens: int, context: int) -> float:
    """Seconds for one pass of ``rows`` x ``tokens`` at ``context`` cached positions a row, as a greedy step takes it
    (every token's choice to the host; through a float32 target's bf16 screen where it has one)."""
    for r in range(rows):
        runner.set_length(r, context)
    ids = [[(r * 31 + j * 7) % 1000 + 1 for j in range(tokens)] for r in range(rows)]
    t0 = time.perf_counter()
    runner.score(0, ids).argmax()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument(
        "--precision",
        default="int8,float32",
        help="comma-separated: int8 or int4 (weights; float activations), float32, bfloat16",
    )
    parser.add_argument("--shapes", default="1x1,1x9,8x1,8x5", help="rows x tokens, comma-separated")
    parser.add_argument("--context", type=int, default=40, help="cached positions per row before the pass")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (the compiled column: CUDA graphs)")
    parser.add_argument(
        "--bf16-kernels",
        action="store_true",
        help="bfloat16 on a CPU with AMX: time the compiled passes with the AMX product and with the "
        "vdpbf16ps loops, interleaved (a second table)",
    )
    parser.add_argument(
        "--weight-prefetch",
        action="store_true",
        help="time the compiled passes with the vector loops' weight prefetch on and off, interleaved (a table)",
    )
    args = parser.parse_args()

    from depctl_runtime.backends.loader import load_deployment
    from depctl_runtime.model.compiled import CompiledPass

    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows = max(r for r, _ in shapes)
    widest = max(t for _, t in shapes)  # a GPU's graphs take every pass at rows x widest (1 + the drafts)
    speculation = NgramSpeculation(ngram_length=3, num_draft_tokens=widest - 1) if widest > 1 else NoSpeculation()
    lines = [
        f"SmolLM2-class passes: {args.model}, context {args.context}, median of {args.runs} interleaved runs, "
        f"ms, {torch.get_num_threads()} threads",
        "",
        "| precision | pass (rows x tokens) | eager | compiled | eager / compiled |",
        "|---|---|---|---|---|",
    ]
    kernel_lines: list[str] = []
    prefetch_lines: list[str] = []
    if args.weight_prefetch:
        from depctl_runtime.kernels import native

        native.load()
    ops = torch.ops.depctl_native
    chosen_prefetch = ops.blocked_weight_prefetch(-1) if args.weight_prefetch else None
    for precision in args.precision.split(","):
        quantization = precision if precision in ("int8", "int4") else "none"
        dtype = "auto" if quantization != "none" else precision
        spec = DeploymentSpec(
            id="passes",
            model=args.model,
            dtype=dtype,
            quantization=quantization,
            max_batch_size=rows,
            device=args.device,
            speculation=speculation,
        )
        loaded = load_deployment(spec, calibrate=False)
        runner = loaded.engine.target
        fast = runner.fast_pass
        print(f"# {precision}: compiled {loaded.compiled}", file=sys.stderr)
        for r in range(rows):  # every row holds ``context`` positions; each pass is then rolled back to them
            runner.forward(r, [[(r * 13 + j) % 1000 + 1 for j in range(args.context)]], last_only=True, prefill=True)
        # mode -> (runner, AMX refused, weight prefetch: None as chosen)
        modes = {"eager": (runner.with_pass(None), False, chosen_prefetch)}
        if fast is not None:
            modes["compiled"] = (runner, False, chosen_prefetch)
        kernels = (
            args.bf16_kernels
            and precision == "bfloat16"
            and isinstance(fast, CompiledPass)
            and torch.ops.depctl_native.blocked_kernel(torch.bfloat16) == "amx-bf16"
        )
        if kernels:  # the same library; the op takes the vdpbf16ps loops while AMX is refused
            modes["vdpbf16ps"] = (runner, True, chosen_prefetch)
        if args.weight_prefetch and fast is not None:
            modes["prefetch on"] = (runner, False, True)
            modes["prefetch off"] = (runner, False, False)
        for r, t in shapes:
            times: dict[str, list[float]] = {m: [] for m in modes}
            for i in range(args.runs + 2):
                for mode, (mode_runner, refuse_amx, prefetch) in modes.items():
                    if kernels:
                        ops.blocked_refuse_amx(refuse_amx)
                    if prefetch is not None:
                        ops.blocked_weight_prefetch(int(prefetch))
                    seconds = time_pass(mode_runner, r, t, args.context)
                    if i >= 2:  # two warm-up runs of a new shape
                        times[mode].append(seconds)
            med = {m: statistics.median(v) * 1000 for m, v in times.items()}
            comp = med.get("compiled")
            lines.append(
                f"| {precision} | {r} x {t} | {med['eager']:.2f} | "
                + (f"{comp:.2f} | {med['eager'] / comp:.2f}x |" if comp else "- | - |")
            )
            print(lines[-1], file=sys.stderr, flush=True)
            if kernels:
                dot = med["vdpbf16ps"]
                kernel_lines.append(f"| {r} x {t} | {comp:.2f} | {dot:.2f} | {dot / comp:.2f}x |")
            if "prefetch on" in med:
                on, off = med["prefetch on"], med["prefetch off"]
                prefetch_lines.append(f"| {precision} | {r} x {t} | {on:.2f} | {off:.2f} | {on / off:.2f}x |")
        if kernels:
            ops.blocked_refuse_amx(False)
        if args.weight_prefetch:
            ops.blocked_weight_prefetch(int(chosen_prefetch))
        for r in range(rows):
            runner.set_length(r, 0)
        del loaded, runner, fast, modes
    if kernel_lines:
        lines += [
            "",
            "bfloat16 compiled passes by product kernel (the eager column above is AMX's):",
            "",
            "| pass (rows x tokens) | AMX tiles | vdpbf16ps loops | vdpbf16ps / AMX |",
            "|---|---|---|---|",
            *kernel_lines,
        ]
    if prefetch_lines:
        lines += [
            "",
            f"Compiled passes with the vector loops' weight prefetch on and off (this CPU's choice: "
            f"{'on' if chosen_prefetch else 'off'}):",
            "",
            "| precision | pass (rows x tokens) | prefetch on | prefetch off | on / off |",
            "|---|---|---|---|---|",
            *prefetch_lines,
        ]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
