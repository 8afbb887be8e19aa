"""Load benchmark: the daemon over HTTP, with the ``openai`` client, at several concurrencies, speculation off and
on, through one deployment (a request can ask to decode plainly, so both modes use the same engine).

    .venv/bin/python benchmarks/load.py                                    # SmolLM2, chat + grounded, 1..16 clients
    .venv/bin/python benchmarks/load.py --workload chat --concurrency 1,8 --max-tokens 64
    .venv/bin/python benchmarks/load.py --workload code --concurrency 8,32 --repeat 4 --control   # the noise floor
    .venv/bin/python benchmarks/load.py --concurrency 1,8 --quantization int8 \
        --llama-server $LLAMA/build/bin/llama-server --gguf F32=smol-f32.gguf --gguf Q8_0=smol-q8_0.gguf
    .venv/bin/python benchmarks/load.py --model qwen2.5-coder-1.5b-instruct --device cuda --workload code \
        --concurrency 1,8 --draft-model qwen2.5-coder-0.5b-instruct --k 4 --depctl auto --depctl auto+eager   # a GPU

Peers (``--llama-server`` with ``--gguf``, ``--vllm-python``: a llama.cpp server build and a vLLM CPU install)
go through the same client code, prompts and settings; their n-gram rows come from their own prompt-lookup
speculation (llama.cpp ``ngram-simple``, vLLM ``ngram``) with the same n and K. Every server is started first and the
cells go round them, level by level, the order rotating (an idle server takes no CPU): a slow minute on a shared
machine then hits every server alike, where one server after another put minutes of drift into the ratios.
``--sequential`` runs one server at a time (less memory).

Each concurrency level runs N clients in a closed loop (a client sends its next request when the previous one
ends) over the workload's prompts, streaming, greedy, chat template applied by the server. One table per workload:
aggregate tokens/s, per-request decode tokens/s (median), time to first token (median, p95), acceptance, and the
ratio to plain decoding at the same concurrency, over the whole cell and over the time every client had a request in
flight (until the first client found none left to send: the steady state a server with that many users lives in,
without the drain at the end, where the last requests run in a thinning batch). Before the daemon starts and after
it stops, the same engine runs the same prompts in this process, one at a time (the "in-process" line, the mean of
both runs, since the machine's speed drifts): the daemon's single stream should match it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from depctl import models  # noqa: E402
from depctl.spec import DeploymentSpec, DraftModelSpeculation, NgramSpeculation, NoSpeculation  # noqa: E402
from depctl.store import SpecStore  # noqa: E402
from depctl.workloads import prompts_dir  # noqa: E402


@dataclass
class Cell:
    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0
    ttft: list = field(default_factory=list)
    decode_rates: list = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    # while every client had a request in flight: from the start until the first client found none left to send
    busy_tokens: float = 0.0
    busy_seconds: float = 0.0
    streams: list = field(default_factory=list, repr=False)  # each request's (chunk times, tokens), for the above

    @property
    def aggregate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def busy(self) -> float:
        """Output tokens a second while every client was busy: the server's steady state, without the drain at the
        end, where fewer requests than clients are left and a batch thins out."""
        return self.busy_tokens / self.busy_seconds if self.busy_seconds else 0.0

    def merged(self, other: Cell) -> Cell:
        """Two runs of the same cell as one: their tokens over their seconds."""
        return Cell(
            self.requests + other.requests,
            self.tokens + other.tokens,
            self.seconds + other.seconds,
            self.ttft + other.ttft,
            self.decode_rates + other.decode_rates,
            self.drafted + other.drafted,
            self.accepted + other.accepted,
            self.busy_tokens + other.busy_tokens,
            self.busy_seconds + other.busy_seconds,
        )


def tokens_before(streams: list, end: float) -> float:
    """The output tokens streamed by ``end``: each request's tokens in the share of its chunks that arrived by then
    (a chunk may carry several tokens, and only the usage at the end says how many in all)."""
    total = 0.0
    for times, tokens in streams:
        if times:
            total += tokens * sum(t <= end for t in times) / len(times)
    return total


def one_request(client, prompt: str, max_tokens: int, extra: dict, cell: Cell, lock: threading.Lock) -> None:
    t0 = time.perf_counter()
    first = last = None
    usage = None
    times = []
    stream = client.chat.completions.create(
        model="bench",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            now = time.perf_counter()
            first = first or now
            last = now
            times.append(now)
        if chunk.usage is not None:
            usage = chunk.usage
    tokens = usage.completion_tokens if usage is not None else len(times)  # a server without usage: a chunk a token
    spec = (usage.model_extra or {}).get("speculation") or {} if usage is not None else {}
    with lock:
        cell.requests += 1
        cell.tokens += tokens
        if first is not None:
            cell.ttft.append(first - t0)
            if tokens > 1 and last > first:
                cell.decode_rates.append((tokens - 1) / (last - first))
        cell.drafted += spec.get("drafted_tokens") or 0
        cell.accepted += spec.get("accepted_tokens") or 0
        cell.streams.append((times, tokens))


def run_cell(url: str, prompts: list[str], concurrency: int, requests: int, max_tokens: int, extra: dict) -> Cell:
    import openai

    cell, lock = Cell(), threading.Lock()
    counter = iter(range(requests))
    done = []  # when each client found no request left

    def client_loop(c: int) -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        # a shared iterator: each request index is taken once (next() on a range iterator is atomic). Request i is
        # prompt i whichever client takes it, so every mode runs the same requests (greedy: the same tokens)
        for i in counter:
            one_request(client, prompts[i % len(prompts)], max_tokens, extra, cell, lock)
        done.append(time.perf_counter())

    threads = [threading.Thread(target=client_loop, args=(c,)) for c in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cell.seconds = time.perf_counter() - t0
    end = min(done, default=t0 + cell.seconds)  # (a client whose request failed ends its thread without a time)
    cell.busy_tokens, cell.busy_seconds = tokens_before(cell.streams, end), end - t0
    cell.streams = []
    return cell


def in_process(spec: DeploymentSpec, prompts: list[str], max_tokens: int) -> tuple[float, int]:
    """The same engine, loaded and run in this process's main thread, one request at a time (plain decoding)."""
    from depctl_runtime.backends.loader import load_deployment
    from depctl_runtime.speculation import GenerationParams, generate

    loaded = load_deployment(spec)
    tok = loaded.tokenizer
    tokens, seconds = 0, 0.0
    for prompt in prompts:
        text = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        ids = tok(text, add_special_tokens=False)["input_ids"]
        params = GenerationParams(max_tokens=max_tokens, speculate=False)
        t0 = time.perf_counter()
        tokens += sum(len(o.token_ids) for o in generate(loaded.engine, ids, params))
        seconds += time.perf_counter() - t0
    return tokens / seconds, tokens


def start_daemon(home: Path, deployments: tuple[str, ...] = ("bench",)) -> tuple[subprocess.Popen, str]:
    """A daemon over the specs in ``home``, once ``deployments`` are READY: (process, url)."""
    env = {**os.environ, "DEPCTL_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    log = open(home / "daemon.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "depctl_runtime", "--port", "0", "--log-level", "warning"],
        env=env,
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    import httpx

    for _ in range(3600):  # a large model's first load compiles its passes: many minutes on 2 cores
        try:
            info = json.loads((home / "daemon.json").read_text())
            url = f"http://{info['host']}:{info['port']}"
            statuses = [httpx.get(f"{url}/depctl/v1/deployments/{d}", timeout=5).json() for d in deployments]
            if all(status.get("state") == "READY" for status in statuses):
                print(f"# {home.name}: compiled passes {statuses[0].get('compiled', '?')}", file=sys.stderr)
                return proc, url
        except Exception:  # not up yet
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the daemon exited: {(home / 'daemon.log').read_text()[-2000:]}")
        time.sleep(0.5)
    raise RuntimeError("the deployment did not become READY")


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def p95(xs):
    return sorted(xs)[max(0, int(round(0.95 * len(xs))) - 1)] if xs else float("nan")


def start_server(
    argv: list[str], url: str, log_path: Path, env: dict | None = None, timeout: float = 600
) -> subprocess.Popen:
    """A peer's OpenAI-compatible server: started, and waited for until ``/v1/models`` answers."""
    import httpx

    log = open(log_path, "ab")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{argv[0]} exited: {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.terminate()
    raise RuntimeError(f"{argv[0]} did not answer on {url} in {timeout:.0f}s (log: {log_path})")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_servers(binary: Path, label: str, gguf: Path, args, parallel: int):
    """(name, mode, argv, url, env) for llama.cpp's server on one GGUF, plain and speculating: with its n-gram
    speculation, or with ``--llama-draft``'s GGUF as its draft model."""

    def argv(port: int) -> list[str]:
        return [
            str(binary),
            "-m",
            str(gguf),
            "-t",
            str(args.threads),
            "-c",
            str(4096 * parallel),
            "-np",
            str(parallel),
            "--no-repack",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]

    ngram = [
        "--spec-type",
        "ngram-simple",
        "--spec-ngram-simple-size-n",
        str(args.ngram),
        "--spec-ngram-simple-size-m",
        str(args.k),
        "--spec-draft-n-max",
        str(args.k),
    ]
    if args.llama_draft:
        ngram = ["-md", str(args.llama_draft.resolve()), "--spec-draft-n-max", str(args.k)]
    env = {"LD_LIBRARY_PATH": str(binary.parent)}
    plain, spec = free_port(), free_port()
    return [
        (f"llama.cpp {label}", "plain", argv(plain), f"http://127.0.0.1:{plain}", env),
        (f"llama.cpp {label}", spec_mode(args), argv(spec) + ngram, f"http://127.0.0.1:{spec}", env),
    ]


def vllm_servers(python: Path, model_dir: str, args):
    dtype = "float32" if args.dtype == "float32" else "bfloat16"

    def argv(port: int) -> list[str]:
        return [
            str(python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model_dir,
            "--served-model-name",
            "bench",
            "--dtype",
            dtype,
            "--max-model-len",
            "4096",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]

    spec = json.dumps(
        {
            "method": "ngram",
            "num_speculative_tokens": args.k,
            "prompt_lookup_min": args.ngram,
            "prompt_lookup_max": args.ngram,
        }
    )
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "OMP_NUM_THREADS": str(args.threads)}
    plain, ngram = free_port(), free_port()
    return [
        (f"vLLM {dtype}", "plain", argv(plain), f"http://127.0.0.1:{plain}", env),
        (f"vLLM {dtype}", "n-gram", argv(ngram) + ["--speculative-config", spec], f"http://127.0.0.1:{ngram}", env),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--workload", default="chat,grounded")
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument(
        "--requests",
        type=int,
        default=0,
        help="requests per cell; request i sends prompt i (default: every prompt of the workload equally often, "
        "at least 2 x concurrency requests; a cell of fewer measures the prompts it reaches)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run each cell this many times, the modes alternating, and report them together (a cell of a few "
        "seconds moves by 10%% from run to run on a shared machine)",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="a third mode on our deployments: plain decoding again, run between the two, so each cell's "
        "'plain again' row reads plain against plain: the machine's noise in that cell, beside speculation's ratio",
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ngram", type=int, default=3)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument(
        "--draft-model",
        default=None,
        metavar="MODEL",
        help="speculate with this draft model instead of n-grams (the mode's rows say 'draft')",
    )
    parser.add_argument("--device", default="auto", help="the deployments' --device (auto, cpu, cuda)")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="the deployment's --dtype (auto: bfloat16 on CPUs with bf16 instructions, else float32)",
    )
    parser.add_argument("--quantization", default="none", help="the deployment's --quantization (none, int8, int4)")
    parser.add_argument("--draft-precision", default="auto", help="the draft model's --draft-precision")
    parser.add_argument(
        "--depctl",
        action="append",
        default=[],
        metavar="DTYPE[+int8|+int4][+eager]",
        help="one of our deployments to measure, e.g. float32, bfloat16, auto+int4, auto+int8+eager "
        "(--no-compile) (repeatable; default: --dtype with --quantization). Each gets a daemon of its "
        "own, running beside the others",
    )
    parser.add_argument("--no-in-process", action="store_true")
    parser.add_argument("--no-depctl", action="store_true", help="only the peers")
    parser.add_argument(
        "--llama-server",
        type=Path,
        default=None,
        help="a llama-server binary (llama.cpp built with its server): its rows join the tables",
    )
    parser.add_argument(
        "--gguf",
        action="append",
        default=[],
        metavar="LABEL=FILE",
        help="a GGUF of the same model for --llama-server, e.g. F32=smol-f32.gguf (repeatable)",
    )
    parser.add_argument(
        "--llama-draft",
        type=Path,
        default=None,
        metavar="FILE",
        help="the draft model's GGUF for llama.cpp's speculative rows (with --draft-model; else its n-gram rows)",
    )
    parser.add_argument(
        "--depctl-vllm",
        action="store_true",
        help="also a --engine vllm deployment through our daemon (`depctl engine install vllm` first): "
        "vLLM behind depctl's API, plain and n-gram, one daemon each",
    )
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=None,
        help="the python of a virtualenv with vLLM's CPU build: its rows join the tables",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="threads for the peers")
    parser.add_argument(
        "--sequential",
        action="store_true",
        help="run the servers one after another instead of side by side (less memory)",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    workloads = args.workload.split(",")
    prompts = {w: [json.loads(line)["prompt"] for line in (prompts_dir() / f"{w}.jsonl").open()] for w in workloads}
    configs = args.depctl or [args.dtype + (f"+{args.quantization}" if args.quantization != "none" else "")]
    if args.draft_model:
        speculation = DraftModelSpeculation(
            draft_model=args.draft_model, num_draft_tokens=args.k, draft_precision=args.draft_precision
        )
    else:
        speculation = NgramSpeculation(ngram_length=args.ngram, num_draft_tokens=args.k)
    specs = {}
    for config in configs:
        dtype, *modifiers = config.split("+")
        specs[f"depctl {config}"] = DeploymentSpec(
            id="bench",
            model=args.model,
            max_batch_size=max(levels),
            dtype=dtype or "auto",
            device=args.device,
            quantization=next((m for m in modifiers if m in ("int8", "int4")), "none"),
            compile="eager" not in modifiers,
            speculation=speculation,
        )
    ours = next(iter(specs))  # the others' "vs depctl plain" column compares with this one

    results: dict = {}
    runs: dict = {}  # each run of a cell on its own, for the spread of the ratios over --repeat
    guards: dict = {}  # (server, workload, clients) -> the deployment's guard after the cell: batch -> ratio
    reference = {}

    def in_process_reference() -> None:
        """The first deployment in this process, before the servers start and after they stop (the machine's speed
        drifts; the tables use the mean of both runs)."""
        for w in workloads:
            now = in_process(specs[ours], prompts[w], args.max_tokens)
            print(f"in-process {w}: {now[0]:.1f} tok/s", file=sys.stderr)
            reference[w] = (
                now if w not in reference else ((reference[w][0] + now[0]) / 2, now[1], reference[w][0], now[0])
            )
        import gc

        gc.collect()

    # Every server is started first and the cells then go round them: each level runs every (server, mode) in turn,
    # the order rotating from level to level, so a slow minute on a shared machine hits them alike. An idle server
    # takes no CPU (our engine thread and llama.cpp's workers wait on a queue). --sequential runs one server at a
    # time instead (what a machine with too little memory for all of them needs).
    def launchers() -> list:
        """One function per server process that starts it and returns (name, modes, url, process)."""
        out = []

        def ours_(name: str, spec: DeploymentSpec, modes: dict[str, dict], prefix: str):
            def launch():
                home = Path(tempfile.mkdtemp(prefix=prefix))
                SpecStore(home / "deployments").create(spec)
                proc, url = start_daemon(home)
                return name, modes, url, proc

            return launch

        for name, spec in ({} if args.no_depctl else specs).items():
            # one deployment serves both modes: a request may ask to decode plainly
            out.append(ours_(name, spec, depctl_modes(args), "depctl-load-"))
        if args.depctl_vllm:  # vLLM behind our daemon: its speculation is a start-up flag, so a deployment per mode
            dtype = "float32" if args.dtype == "float32" else "bfloat16"
            for mode, speculation in (
                ("plain", NoSpeculation()),
                ("n-gram", NgramSpeculation(ngram_length=args.ngram, num_draft_tokens=args.k)),
            ):
                spec = DeploymentSpec(
                    id="bench",
                    model=args.model,
                    speculation=speculation,
                    dtype=dtype,
                    engine="vllm",
                    max_context_length=4096,
                    max_batch_size=max(levels),
                )
                out.append(ours_(f"depctl->vLLM {dtype}", spec, {mode: {}}, "depctl-load-vllm-"))
        peers = []
        if args.llama_server:
            for item in args.gguf:
                label, _, path = item.partition("=")
                peers += llama_servers(args.llama_server.resolve(), label, Path(path).resolve(), args, max(levels))
        if args.vllm_python:
            peers += vllm_servers(args.vllm_python, models.materialize(models.resolve(args.model, "--model")), args)
        logs = Path(tempfile.mkdtemp(prefix="depctl-peers-"))
        for name, mode, argv, url, env in peers:  # one process per mode: their speculation is a start-up flag
            log = logs / f"{name.replace(' ', '-')}-{mode}.log"
            out.append(
                lambda name=name, mode=mode, argv=argv, url=url, env=env, log=log: (
                    name,
                    {mode: {}},
                    url,
                    start_server(argv, url, log, env),
                )
            )
        return out

    def run_round(group: list) -> None:
        for name, modes, url, _ in group:  # warm-up
            run_cell(url, prompts[workloads[0]][:1], 1, 1, 8, next(iter(modes.values())))
        for w in workloads:
            for i, c in enumerate(levels):
                m = len(prompts[w])
                n = args.requests or m * -(-2 * c // m)  # every prompt as often as the others, >= 2 x concurrency
                order = group[i % len(group) :] + group[: i % len(group)]
                for name, modes, url, _ in order:
                    ours = name.startswith("depctl ")
                    first = last = guard_state(url) if ours else {}
                    # with --repeat, the modes alternate A B B A ...: a drift in the machine's speed hits both alike
                    for r in range(args.repeat):
                        for mode in list(modes) if (i + r) % 2 == 0 else list(reversed(modes)):
                            # the run before may still be working (our daemon's idle-time work), on any server
                            settle(group)
                            cell = run_cell(url, prompts[w], c, n, args.max_tokens, modes[mode])
                            key = (name, mode, w, c)
                            results[key] = results[key].merged(cell) if key in results else cell
                            runs.setdefault(key, []).append(cell)
                            steps = ""
                            if ours:  # what this run drafted, band by band
                                now = guard_state(url)
                                counts = {g["sizes"]: drafted(last.get(b), g) for b, g in now.items()}
                                steps = "".join(f", {sizes} ({d} of {n})" for sizes, (d, n) in counts.items() if n)
                                last = now
                            print(f"  [{name} {w} c={c} {mode}] {cell.aggregate:.1f} tok/s{steps}", file=sys.stderr)
                    if ours:
                        guards[(name, w, c)] = (first, last)

    def stop(group: list) -> None:
        for *_, proc in group:
            proc.terminate()
        for *_, proc in group:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()

    check = not args.no_in_process and not args.no_depctl
    if check:
        in_process_reference()
    servers: list = []
    try:
        for launch in launchers():
            servers.append(launch())
            if args.sequential:  # one at a time: run it, stop it, start the next
                run_round(servers)
                stop(servers)
                servers.clear()
        if servers:
            run_round(servers)
    finally:
        stop(servers)
    if check:
        in_process_reference()

    for w in workloads:
        print_table(w, levels, results, runs, guards, reference.get(w), args, ours)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    f"{n}/{m}/{w}/{c}": vars(cell)
                    | {"aggregate": cell.aggregate, "runs": [run.aggregate for run in runs[(n, m, w, c)]]}
                    for (n, m, w, c), cell in results.items()
                },
                indent=1,
            )
        )
    return 0


def settle(group: list, quiet: float = 5.0, limit: float = 120.0) -> None:
    """Wait until every server's processes use under ``quiet`` percent of a core: a daemon goes on working for a
    while after its cell (it reads finished answers into its prefix cache in idle time), and two processes' threads
    on the same cores slow each other far beyond their share, which put the passes of whichever cell came next at
    10x their cost."""
    import psutil

    procs = []
    for *_, proc in group:
        try:
            top = psutil.Process(proc.pid)
            procs += [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        for p in procs:
            try:
                p.cpu_percent(None)
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.5)
        busy = 0.0
        for p in procs:
            try:
                busy += p.cpu_percent(None)
            except psutil.NoSuchProcess:
                pass
        if busy < quiet:
            return
    print(f"# the servers stayed busy for {limit:.0f}s: measuring anyway", file=sys.stderr)


def guard_state(url: str) -> dict:
    """The deployment's regime guard: per band of batch sizes stepped and kind of drafting step (free guesses, a draft
    model), its tokens a second over plain steps', and whether it is off there."""
    import httpx

    status = httpx.get(f"{url}/depctl/v1/deployments/bench", timeout=10).json()
    return (status.get("policy") or {}).get("drafting_over_plain") or {}


def drafted(before: dict | None, after: dict) -> tuple[int, int]:
    """Of the steps a band of the guard's ran between two readings of it (every mode's runs), how many drafted, and how
    many there were: its counts in ``after`` less those in ``before``."""
    counts = {k: n - ((before or {}).get("steps") or {}).get(k, 0) for k, n in (after.get("steps") or {}).items()}
    total = sum(counts.values())
    return total - counts.get("plain", 0), total


def _drafted(before: dict | None, after: dict) -> str:
    d, n = drafted(before, after)
    return f" ({d} of {n} steps drafted)" if n else ""


def spread(runs: list, own: list | None) -> str:
    """Each run's ratio to the plain run beside it (--repeat alternates the modes), lowest to highest."""
    if not own or len(runs) < 2 or len(own) != len(runs):
        return "-"
    ratios = sorted(r.aggregate / p.aggregate for r, p in zip(runs, own) if p.aggregate)
    return f"{ratios[0]:.2f}-{ratios[-1]:.2f}"


def print_table(workload, levels, results, runs, guards, reference, args, ours) -> None:
    how = f"draft {args.draft_model}" if args.draft_model else f"n-gram n={args.ngram}"
    print(
        f"\n### {workload}: {args.model}, {how} K={args.k}, max_tokens {args.max_tokens}, greedy, streaming over HTTP\n"
    )
    if reference is not None:
        plain1 = results[(ours, "plain", workload, levels[0])].aggregate if levels[0] == 1 else None
        print(f"In-process reference: {ours}.")
        ratio = f" (daemon, 1 client: {plain1 / reference[0]:.2f}x of it)" if plain1 else ""
        runs = f" (before the daemon {reference[2]:.1f}, after {reference[3]:.1f})" if len(reference) > 2 else ""
        print(f"Same engine in-process, one request at a time, plain: {reference[0]:.1f} tok/s{runs}{ratio}\n")
    servers = list(dict.fromkeys(name for name, _, w, _ in results if w == workload))
    print(
        "| server | clients | mode | requests | aggregate tok/s | per-request tok/s (median) | TTFT median s | "
        "TTFT p95 s | acceptance | vs its plain (same clients) | each run vs its plain | every client busy: tok/s | "
        "every client busy: vs its plain | vs depctl plain (same clients) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    mismatched = []  # greedy speculation is exact: the same requests must give the same tokens
    for c in levels:
        for name in servers:
            for mode in ("plain", CONTROL, spec_mode(args)):
                cell = results.get((name, mode, workload, c))
                if cell is None:
                    continue
                own = results.get((name, "plain", workload, c))
                base = results.get((ours, "plain", workload, c))
                acc = f"{cell.accepted / cell.drafted:.0%}" if cell.drafted else "-"
                each = (
                    "-"
                    if mode == "plain"
                    else spread(runs[(name, mode, workload, c)], runs.get((name, "plain", workload, c)))
                )
                if mode != "plain" and own is not None and cell.tokens != own.tokens and name.startswith("depctl "):
                    mismatched.append(f"{name} {c} clients: {cell.tokens} tokens against plain's {own.tokens}")
                print(
                    f"| {name} | {c} | {mode} | {cell.requests} | {cell.aggregate:.1f} | "
                    f"{median(cell.decode_rates):.1f} | {median(cell.ttft):.2f} | {p95(cell.ttft):.2f} | {acc} | "
                    f"{_ratio(cell, own)} | {each} | {cell.busy:.1f} | {_ratio(cell, own, 'busy')} | "
                    f"{_ratio(cell, base)} |"
                )
    for line in mismatched:
        print(f"\n**Output differs from plain decoding**: {line}")
    for (name, w, c), (before, guard) in guards.items():
        if w == workload and guard:
            cells = ", ".join(
                f"{g.get('sizes', b)}: {kind} {k['ratio']:.2f}{' off' if k['off'] else ''}{_drafted(before.get(b), g)}"
                for b, g in guard.items()
                for kind, k in g.items()
                if kind in ("free", "model")
            )
            print(f"\n{name} after {c} clients, drafting over plain steps by batch size: {cells}")
    sys.stdout.flush()


def spec_mode(args) -> str:
    return "draft" if args.draft_model else "n-gram"


CONTROL = "plain again"


def depctl_modes(args) -> dict[str, dict]:
    """The modes one of our deployments serves, each a request's extra fields, in the order a round runs them (or its
    reverse, round by round): plain, with ``--control`` plain again, then speculating. Over two rounds every mode's
    runs sit at the same mean time, so a steady drift in the machine's speed moves neither ratio."""
    modes = {"plain": {"speculate": False}}
    if args.control:
        modes[CONTROL] = {"speculate": False}
    modes[spec_mode(args)] = {"speculate": True}
    return modes


def _ratio(cell: Cell, base: Cell | None, rate: str = "aggregate") -> str:
    return f"{getattr(cell, rate) / getattr(base, rate):.2f}x" if base is not None and getattr(base, rate) else "-"


if __name__ == "__main__":
    sys.exit(main())
