"""What a hostile user costs everyone else: a plain request's and a status read's latency, quiet and under attack.

    .venv/bin/python benchmarks/hostile.py                # tiny random model, 20 attackers, 20 probes each

One daemon (127.0.0.1, a temporary home) serves ``steady`` and ``nap`` (``--keep-alive 2s``). For each condition, a
probe sends a plain greedy chat request (8 tokens) to ``steady`` and a ``GET /depctl/v1/deployments``, one after the
other, ``--probes`` times, while the attack runs:

- quiet: nothing else;
- slow grammars: ``--attackers`` threads each send, back to back, a schema about as slow to compile as the size
  limit allows (2000 required properties with patterns; ~1.3 s to compile on 2 cores);
- idle burst: ``--attackers`` threads send requests to ``nap``, starting once its keep-alive has unloaded it, so the
  first of them wait for its load (a tiny model loads in well under a second: the wait is short here;
  tests/runtime/api/test_serving.py holds a load back to prove that waiting holds no thread).

Prints one table: median and worst latency per condition, and what the attackers got.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx

from depctl.spec import DeploymentSpec
from depctl.store import SpecStore
from tests.daemon_util import DaemonProcess
from tests.tiny import save_tiny

HI = [{"role": "user", "content": "hi"}]


def slow_schema() -> dict:
    props = {f"p{i}": {"type": "string", "pattern": "[a-z]{1,20}[0-9]{2,5}"} for i in range(2000)}
    return {"type": "object", "properties": props, "required": list(props)}


def probe(d: DaemonProcess, n: int) -> tuple[list[float], list[float]]:
    chat, status = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        r = d.post("/v1/chat/completions", {"model": "steady", "messages": HI, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        chat.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        assert d.get("/depctl/v1/deployments", timeout=120).status_code == 200
        status.append(time.perf_counter() - t0)
    return chat, status


def attack(stop: threading.Event, results: list, send) -> None:
    while not stop.is_set():
        try:
            r = send()
            results.append(f"{r.status_code} {r.json()['error']['code'] if r.status_code != 200 else 'ok'}")
        except httpx.HTTPError as exc:
            results.append(type(exc).__name__)


def run(d: DaemonProcess, name: str, attackers: int, probes: int, send=None, wait_idle=False) -> tuple:
    stop, results = threading.Event(), []
    threads = []
    if send is not None:
        if wait_idle:  # the burst needs nap IDLE: wait for its keep-alive
            while d.get("/depctl/v1/deployments/nap").json()["state"] != "IDLE":
                time.sleep(0.2)
        threads = [threading.Thread(target=attack, args=(stop, results, send)) for _ in range(attackers)]
        for t in threads:
            t.start()
        time.sleep(0.5)
    chat, status = probe(d, probes)
    stop.set()
    for t in threads:
        t.join(300)
    outcome = ", ".join(f"{results.count(r)} x {r}" for r in sorted(set(results))) or "-"
    return name, chat, status, outcome


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attackers", type=int, default=20)
    parser.add_argument("--probes", type=int, default=20)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="depctl-hostile-"))
    model = save_tiny(home / "tiny-model", seed=0, max_positions=1024)
    store = SpecStore(home / "deployments")
    store.create(DeploymentSpec(id="steady", model=str(model)))
    store.create(DeploymentSpec(id="nap", model=str(model), keep_alive=2.0))
    d = DaemonProcess(home).start()
    try:
        d.wait_state("steady")
        probe(d, 3)  # warm
        schema = {"messages": HI, "max_tokens": 4, "structured_outputs": {"json": slow_schema()}}
        nap = {"model": "nap", "messages": HI, "max_tokens": 4}
        rows = [
            run(d, "quiet", args.attackers, args.probes),
            run(
                d,
                f"{args.attackers} slow grammars compiling",
                args.attackers,
                args.probes,
                lambda: d.post("/v1/chat/completions", {"model": "steady", **schema}, timeout=300),
            ),
            run(
                d,
                f"{args.attackers} requests waiting for an idle load",
                args.attackers,
                args.probes,
                lambda: d.post("/v1/chat/completions", nap, timeout=300),
                wait_idle=True,
            ),
        ]
    finally:
        d.stop()
    quiet = statistics.median(rows[0][1])
    print(
        "\n| condition | plain request median / worst, s | ratio to quiet | status read median / worst, s | "
        "what the attackers got |\n|---|---|---|---|---|"
    )
    for name, chat, status, outcome in rows:
        print(
            f"| {name} | {statistics.median(chat):.3f} / {max(chat):.3f} | {statistics.median(chat) / quiet:.2f}x | "
            f"{statistics.median(status):.3f} / {max(status):.3f} | {outcome} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
