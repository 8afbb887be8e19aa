"""``depctl generate`` and ``depctl chat``: talk to a deployment, streaming, with a one-line speed summary.

The chat keeps to what ``ollama run`` users expect: line editing and a history kept across sessions
(prompt_toolkit), ``\"\"\"`` for a multi-line message, ``/bye`` or Ctrl-D to leave, Ctrl-C to stop an answer (not
the chat), and a piped stdin answered once without a prompt.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import typer

from depctl import config, output
from depctl.cli import views
from depctl.cli._common import DEPLOYMENT_ID, daemon_client, handle_errors
from depctl.client import Client
from depctl.errors import DepctlError, NotFoundError, UsageError

MAX_TOKENS = typer.Option(256, "--max-tokens", metavar="N", min=1, help="Most tokens to generate.")
TEMPERATURE = typer.Option(0.0, "--temperature", metavar="T", min=0.0, max=2.0, help="0 is greedy.")
SYSTEM = typer.Option(None, "--system", metavar="TEXT", help="A system message.")
MULTILINE = '"""'
CHAT_HELP = """Commands:
  /bye            leave (Ctrl-D too)
  /clear          forget the conversation so far
  /system TEXT    set the system message (and forget the conversation)
  /set temperature T | /set max_tokens N
  /?              this help
A message that starts with \"\"\" continues until a line that ends with \"\"\".
Ctrl-C stops an answer; the chat goes on."""


@dataclass
class Reply:
    text: str
    usage: dict | None
    stopped: bool = False  # Ctrl-C ended it early


@dataclass
class Timing:
    """When a streamed reply's pieces arrived, for the summary line."""

    start: float = field(default_factory=time.perf_counter)
    first: float | None = None
    last: float | None = None
    chunks: int = 0

    def piece(self) -> None:
        now = time.perf_counter()
        self.first = self.first or now
        self.last = now
        self.chunks += 1

    def summary(self, usage: dict | None) -> str:
        elapsed = time.perf_counter() - self.start
        if not usage:
            return f"{elapsed:.2f}s"
        n = usage["completion_tokens"]
        line = f"{n} tokens in {elapsed:.2f}s ({n / elapsed:.1f} tok/s"
        if self.first is not None:
            line += f"; first token {(self.first - self.start) * 1000:.0f} ms"
            # a decode rate needs tokens spread over time: speculation can deliver a short answer in one chunk
            spread = (self.last or self.first) - self.first
            if self.chunks >= 3 and spread > 0.05:
                line += f", then {(n - n / self.chunks) / spread:.1f} tok/s"
        line += ")"
        spec = usage.get("speculation") or {}
        if spec:  # a vLLM deployment's usage has no per-request speculation counts (`deployment get` has its totals)
            rate = spec.get("acceptance_rate")
            line += (
                f" · acceptance {'-' if rate is None else f'{rate:.0%}'} "
                f"({spec.get('accepted_tokens', 0)}/{spec.get('drafted_tokens', 0)} drafted)"
            )
        return line


LOAD_WAIT = 3600.0  # the daemon fails a load that overruns its own --load-timeout; this only bounds a lost daemon


def wait_until_serving(client: Client, deployment_id: str) -> None:
    """A deployment that is loading (or unloaded by its keep-alive, which this loads again) is waited for here, its
    stage shown on stderr, so that the request's first token is not the load's time."""
    status = client.deployment(deployment_id)
    if status is None or status["state"] not in ("IDLE", "CREATING"):
        return  # serving, or a state the request itself explains (FAILED, unknown)
    why = ""
    if status["state"] == "IDLE":
        why = " (unloaded after keep-alive)"
        status = client.wake(deployment_id)
    with output.progress() as progress:
        task = progress.add_task(f"loading {deployment_id}{why}", total=None)

        def show(status: dict | None) -> None:
            if status:
                line, fraction = views.wait_line(deployment_id, status)
                stage = line.removeprefix(f"{deployment_id}: ")
                progress.update(
                    task,
                    description=f"loading {deployment_id}{why}: {stage}",
                    total=1 if fraction is not None else None,
                )
                progress.update(task, completed=fraction or 0)

        show(status)
        client.wait_settled(deployment_id, LOAD_WAIT, on_poll=show)


def stream_reply(client: Client, path: str, body: dict) -> Reply:
    """Print a streamed reply as it arrives, then a summary line on stderr. Ctrl-C stops the reply (the connection
    closes, which cancels the request) and returns what came so far."""
    wait_until_serving(client, body["model"])
    timing, parts, usage, stopped, finish = Timing(), [], None, False, None
    chunks = client.stream(path, {**body, "stream_options": {"include_usage": True}})
    try:
        for chunk in chunks:
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                finish = choice.get("finish_reason") or finish
                text = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
                if text:
                    timing.piece()
                    parts.append(text)
                    sys.stdout.write(text)
                    sys.stdout.flush()
    except KeyboardInterrupt:
        stopped = True
        chunks.close()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if stopped:
        output.message(("(stopped)", "dim"))
    else:
        output.message((timing.summary(usage), "dim"))
        if finish == "length":
            output.message(
                (
                    f"(cut off at the {body.get('max_tokens')}-token limit: raise --max-tokens, or /set max_tokens)",
                    "yellow",
                )
            )
    return Reply("".join(parts), usage, stopped)


def _prompt_from(prompt: str | None) -> str:
    """PROMPT, or stdin when it is ``-`` or missing and something is piped in."""
    if prompt is not None and prompt != "-":
        return prompt
    if sys.stdin.isatty():
        raise UsageError(
            "no prompt given", 'pass one (`depctl generate ID "Hello"`) or pipe it in (`echo Hello | ...`)'
        )
    text = sys.stdin.read()
    if not text.strip():
        raise UsageError("the prompt read from stdin is empty", "pipe some text in, or pass PROMPT")
    return text


@handle_errors
def generate(
    deployment_id: str = DEPLOYMENT_ID,
    prompt: Optional[str] = typer.Argument(
        None, metavar="PROMPT", help="The user message (or raw text with --raw); - or none: read stdin."
    ),
    max_tokens: int = MAX_TOKENS,
    temperature: float = TEMPERATURE,
    system: Optional[str] = SYSTEM,
    raw: bool = typer.Option(False, "--raw", help="Send PROMPT as plain text to /v1/completions (no chat template)."),
) -> None:
    """One prompt, streamed, then tokens, tokens/s and acceptance rate."""
    prompt = _prompt_from(prompt)
    client = daemon_client()
    if raw:
        body = {"model": deployment_id, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature}
        stream_reply(client, "/v1/completions", body)
        return
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    body = {"model": deployment_id, "messages": messages, "max_tokens": max_tokens, "temperature": temperature}
    stream_reply(client, "/v1/chat/completions", body)


@dataclass
class ChatSession:
    deployment_id: str
    max_tokens: int
    temperature: float
    system: str | None = None
    messages: list[dict] = field(default_factory=list)

    def body(self) -> dict:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return {
            "model": self.deployment_id,
            "messages": system + self.messages,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
        }

    def command(self, line: str) -> bool:
        """Apply a /command; False when it ends the chat."""
        name, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        if name in ("/bye", "/exit", "/quit"):
            return False
        if name == "/clear":
            self.messages.clear()
            output.message(("Cleared the conversation.", "dim"))
        elif name == "/system":
            self.system, self.messages = arg or None, []
            output.message(("System message set; conversation cleared." if arg else "System message removed.", "dim"))
        elif name == "/set":
            self._set(arg)
        elif name in ("/?", "/help"):
            output.message(CHAT_HELP)
        else:
            output.message(("Unknown command ", "yellow"), name, ("; /? lists them.", "yellow"))
        return True

    def _set(self, arg: str) -> None:
        key, _, value = arg.partition(" ")
        try:
            if key == "temperature" and 0 <= float(value) <= 2:
                self.temperature = float(value)
            elif key == "max_tokens" and int(value) >= 1:
                self.max_tokens = int(value)
            else:
                raise ValueError
        except ValueError:
            output.message(("Usage: /set temperature 0-2 | /set max_tokens N (at least 1)", "yellow"))
            return
        output.message((f"Set {key} to {value}.", "dim"))


def history_file() -> Path:
    """What the user typed in earlier chats: private to them (0600), as prompt recordings are."""
    path = config.home() / "chat_history"
    path.parent.mkdir(parents=True, exist_ok=True)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
    path.chmod(0o600)  # (a history an older depctl made readable by everyone)
    return path


def _read_message(session) -> str | None:
    """One user message from the prompt (\"\"\" blocks joined); None at Ctrl-D. Ctrl-C at the prompt says how
    to leave, as ollama does."""
    while True:
        try:
            line = session.prompt(">>> ")
        except KeyboardInterrupt:
            output.message(("Use Ctrl-D or /bye to leave.", "dim"))
            continue
        except EOFError:
            return None
        if not line.startswith(MULTILINE):
            return line
        lines = [line[len(MULTILINE) :]]
        while not lines[-1].rstrip().endswith(MULTILINE) or len(lines) == 1 and lines[0].strip() == "":
            try:
                lines.append(session.prompt("... "))
            except KeyboardInterrupt:
                lines = None
                break
            except EOFError:
                return None
        if lines is None:
            continue
        lines[-1] = lines[-1].rstrip()[: -len(MULTILINE)]
        return "\n".join(lines)


@handle_errors
def chat(
    deployment_id: str = DEPLOYMENT_ID,
    max_tokens: int = MAX_TOKENS,
    temperature: float = TEMPERATURE,
    system: Optional[str] = SYSTEM,
) -> None:
    """Chat with a deployment: /? for commands, /bye or Ctrl-D to leave, Ctrl-C stops an answer. With stdin piped
    in, answer it once and exit."""
    client = daemon_client()
    chat_session = ChatSession(deployment_id, max_tokens, temperature, system)
    if not sys.stdin.isatty():
        chat_session.messages.append({"role": "user", "content": _prompt_from(None)})
        stream_reply(client, "/v1/chat/completions", chat_session.body())
        return
    if client.deployment(deployment_id) is None:  # before the first prompt, not after it
        raise NotFoundError(f"no deployment {deployment_id!r}", "see `depctl deployment list`")
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory

    prompt_session = PromptSession(history=FileHistory(str(history_file())))
    output.message("Chatting with ", (deployment_id, "bold"), ". /? for help, /bye or Ctrl-D to leave.")
    while (line := _read_message(prompt_session)) is not None:
        if not line.strip():
            continue
        if line.startswith("/") and not line.startswith(MULTILINE):
            if not chat_session.command(line):
                break
            continue
        chat_session.messages.append({"role": "user", "content": line})
        try:
            reply = stream_reply(client, "/v1/chat/completions", chat_session.body())
        except DepctlError as exc:  # a refused turn (too long, the deployment updating): the chat goes on
            output.message(("Error: ", "bold red"), exc.message)
            chat_session.messages.pop()
            continue
        if reply.text:  # a stopped answer stays as far as it was shown, so the next turn follows what was read
            chat_session.messages.append({"role": "assistant", "content": reply.text})
        else:
            chat_session.messages.pop()
