"""A coding agent's session replayed through the Messages API: time to first token and decode speed per turn, with
plain, n-gram and suffix speculation (each a deployment of its own, prefix cache on), beside llama.cpp's server on
the same trace when given one. Each turn goes round the servers before the next (each keeps its own cache), so a
slow minute of the machine falls on all of them.

The session is scripted, as an agent's traffic looks to a server: a system prompt and four tools, a task, then turns
that each add the agent's last tool call and its result (a file read, an edit, a test run, a second read, a second
edit, the tests again). At each turn the server answers the conversation so far (greedy, streamed, up to
``--max-tokens``); its answer is measured and dropped, and the script's own next call follows, so every server sees
the same prompts. Agents quote what they read: the edits repeat lines of the file, which is what n-gram and suffix
speculation draft from.

    .venv/bin/python benchmarks/agent_trace.py --model qwen2.5-coder-0.5b-instruct --quantization int4
    .venv/bin/python benchmarks/agent_trace.py ... --llama-server $LLAMA/build/bin/llama-server --gguf q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.load import free_port, start_daemon, start_server  # noqa: E402
from depctl.spec import DeploymentSpec, NgramSpeculation, NoSpeculation, SuffixSpeculation  # noqa: E402
from depctl.store import SpecStore  # noqa: E402

SYSTEM = (
    "You are a coding agent working in a Python repository. Use the tools to read files, edit them and run "
    "commands. Make the smallest change that fixes the problem, run the tests after each edit, and stop when they "
    "pass. When you edit, quote the exact lines you replace."
)


def _tool(name: str, description: str, **properties: str) -> dict:
    schema = {"type": "object", "properties": {k: {"type": "string", "description": v} for k, v in properties.items()}}
    return {"name": name, "description": description, "input_schema": {**schema, "required": list(properties)}}


TOOLS = [
    _tool("read_file", "Read a file of the repository.", path="The file's path"),
    _tool("edit_file", "Replace text in a file.", path="The file's path", old="Exact text", new="Its replacement"),
    _tool("run_command", "Run a shell command in the repository.", command="The command line"),
    _tool("list_files", "List the files under a folder.", path="The folder"),
]

CALC = '''"""Small arithmetic helpers used by the billing code."""


def add(a: float, b: float) -> float:
    """The sum of a and b."""
    return a - b


def subtract(a: float, b: float) -> float:
    """a minus b."""
    return a - b


def multiply(a: float, b: float) -> float:
    """The product of a and b."""
    return a * b


def divide(a: float, b: float) -> float:
    """a divided by b; b must not be zero."""
    if b == 0:
        raise ValueError("division by zero")
    return a * b


def average(values: list[float]) -> float:
    """The mean of values; there must be at least one."""
    if not values:
        raise ValueError("average of nothing")
    return add(sum(values), 0) / len(values)
'''
TESTS = """from calc import add, average, divide, multiply, subtract


def test_add():
    assert add(2, 3) == 5


def test_subtract():
    assert subtract(5, 3) == 2


def test_divide():
    assert divide(6, 3) == 2


def test_average():
    assert average([1, 2, 3]) == 2
"""
FAILED = """============================= test session starts ==============================
collected 4 items

test_calc.py F.F.                                                         [100%]

=================================== FAILURES ===================================
___________________________________ test_add ___________________________________

    def test_add():
>       assert add(2, 3) == 5
E       assert -1 == 5
E        +  where -1 = add(2, 3)

test_calc.py:5: AssertionError
_________________________________ test_divide __________________________________

    def test_divide():
>       assert divide(6, 3) == 2
E       assert 18 == 2
E        +  where 18 = divide(6, 3)

test_calc.py:13: AssertionError
=========================== short test summary info ============================
FAILED test_calc.py::test_add - assert -1 == 5
FAILED test_calc.py::test_divide - assert 18 == 2
========================= 2 failed, 2 passed in 0.02s ==========================
"""
STEPS = [  # the agent's calls and what they returned, in order
    ("read_file", {"path": "calc.py"}, CALC),
    ("run_command", {"command": "python -m pytest -q"}, FAILED),
    ("read_file", {"path": "test_calc.py"}, TESTS),
    (
        "edit_file",
        {
            "path": "calc.py",
            "old": '    """The sum of a and b."""\n    return a - b',
            "new": '    """The sum of a and b."""\n    return a + b',
        },
        "Replaced 1 occurrence in calc.py.",
    ),
    (
        "run_command",
        {"command": "python -m pytest -q"},
        FAILED.replace("F.F.", ".F..").replace("2 failed, 2", "1 failed, 3"),
    ),
    (
        "edit_file",
        {
            "path": "calc.py",
            "old": '        raise ValueError("division by zero")\n    return a * b',
            "new": '        raise ValueError("division by zero")\n    return a / b',
        },
        "Replaced 1 occurrence in calc.py.",
    ),
]


def conversation(turn: int) -> list[dict]:
    """The messages after ``turn`` of the scripted calls have returned."""
    messages: list[dict] = [{"role": "user", "content": "The tests fail. Find out why and fix calc.py."}]
    for i, (name, arguments, result) in enumerate(STEPS[:turn]):
        call = {"type": "tool_use", "id": f"toolu_{i}", "name": name, "input": arguments}
        messages.append({"role": "assistant", "content": [call]})
        messages.append(
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": result}]}
        )
    return messages


def answer(client, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed answer, a tool call (``tool_choice: any``, as an agent's working turns are): seconds to its
    first token and to its end, its decode tok/s, its tokens and the prompt's."""
    t0 = time.perf_counter()
    first = last = None
    with client.messages.stream(
        model=model,
        system=SYSTEM,
        tools=TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
    ) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                last = time.perf_counter()
                first = first or last
        final = stream.get_final_message()
    usage = final.usage
    out = usage.output_tokens
    first = first or time.perf_counter()
    end = time.perf_counter()
    decode = (out - 1) / (end - first) if out > 1 else float("nan")
    cached = usage.cache_read_input_tokens or 0
    prompt = usage.input_tokens + cached
    return {"ttft": first - t0, "total": end - t0, "tok_s": decode, "out": out, "prompt": prompt, "cached": cached}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--quantization", default="int4")
    parser.add_argument("--methods", default="plain,ngram,suffix")
    parser.add_argument("--k", type=int, default=8, help="draft tokens for n-gram and suffix speculation")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-server", type=Path, help="a llama-server binary: its rows join the table")
    parser.add_argument("--gguf", type=Path, help="the same model as a GGUF, for --llama-server")
    args = parser.parse_args()
    import anthropic

    methods = args.methods.split(",")
    speculation = {
        "plain": NoSpeculation(),
        "ngram": NgramSpeculation(ngram_length=3, num_draft_tokens=args.k),
        "suffix": SuffixSpeculation(num_draft_tokens=args.k),
    }
    home = Path(tempfile.mkdtemp(prefix="depctl-agent-"))
    store = SpecStore(home / "deployments")
    for method in methods:
        store.create(
            DeploymentSpec(id=method, model=args.model, quantization=args.quantization, speculation=speculation[method])
        )
    procs, results = [], {}
    try:
        proc, url = start_daemon(home, tuple(methods))
        procs.append(proc)
        client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=1800)
        servers = [(f"depctl {m}", client, m) for m in methods]
        if args.llama_server:
            port = free_port()
            argv = [str(args.llama_server.resolve()), "-m", str(args.gguf.resolve()), "-t", str(args.threads)]
            argv += ["-c", "16384", "--jinja", "--host", "127.0.0.1", "--port", str(port)]
            env = {"LD_LIBRARY_PATH": str(args.llama_server.resolve().parent)}
            procs.append(start_server(argv, f"http://127.0.0.1:{port}", home / "llama.log", env))
            llama = anthropic.Anthropic(
                base_url=f"http://127.0.0.1:{port}", api_key="unused", max_retries=0, timeout=1800
            )
            servers.append((f"llama.cpp {args.gguf.stem}", llama, "bench"))
        for name, c, model in servers:
            answer(c, model, [{"role": "user", "content": "Hello"}], 4)  # lazy start-up work, not the trace's
            results[name] = []
        for turn in range(len(STEPS) + 1):  # each turn round the servers: a slow minute of the machine hits all
            for name, c, model in servers:
                results[name].append(answer(c, model, conversation(turn), args.max_tokens))
            print(f"# turn {turn + 1}: done", file=sys.stderr)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)
    names = list(results)
    print(f"\n{args.model} ({args.quantization}); {len(STEPS) + 1} turns, up to {args.max_tokens} tokens each, greedy")
    print("| turn | prompt tokens | " + " | ".join(f"{n}: TTFT / turn s (tokens)" for n in names) + " |")
    print("|---|---:|" + "---:|" * len(names))
    for turn in range(len(STEPS) + 1):
        cells = " | ".join(
            f"{results[n][turn]['ttft']:.2f} / {results[n][turn]['total']:.2f} ({results[n][turn]['out']})"
            for n in names
        )
        print(f"| {turn + 1} | {results[names[0]][turn]['prompt']} | {cells} |")
    base = sum(r["total"] for r in results[names[0]])
    print("| whole session, s | |" + " | ".join(f"{sum(r['total'] for r in results[n]):.1f}" for n in names) + " |")
    print(
        "| vs "
        + names[0]
        + " | |"
        + " | ".join(f"{base / sum(r['total'] for r in results[n]):.2f}x" for n in names)
        + " |"
    )
    for n in names:
        rows = results[n]
        decode = sum(r["out"] - 1 for r in rows) / sum(r["total"] - r["ttft"] for r in rows)
        cached = sum(r["cached"] for r in rows) / max(1, sum(r["prompt"] for r in rows))
        ttft = statistics.mean(r["ttft"] for r in rows)
        print(
            f"# {n}: decode {decode:.1f} tok/s over all turns, mean TTFT {ttft:.2f} s, prompt from cache {cached:.0%}"
        )
    print(json.dumps(results), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
