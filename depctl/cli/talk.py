"""``depctl generate`` and ``depctl chat``: talk to a deployment, streaming, with a one-line speed summary."""

from __future__ import annotations

import sys
import time
from typing import Optional

import typer

from depctl import output
from depctl.cli._common import daemon_client, handle_errors
from depctl.client import Client

MAX_TOKENS = typer.Option(256, "--max-tokens", metavar="N", min=1, help="Most tokens to generate.")
TEMPERATURE = typer.Option(0.0, "--temperature", metavar="T", min=0.0, max=2.0, help="0 is greedy.")


def stream_reply(client: Client, path: str, body: dict) -> tuple[str, dict | None]:
    """Print a streamed reply as it arrives; then a summary line on stderr. Returns (text, usage)."""
    t0 = time.perf_counter()
    first = None
    parts, usage = [], None
    for chunk in client.stream(path, {**body, "stream_options": {"include_usage": True}}):
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices", []):
            text = choice.get("delta", {}).get("content") if "delta" in choice else choice.get("text")
            if text:
                if first is None:
                    first = time.perf_counter()
                parts.append(text)
                sys.stdout.write(text)
                sys.stdout.flush()
    elapsed = time.perf_counter() - t0
    sys.stdout.write("\n")
    if usage:
        n = usage["completion_tokens"]
        spec = usage.get("speculation") or {}
        rate = spec.get("acceptance_rate")
        decode = elapsed - (first - t0) if first else elapsed
        # a vLLM deployment's usage has no per-request speculation counts (`deployment get` has its totals)
        acceptance = (
            (
                f" · acceptance {'-' if rate is None else f'{rate:.0%}'} "
                f"({spec.get('accepted_tokens', 0)}/{spec.get('drafted_tokens', 0)} drafted)"
            )
            if spec
            else ""
        )
        output.message(
            (
                f"{n} tokens in {elapsed:.2f}s ({n / elapsed:.1f} tok/s; "
                f"first token {((first or t0) - t0) * 1000:.0f} ms, "
                f"then {max(n - 1, 0) / decode if decode > 0 else 0:.1f} tok/s){acceptance}",
                "dim",
            )
        )
    return "".join(parts), usage


@handle_errors
def generate(
    deployment_id: str = typer.Argument(..., metavar="ID"),
    prompt: str = typer.Argument(..., help="The user message (or raw text with --raw)."),
    max_tokens: int = MAX_TOKENS,
    temperature: float = TEMPERATURE,
    system: Optional[str] = typer.Option(None, "--system", metavar="TEXT", help="A system message."),
    raw: bool = typer.Option(False, "--raw", help="Send PROMPT as plain text to /v1/completions (no chat template)."),
) -> None:
    """One prompt, streamed, then tokens, tokens/s and acceptance rate."""
    client = daemon_client()
    if raw:
        body = {"model": deployment_id, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature}
        stream_reply(client, "/v1/completions", body)
        return
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    body = {"model": deployment_id, "messages": messages, "max_tokens": max_tokens, "temperature": temperature}
    stream_reply(client, "/v1/chat/completions", body)


@handle_errors
def chat(
    deployment_id: str = typer.Argument(..., metavar="ID"),
    max_tokens: int = MAX_TOKENS,
    temperature: float = TEMPERATURE,
    system: Optional[str] = typer.Option(None, "--system", metavar="TEXT", help="A system message."),
) -> None:
    """Interactive chat with a deployment (empty line or Ctrl-D to quit)."""
    client = daemon_client()
    messages = [{"role": "system", "content": system}] if system else []
    console = output.err()
    output.message("Chatting with ", (deployment_id, "bold"), ". Empty line or Ctrl-D to quit.")
    while True:
        try:
            line = console.input("[bold cyan]you>[/] ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        body = {"model": deployment_id, "messages": messages, "max_tokens": max_tokens, "temperature": temperature}
        text, _ = stream_reply(client, "/v1/chat/completions", body)
        messages.append({"role": "assistant", "content": text})
