"""``depctl daemon start | stop | status | logs``."""

from __future__ import annotations

import time
from typing import Optional

import typer

from depctl import config, output
from depctl.cli._common import handle_errors
from depctl.client import Client, daemon_info, start_daemon, stop_daemon
from depctl.errors import DaemonNotRunning
from depctl.output import Format

app = typer.Typer(help="Run the local runtime daemon that loads deployments and serves the OpenAI API.", no_args_is_help=True)


@app.command()
@handle_errors
def start(port: Optional[int] = typer.Option(None, "--port", min=0, max=65535, help=f"Default: $DEPCTL_PORT or {config.DEFAULT_PORT}.")) -> None:
    """Start the daemon in the background (bound to 127.0.0.1)."""
    info, started = start_daemon(port)
    verb = "Started" if started else "Already running:"
    output.message(f"{verb} depctl daemon on {info.url} (pid {info.pid}, log {config.daemon_log()})")


@app.command()
@handle_errors
def stop() -> None:
    """Stop the daemon; deployments come back from the store when it starts again."""
    info = stop_daemon()
    output.message("No depctl daemon was running." if info is None else f"Stopped depctl daemon (pid {info.pid}).")


@app.command()
@handle_errors
def status(fmt: Format = typer.Option(Format.table, "--output", "-o")) -> None:
    """Is the daemon running, where, and what does it serve."""
    info = daemon_info()
    if info is None:
        raise DaemonNotRunning()
    deployments = Client(info).deployments()
    data = {
        "pid": info.pid, "url": info.url, "uptime_seconds": round(time.time() - info.started_at),
        "home": str(config.home()), "log": str(config.daemon_log()),
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
    lines: int = typer.Option(50, "--lines", "-n", min=1, help="How many lines from the end."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines."),
) -> None:
    """Print the daemon's log."""
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
