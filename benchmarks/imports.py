"""What starting costs: `depctl --help`, a daemon up to its first `/health`, and importing the seams, in wall time
(median of --repeat runs), with the heavy modules each one loaded (python -X importtime's view, summed up).

    .venv/bin/python benchmarks/imports.py                        # this tree
    .venv/bin/python benchmarks/imports.py --tree /path/to/other  # another checkout's code, same interpreter

With --tree, that checkout's `depctl` and `runtime/` (as depctl_runtime) are imported instead of this one's, so two
revisions can be compared in one run on one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "numpy", "llguidance", "fastapi")
PROBES = {
    "import depctl_runtime.backends.base": "import depctl_runtime.backends.base",
    "import depctl_runtime.api.protocol": "import depctl_runtime.api.protocol",
    "import depctl_runtime.app (the daemon's code)": "import depctl_runtime.app",
}


def environment(tree: Path | None, home: Path) -> dict:
    env = {**os.environ, "DEPCTL_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    if tree is not None:  # that checkout's packages first on the path, under their installed names
        shim = Path(tempfile.mkdtemp(prefix="depctl-tree-"))
        (shim / "depctl").symlink_to(tree / "depctl")
        (shim / "depctl_runtime").symlink_to(tree / "runtime")
        env["PYTHONPATH"] = str(shim)
    return env


def timed(argv: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, env=env, cwd=tempfile.gettempdir(), capture_output=True, check=True, timeout=300)
    return time.perf_counter() - t0


def loaded(statement: str, env: dict) -> str:
    probe = f"import sys; {statement}; print(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tempfile.gettempdir(), capture_output=True)
    return done.stdout.decode().strip() or "-"


def daemon_start(env: dict, home: Path) -> float:
    """Seconds from spawning `python -m depctl_runtime` (no deployments) to its first /health answer."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "depctl_runtime", "--port", str(port)],
        env=env,
        cwd=tempfile.gettempdir(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.perf_counter() - t0 > 120:
                raise RuntimeError("the daemon did not answer /health")
            time.sleep(0.01)
    finally:
        proc.terminate()
        proc.wait(30)
        (home / "daemon.json").unlink(missing_ok=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, action="append", help="a checkout to measure (repeatable); default: this")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    trees = args.tree or [None]
    rows = []
    for tree in trees:
        name = str(tree) if tree else "this tree"
        with tempfile.TemporaryDirectory(prefix="depctl-imports-") as tmp:
            home = Path(tmp)
            env = environment(tree.resolve() if tree else None, home)
            cells = {"depctl --help": [sys.executable, "-m", "depctl", "--help"]}
            cells |= {label: [sys.executable, "-c", stmt] for label, stmt in PROBES.items()}
            for label, argv in cells.items():
                seconds = statistics.median(timed(argv, env) for _ in range(args.repeat))
                heavy = loaded(PROBES.get(label, "import depctl.cli"), env)
                rows.append((name, label, seconds, heavy))
            seconds = statistics.median(daemon_start(env, home) for _ in range(args.repeat))
            rows.append((name, "daemon start to /health (no deployments)", seconds, "as the daemon's code"))
    print(f"| tree | what | seconds (median of {args.repeat}) | heavy modules loaded |")
    print("|---|---|---:|---|")
    for name, label, seconds, heavy in rows:
        print(f"| {name} | {label} | {seconds:.2f} | {heavy} |")
    if args.json:
        args.json.write_text(json.dumps([dict(zip(("tree", "what", "seconds", "heavy"), r)) for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
