"""The prompt side, depctl beside llama.cpp's server in one run: time to first token on cold prompts at 1 and more
clients, a shared system prompt read cold then warm, a conversation's turns, the gaps between running streams' tokens
while a long prompt arrives, prompt tokens/s and the memory the servers hold. Every server is started first and
idles (taking no CPU) while another is measured; each scenario goes round the servers in turn.

    .venv/bin/python benchmarks/prompts.py                              # depctl alone, SmolLM2 float32
    .venv/bin/python benchmarks/prompts.py --quantization int4 \\
        --llama-server $LLAMA/build/bin/llama-server --gguf smollm2-q4_k_m.gguf
    .venv/bin/python benchmarks/prompts.py --sizes 1024,4096 --clients 1,4 --turns 6 --think 0,3 --stall-tokens 8000

Streaming chat completions, greedy, the chat template applied by each server. A cold prompt starts with a number no
other request has, so no server finds any of it cached. llama.cpp's server keeps each slot's last prompt
(``cache_prompt``); depctl keeps prompt blocks in its prefix cache and, while idle, reads finished answers into it
(``--think``: seconds between a conversation's turns, as a user takes them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.load import free_port, start_daemon, start_server  # noqa: E402
from depctl import models  # noqa: E402
from depctl.spec import DeploymentSpec, NoSpeculation  # noqa: E402
from depctl.store import SpecStore  # noqa: E402


class Server:
    def __init__(self, name: str, url: str, proc, tokenizer):
        self.name, self.url, self.proc, self.tokenizer = name, url, proc, tokenizer

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=1200)

    def rss(self) -> int:
        import psutil

        proc = psutil.Process(self.proc.pid)
        return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])


def stream(client, messages, max_tokens: int, gaps: list | None = None) -> tuple[float, str, dict]:
    """(seconds to the first token, the answer, usage); ``gaps``: the seconds between its chunks, appended."""
    t0 = time.perf_counter()
    first, last, text, usage = None, None, [], {}
    for chunk in client.chat.completions.create(
        model="bench",
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            now = time.perf_counter()
            if first is None:
                first = now
            elif gaps is not None:
                gaps.append((now, now - last))
            last = now
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
    return (first or time.perf_counter()) - t0, "".join(text), usage


class Texts:
    """Filler text from the prompts depctl ships, cut to a number of the model's tokens."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        root = resources.files("depctl").joinpath("data/prompts")
        lines = []
        for name in ("grounded.jsonl", "chat.jsonl", "code.jsonl"):
            lines += [json.loads(line)["prompt"] for line in root.joinpath(name).read_text().splitlines() if line]
        self.corpus = "\n".join(lines)
        self.ids = tokenizer(self.corpus, add_special_tokens=False)["input_ids"]

    def tokens(self, n: int, offset: int = 0) -> str:
        ids = [self.ids[(offset + i) % len(self.ids)] for i in range(n)]
        return self.tokenizer.decode(ids)


def cold(servers, texts: Texts, sizes, clients, rows, counter) -> None:
    """Each cell twice, the servers' order reversed the second time, and the better of the two: a server that has
    just finished its own cell can leave the machine busy for a moment (llama.cpp's threads poll for work)."""
    for size in sizes:
        for n in clients:
            best: dict = {}
            for server in servers + servers[::-1]:
                times, prompt_tokens = [], []

                def one(i: int) -> None:
                    k = next(counter)
                    content = f"Request {k}. " + texts.tokens(size - 30, offset=997 * k)
                    t, _, usage = stream(server.client(), [{"role": "user", "content": content}], 1)
                    times.append(t)
                    prompt_tokens.append(usage.get("prompt_tokens", 0))

                threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                mean, tokens = statistics.mean(times), statistics.mean(prompt_tokens)
                if server.name not in best or mean < best[server.name][0]:
                    best[server.name] = (mean, tokens)
            what = f"cold {size}-token prompt, {n} client{'s' * (n > 1)}"
            for name, (mean, tokens) in best.items():
                rows.append((what, name, mean, f"{tokens:.0f} tokens"))
                if n == 1:
                    rows.append((f"prompt tokens/s at {size}", name, tokens / mean, ""))


def shared(servers, texts: Texts, prefix_tokens: int, questions: int, rows, counter) -> None:
    for server in servers:
        system = f"Session {next(counter)}. " + texts.tokens(prefix_tokens, offset=31)
        times = []
        for q in range(questions + 1):
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Question {q}: what is the main point of the passage above?"},
            ]
            times.append(stream(server.client(), messages, 1)[0])
        warm = statistics.median(times[1:])
        rows.append((f"shared {prefix_tokens}-token system prompt, cold", server.name, times[0], ""))
        rows.append(
            (
                f"shared {prefix_tokens}-token system prompt, warm (median of {questions})",
                server.name,
                warm,
                f"{warm / times[0]:.2f}x cold",
            )
        )


def conversation(servers, texts: Texts, turns: int, think: float, rows, counter) -> None:
    for server in servers:
        messages = [{"role": "system", "content": f"Conversation {next(counter)}. You are a helpful assistant."}]
        times = []
        for turn in range(turns):
            messages.append({"role": "user", "content": texts.tokens(150, offset=4001 * turn + 7)})
            t, answer, usage = stream(server.client(), messages, 120)
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            times.append((t, usage.get("prompt_tokens", 0), cached))
            messages.append({"role": "assistant", "content": answer})
            time.sleep(think)
        for i, (t, n, cached) in enumerate(times):
            note = f"{n} prompt tokens" + (f", {cached} cached" if cached is not None else "")
            rows.append((f"conversation, think {think:g} s: turn {i + 1}", server.name, t, note))
        rows.append(
            (f"conversation, think {think:g} s: turn {turns} / turn 1", server.name, times[-1][0] / times[0][0], "")
        )


def stall(servers, texts: Texts, streams: int, long_tokens: int, rows, counter) -> None:
    for server in servers:
        gaps: list = []
        done = threading.Event()
        window: dict = {}

        def runner(i: int) -> None:
            content = f"Stream {next(counter)}. Write a long story about a lighthouse keeper."
            while not done.is_set():
                stream(server.client(), [{"role": "user", "content": content}], 400, gaps)

        threads = [threading.Thread(target=runner, args=(i,), daemon=True) for i in range(streams)]
        for t in threads:
            t.start()
        time.sleep(8)
        window["start"] = time.perf_counter()
        content = f"Request {next(counter)}. " + texts.tokens(long_tokens - 30, offset=5)
        t_long = stream(server.client(), [{"role": "user", "content": content}], 1)[0]
        window["end"] = time.perf_counter()
        time.sleep(4)
        done.set()
        for t in threads:
            t.join()
        before = [g for at, g in gaps if at < window["start"]]
        during = [g for at, g in gaps if window["start"] <= at <= window["end"]]
        b50, d50 = statistics.median(before) * 1000, statistics.median(during) * 1000
        d99 = sorted(during)[min(len(during) - 1, int(0.99 * len(during)))] * 1000
        what = f"{streams} streams while a {long_tokens}-token prompt is read"
        rows.append((f"{what}: gap p50 before, ms", server.name, b50, ""))
        rows.append((f"{what}: gap p50 during, ms", server.name, d50, ""))
        rows.append((f"{what}: gap p99 during, ms", server.name, d99, f"{d99 / d50:.1f}x p50 during"))
        rows.append((f"{what}: the long prompt's first token, s", server.name, t_long, ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--sizes", default="1024,4096,8000", help="cold prompt sizes in tokens")
    parser.add_argument("--clients", default="1,4", help="clients sending cold prompts at once")
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--think", default="0,3", help="seconds between a conversation's turns, one run each")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--stall-tokens", type=int, default=8000, help="0: no stall scenario")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-server", type=Path, help="a llama-server binary: its rows join the table")
    parser.add_argument("--gguf", type=Path, help="the same model as a GGUF, for --llama-server")
    parser.add_argument("--only", default="cold,shared,conversation,stall")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models.materialize(models.resolve(args.model)))
    texts = Texts(tokenizer)
    servers, procs = [], []
    home = Path(tempfile.mkdtemp(prefix="depctl-prompts-"))
    largest = max([int(s) for s in args.sizes.split(",")] + [args.stall_tokens, args.prefix_tokens + 200])
    parallel = max([int(c) for c in args.clients.split(",")] + [args.streams + 1])
    try:
        SpecStore(home / "deployments").create(
            DeploymentSpec(
                id="bench",
                model=args.model,
                quantization=args.quantization,
                speculation=NoSpeculation(),
                max_batch_size=parallel,
            )
        )
        proc, url = start_daemon(home)
        procs.append(proc)
        servers.append(Server(f"depctl {args.quantization}", url, proc, tokenizer))
        if args.llama_server:
            port = free_port()
            argv = [str(args.llama_server.resolve()), "-m", str(args.gguf.resolve()), "-t", str(args.threads)]
            argv += ["-c", str((largest + 512) * parallel), "-np", str(parallel), "--host", "127.0.0.1"]
            argv += ["--port", str(port), "-a", "bench"]
            env = {"LD_LIBRARY_PATH": str(args.llama_server.resolve().parent)}
            proc = start_server(argv, f"http://127.0.0.1:{port}", home / "llama.log", env)
            procs.append(proc)
            servers.append(Server(f"llama.cpp {args.gguf.stem}", f"http://127.0.0.1:{port}", proc, tokenizer))
        for server in servers:  # each server's first requests pay for lazy start-up work (and a cache's growth)
            stream(server.client(), [{"role": "user", "content": "Hello"}], 4)
            stream(server.client(), [{"role": "user", "content": "Warm-up. " + texts.tokens(largest // 2)}], 4)
        rows: list = []
        counter = iter(range(1, 1_000_000))
        only = set(args.only.split(","))
        if "cold" in only:
            sizes, clients = [int(s) for s in args.sizes.split(",")], [int(c) for c in args.clients.split(",")]
            cold(servers, texts, sizes, clients, rows, counter)
        if "shared" in only:
            shared(servers, texts, args.prefix_tokens, args.questions, rows, counter)
        if "conversation" in only:
            for think in [float(t) for t in args.think.split(",")]:
                conversation(servers, texts, args.turns, think, rows, counter)
        if "stall" in only and args.stall_tokens:
            stall(servers, texts, args.streams, args.stall_tokens, rows, counter)
        for server in servers:
            rows.append(("memory held by the server process (RSS), MiB", server.name, server.rss() / 2**20, ""))
        import httpx

        status = httpx.get(f"{servers[0].url}/depctl/v1/deployments/bench").json()
        cache = status.get("prefix_cache") or {}
        rows.append(("depctl's prefix cache at the end, MiB", servers[0].name, cache.get("bytes", 0) / 2**20, ""))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)
    names = [s.name for s in servers]
    print(f"\n{args.model}; {', '.join(names)}; {args.threads} threads")
    print("| what | " + " | ".join(names) + " | notes |")
    print("|---|" + "---:|" * len(names) + "---|")
    by_what: dict = {}
    for what, name, value, note in rows:
        by_what.setdefault(what, {})[name] = (value, note)
    for what, cells in by_what.items():
        values = " | ".join(f"{cells[n][0]:.2f}" if n in cells else "" for n in names)
        notes = "; ".join(f"{n}: {cells[n][1]}" for n in names if n in cells and cells[n][1])
        print(f"| {what} | {values} | {notes} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
