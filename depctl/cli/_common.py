"""What every command shares: the error mapping and the daemon hand-off after a store write."""

from __future__ import annotations

import functools
import traceback

import typer

from depctl import config, output
from depctl.client import Client, daemon_info, start_daemon
from depctl.errors import DaemonNotRunning, DepctlError
from depctl.output import Format

# what several commands take, written once
DEPLOYMENT_ID = typer.Argument(..., metavar="ID", help="The deployment's id (`depctl deployment list` shows them).")
OUTPUT = typer.Option(Format.table, "--output", "-o", metavar="[table|json|yaml]", help="table, json or yaml.")
DEVICE_HELP = "auto: a CUDA GPU where torch sees one, else the CPU."


def handle_errors(fn):
    """Map ``DepctlError`` to ``Error: ...`` / ``Hint: ...`` on stderr and its exit code; no traceback unless
    ``DEPCTL_DEBUG=1``."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DepctlError as exc:
            if config.debug():
                traceback.print_exc()
            _print_error(exc.message, exc.hint)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            output.err().print("interrupted")
            raise typer.Exit(130) from None
        except (typer.Exit, typer.Abort):
            raise
        except Exception as exc:  # a bug: say so plainly
            if config.debug():
                raise
            _print_error(f"unexpected {type(exc).__name__}: {exc}", "rerun with DEPCTL_DEBUG=1 for the traceback")
            raise typer.Exit(1) from None

    return wrapper


def _print_error(message: str, hint: str | None) -> None:
    output.message(("Error: ", "bold red"), message)
    if hint:
        output.message(("Hint: ", "yellow"), hint)


def connect(autostart: bool) -> Client | None:
    """A client for the running daemon; start one first when ``autostart`` (and say so), else None."""
    info = daemon_info()
    if info is None and autostart:
        output.message(f"No depctl daemon is running: starting one (log: {config.daemon_log()})")
        info, _ = start_daemon()
        output.message(f"depctl daemon listening on {info.url} (pid {info.pid})")
    return Client(info) if info is not None else None


def daemon_client() -> Client:
    """A client for the running daemon, or ``DaemonNotRunning`` (with its hint) when there is none."""
    client = connect(autostart=False)
    if client is None:
        raise DaemonNotRunning()
    return client
