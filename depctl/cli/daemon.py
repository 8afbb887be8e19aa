"""``depctl daemon start | stop | status | logs``."""

from __future__ import annotations

import os
import time
from typing import Optional

import typer

from depctl import config, output
from depctl.cli._common import OUTPUT, handle_errors
from depctl.client import Client, daemon_info, start_daemon, stop_daemon
from depctl.errors import DaemonNotRunning, UsageError
from depctl.output import Format
from depctl.settings import SETTINGS, is_loopback

app = typer.Typer(
    rich_markup_mode=None,
    help="Run the local runtime daemon that loads deployments and serves the OpenAI API.",
    no_args_is_help=True,
)


def _setting(name: str):
    """A ``daemon start`` option for one of the daemon's settings: its flag, bound and help come from SETTINGS."""
    s = SETTINGS[name]
    default = (
        ""
        if s.default is None
        else f" (default {s.default:g})"
        if isinstance(s.default, float)
        else f" (default {s.default})"
    )
    return typer.Option(
        None, s.flag, metavar=s.metavar, min=s.minimum, help=f"{s.help[:1].upper()}{s.help[1:]}{default}; ${s.env}."
    )


def _settings_env(flags: dict) -> dict:
    """The daemon's settings among a command's arguments, as environment variables: the API key never shows in
    ``ps``."""
    return {SETTINGS[name].env: str(value) for name, value in flags.items() if name in SETTINGS and value is not None}


PORT = typer.Option(
    None, "--port", metavar="PORT", min=0, max=65535, help=f"Default: $DEPCTL_PORT or {config.DEFAULT_PORT}."
)


@app.command()
@handle_errors
def start(
    port: Optional[int] = PORT,
    host: Optional[str] = _setting("host"),
    api_key: Optional[str] = _setting("api_key"),
    max_body_bytes: Optional[int] = _setting("max_body_bytes"),
    max_prompt_tokens: Optional[int] = _setting("max_prompt_tokens"),
    default_max_tokens: Optional[int] = _setting("default_max_tokens"),
    max_grammar_bytes: Optional[int] = _setting("max_grammar_bytes"),
    grammar_timeout: Optional[float] = _setting("grammar_timeout"),
    load_timeout: Optional[float] = _setting("load_timeout"),
    drain_timeout: Optional[float] = _setting("drain_timeout"),
    foreground: bool = typer.Option(
        False, "--foreground", help="Run in this terminal, logging to it, as `depctl serve` does."
    ),
) -> None:
    """Start the daemon in the background (bound to 127.0.0.1 unless --host)."""
    env = _settings_env(locals())
    if foreground:
        _exec_daemon(port, env)
    info, started = start_daemon(port, env=env)
    if not started:
        output.message(
            f"Already running: depctl daemon on {info.url} (pid {info.pid}, log {config.daemon_log()}); "
            "settings apply at start: `depctl daemon stop` first to change them"
            if env
            else f"Already running: depctl daemon on {info.url} (pid {info.pid}, log {config.daemon_log()})"
        )
        return
    output.message(f"Started depctl daemon on {info.url} (pid {info.pid}, log {config.daemon_log()})")
    bound = host or os.environ.get("DEPCTL_HOST") or config.DEFAULT_HOST
    if not is_loopback(bound) and not (api_key or os.environ.get("DEPCTL_API_KEY")):
        output.message(
            ("Warning: ", "bold red"),
            f"listening on {bound} without an API key: anyone who can reach it can "
            "use every deployment. Restart with --api-key, or without --host.",
        )


@handle_errors
def serve(
    port: Optional[int] = PORT,
    host: Optional[str] = _setting("host"),
    api_key: Optional[str] = _setting("api_key"),
    max_body_bytes: Optional[int] = _setting("max_body_bytes"),
    max_prompt_tokens: Optional[int] = _setting("max_prompt_tokens"),
    default_max_tokens: Optional[int] = _setting("default_max_tokens"),
    max_grammar_bytes: Optional[int] = _setting("max_grammar_bytes"),
    grammar_timeout: Optional[float] = _setting("grammar_timeout"),
    load_timeout: Optional[float] = _setting("load_timeout"),
    drain_timeout: Optional[float] = _setting("drain_timeout"),
) -> None:
    """Run the daemon in the foreground, logging to stderr: what a container or a systemd unit runs. SIGTERM or
    Ctrl-C stops it as `depctl daemon stop` does (running requests get --drain-timeout seconds)."""
    _exec_daemon(port, _settings_env(locals()))


def _exec_daemon(port: int | None, env: dict) -> None:
    """Become the daemon (exec): signals from a container runtime or systemd reach it directly, and its exit status
    is this command's."""
    import sys

    argv = config.python_module("depctl_runtime") + ([] if port is None else ["--port", str(port)])
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, {**os.environ, **env})


@app.command()
@handle_errors
def stop() -> None:
    """Stop the daemon; deployments come back from the store when it starts again."""
    info = stop_daemon()
    output.message("No depctl daemon was running." if info is None else f"Stopped depctl daemon (pid {info.pid}).")


@app.command()
@handle_errors
def status(fmt: Format = OUTPUT) -> None:
    """Is the daemon running, where, and what does it serve."""
    info = daemon_info()
    if info is None:
        raise DaemonNotRunning()
    deployments = Client(info).deployments()
    data = {
        "pid": info.pid,
        "url": info.url,
        "uptime_seconds": round(time.time() - info.started_at),
        "home": str(config.home()),
        "log": info.log or f"the stderr of `depctl serve` (pid {info.pid})",
        "deployments": {d["id"]: d["state"] for d in deployments},
    }

    def table(d):
        t = output.make_table("FIELD", "VALUE")
        for key in ("pid", "url", "uptime_seconds", "home", "log"):
            t.add_row(key, str(d[key]))
        t.add_row("deployments", ", ".join(f"{k} ({v})" for k, v in d["deployments"].items()) or "none")
        return t

    output.emit(data, fmt, table)


@app.command()
@handle_errors
def logs(
    lines: int = typer.Option(50, "--lines", "-n", metavar="N", min=1, help="How many lines from the end."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines."),
) -> None:
    """Print the daemon's log."""
    info = daemon_info()
    if info is not None and info.log is None:
        raise UsageError(
            f"the running daemon (pid {info.pid}) was started by `depctl serve` and logs to that command's stderr, "
            "not to a file",
            "read it where `depctl serve` runs (its terminal, `journalctl`, `docker logs`)",
        )
    path = config.daemon_log()
    if not path.exists():
        output.message(f"No log yet at {path}.")
        return
    with open(path, errors="replace") as fh:
        for line in fh.readlines()[-lines:]:
            print(line, end="")
        while follow:
            line = fh.readline()
            if line:
                print(line, end="", flush=True)
            else:
                time.sleep(0.3)
