"""One deployment's decode speed with and without a second, idle deployment in the same daemon.

    .venv/bin/python benchmarks/multi_deployment.py                     # SmolLM2, --dtype auto, 3 rounds
    .venv/bin/python benchmarks/multi_deployment.py --dtype float32 --rounds 5

Why: every deployment loads on a thread of its own, and torch's CPU kernels run on one OpenMP pool per thread; a
live idle pool beside the working one can leave a core half idle, so the daemon steps every deployment on one engine
thread (runtime/backends/worker.py, EngineHost). This checks it: for each round it starts a daemon with one
deployment, then one with two (the second serves one request first, then sits idle), and times one streamed-off
128-token greedy chat request to the first, plain decoding; it also records how much CPU the daemon's two busiest
threads used during it (both near the wall time: both cores worked). One table, medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from depctl import models  # noqa: E402
from depctl.spec import DeploymentSpec  # noqa: E402
from depctl.store import SpecStore  # noqa: E402


def measure(model: str, dtype: str, deployments: int, max_tokens: int) -> tuple[float, float, float]:
    """(tok/s, wall seconds, CPU seconds of the two busiest threads) for one request to deployment d0."""
    import httpx
    import psutil

    home = Path(tempfile.mkdtemp(prefix="depctl-multi-"))
    store = SpecStore(home / "deployments")
    for i in range(deployments):
        store.create(DeploymentSpec(id=f"d{i}", model=model, dtype=dtype))
    env = {**os.environ, "DEPCTL_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "depctl_runtime", "--port", "0", "--log-level", "warning"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = _wait_ready(home, proc, deployments)
        body = {
            "messages": [{"role": "user", "content": "Tell me a long story about a dragon."}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "speculate": False,
        }
        for i in range(deployments):  # every deployment has run torch work once; then the others sit idle
            httpx.post(f"{url}/v1/chat/completions", json={**body, "model": f"d{i}"}, timeout=600)
        threads = psutil.Process(proc.pid)
        before = {t.id: t.user_time + t.system_time for t in threads.threads()}
        t0 = time.perf_counter()
        r = httpx.post(f"{url}/v1/chat/completions", json={**body, "model": "d0"}, timeout=600).json()
        wall = time.perf_counter() - t0
        after = {t.id: t.user_time + t.system_time for t in threads.threads()}
        busiest = sorted((after[k] - before.get(k, 0.0) for k in after), reverse=True)[:2]
        return r["usage"]["completion_tokens"] / wall, wall, sum(busiest)
    finally:
        proc.terminate()
        proc.wait(60)


def _wait_ready(home: Path, proc, deployments: int) -> str:
    import httpx

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the daemon exited")
        try:
            info = json.loads((home / "daemon.json").read_text())
            url = f"http://127.0.0.1:{info['port']}"
            states = [
                httpx.get(f"{url}/depctl/v1/deployments/d{i}", timeout=5).json().get("state")
                for i in range(deployments)
            ]
            if all(s == "READY" for s in states):
                return url
        except (OSError, ValueError, KeyError, httpx.HTTPError):
            pass
        time.sleep(0.5)
    raise RuntimeError("the deployments did not become READY")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    results: dict[int, list] = {1: [], 2: []}
    for r in range(args.rounds):
        for n in (1, 2):
            results[n].append(measure(args.model, args.dtype, n, args.max_tokens))
            print(f"  round {r + 1}, {n} deployment(s): {results[n][-1][0]:.1f} tok/s", file=sys.stderr)
    print(
        f"\n### {args.model} ({args.dtype}), one {args.max_tokens}-token greedy chat request to d0, plain, "
        f"{args.rounds} rounds (medians)\n"
    )
    print("| deployments in the daemon | tok/s | CPU of the two busiest threads / wall | vs alone |")
    print("|---|---|---|---|")
    alone = statistics.median(x[0] for x in results[1])
    for n in (1, 2):
        rate = statistics.median(x[0] for x in results[n])
        busy = statistics.median(x[2] / x[1] for x in results[n])
        print(f"| {n}{' (the second idle)' if n == 2 else ''} | {rate:.1f} | {busy:.2f} cores | {rate / alone:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
