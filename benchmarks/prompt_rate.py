"""Prompt tokens a second: depctl reading a prompt in its chunks, in process, beside ``llama-bench -p`` at the same
precision. Prints one table.

    .venv/bin/python benchmarks/prompt_rate.py                          # SmolLM2: float32, int8, int4
    .venv/bin/python benchmarks/prompt_rate.py --llama-bench $LLAMA/build/bin/llama-bench \\
        --gguf float32=smollm2-f32.gguf --gguf int8=smollm2-q8_0.gguf --gguf int4=smollm2-q4_k_m.gguf

depctl: the deployment loaded as the daemon loads it (compiled passes where they pay), the prompt read into one row
in the scheduler's 128-token chunks (``ModelRunner.prefill``), ``--runs`` times; the best and the median. llama.cpp:
``llama-bench -p N -n 0 -t THREADS -r 3`` (the prompt as one batch), its mean and spread. Run on a quiet machine: the
two are timed one after the other, never at once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

import torch

from depctl.spec import DeploymentSpec
from depctl_runtime.backends.loader import load_deployment
from depctl_runtime.speculation.scheduler import PREFILL_CHUNK


def depctl_rates(model: str, quantization: str, tokens: int, runs: int) -> tuple[list[float], str, str]:
    """Prompt tokens a second of each run, the products that computed them, and the precision."""
    spec = DeploymentSpec(id="rate", model=model, quantization=quantization, max_batch_size=1)
    loaded = load_deployment(spec, calibrate=False)
    runner = loaded.engine.target
    vocab = runner.vocab_size or 32000
    rates = []
    for run in range(runs + 1):  # the first run warms the caches and is not counted
        prompt = [(i * 7919 + run * 131) % (vocab - 200) + 100 for i in range(tokens)]
        runner.set_length(0, 0)
        start = time.perf_counter()
        with torch.inference_mode():
            for at in range(0, tokens, PREFILL_CHUNK):
                runner.prefill(0, prompt[at : at + PREFILL_CHUNK])
        if run:
            rates.append(tokens / (time.perf_counter() - start))
    runner.set_length(0, 0)
    products, precision = loaded.products, loaded.target.precision
    loaded.release()
    return rates, products, precision


def llama_bench(binary: str, gguf: str, tokens: int, threads: int) -> tuple[float, float]:
    """llama-bench's prompt tokens a second for ``gguf``: mean and standard deviation over its 3 runs."""
    out = subprocess.run(
        [binary, "-m", gguf, "-p", str(tokens), "-n", "0", "-t", str(threads), "-r", "3", "-o", "json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    result = json.loads(out)[0]
    return result["avg_ts"], result["stddev_ts"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--quantizations", default="none,int8,int4", help="depctl's, comma-separated")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--llama-bench", help="llama.cpp's llama-bench binary")
    parser.add_argument(
        "--gguf", action="append", default=[], help="QUANTIZATION=PATH: the GGUF llama-bench reads beside it"
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    ggufs = dict(item.split("=", 1) for item in args.gguf)
    ggufs = {("none" if q in ("float32", "f32") else q): path for q, path in ggufs.items()}

    print(f"{args.model}, a {args.tokens}-token prompt, {args.threads} threads")
    print("| precision | depctl, best | depctl, median | llama.cpp | depctl / llama.cpp (best) | depctl's products |")
    print("|---|---:|---:|---:|---:|---|")
    for quantization in args.quantizations.split(","):
        rates, products, precision = depctl_rates(args.model, quantization, args.tokens, args.runs)
        best, median = max(rates), statistics.median(rates)
        theirs, ratio = "", ""
        if args.llama_bench and quantization in ggufs:
            mean, spread = llama_bench(args.llama_bench, ggufs[quantization], args.tokens, args.threads)
            theirs, ratio = f"{mean:.0f} ± {spread:.0f}", f"{best / mean:.2f}x"
        print(f"| {precision} | {best:.0f} | {median:.0f} | {theirs} | {ratio} | {products} |")


if __name__ == "__main__":
    main()
