"""``python -m depctl_runtime``: the depctl daemon (``depctl daemon start`` runs this in the background).

- **One daemon per home.** It holds ``$DEPCTL_HOME/daemon.lock`` (an OS file lock, released even on kill -9) for
  its whole life; a second one started on the same home reports the first and exits with ``ALREADY_RUNNING``.
- It binds the socket itself before writing ``$DEPCTL_HOME/daemon.json`` ({pid, host, port, ...}, mode 0600 since it
  may hold the API key), so port 0 works (tests use it) and the CLI never reads a port nobody is bound to.
- **Graceful stop** (SIGTERM or SIGINT): it stops accepting connections, answers new requests 503, gives running
  ones ``drain_timeout`` seconds to finish, then cuts the rest with an error (streams get an error event and
  ``[DONE]``), and exits. The specs stay in the store: the next start loads every deployment again.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import time

import uvicorn
from filelock import FileLock, Timeout

from depctl import __version__, config
from depctl.settings import ALREADY_RUNNING, SETTINGS, Settings

log = logging.getLogger("depctl")


def _write_daemon_file(host: str, port: int, settings: Settings) -> None:
    path = config.daemon_file()
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    info = {
        "pid": os.getpid(),
        "host": host,
        "port": port,
        "started_at": time.time(),
        "version": __version__,
        "drain_timeout": settings.drain_timeout,
        "api_key": settings.api_key,
        # where this daemon logs: the file a background start sends it to, or None for `depctl serve`'s stderr
        "log": os.environ.get("DEPCTL_DAEMON_LOG") or None,
    }
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(json.dumps(info))
    os.replace(tmp, path)


def _remove_daemon_file() -> None:
    path = config.daemon_file()
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m depctl_runtime", description="the depctl runtime daemon")
    parser.add_argument(
        "--port",
        type=int,
        default=None,
        help=f"port (default $DEPCTL_PORT or {config.DEFAULT_PORT}; 0 picks a free one)",
    )
    for name, s in SETTINGS.items():
        parser.add_argument(s.flag, dest=name, default=None, metavar=s.metavar, help=f"{s.help} (${s.env})")
    parser.add_argument("--log-level", default="info")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        settings = Settings.resolve({name: getattr(args, name) for name in SETTINGS})
        port = config.default_port() if args.port is None else args.port
    except ValueError as exc:
        print(f"depctl daemon: {exc}", file=sys.stderr)
        return 2

    lock = FileLock(str(config.home() / "daemon.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(
            f"depctl daemon: another daemon already serves {config.home()} ({_describe_running()}); "
            "stop it with `depctl daemon stop`",
            file=sys.stderr,
        )
        return ALREADY_RUNNING
    try:
        return _serve(settings, port)
    finally:
        lock.release()


def _describe_running() -> str:
    from depctl.client import daemon_info

    info = daemon_info()
    return f"pid {info.pid} on {info.url}" if info else "still starting"


def bind(host: str, port: int) -> socket.socket:
    """The daemon's socket, held exclusively from here on: it listens at once. (SO_REUSEADDR lets a restart bind
    while the last run's connections linger; on Linux it also lets two sockets bind one port as long as neither
    listens, and loading the app takes seconds: a second daemon once bound the same port in that window.)"""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def _serve(settings: Settings, port: int) -> int:
    try:
        sock = bind(settings.host, port)
    except OSError as exc:
        print(
            f"depctl daemon: cannot bind {settings.host}:{port}: {exc.strerror}; set DEPCTL_PORT or --port to "
            "another port",
            file=sys.stderr,
        )
        return 1
    host, port = sock.getsockname()[:2]
    if not settings.loopback and not settings.api_key:
        log.warning("!" * 100)
        log.warning(
            "LISTENING ON %s WITHOUT AN API KEY: anyone who can reach this address can use every deployment. "
            "Set DEPCTL_API_KEY (or --api-key), or bind 127.0.0.1.",
            host,
        )
        log.warning("!" * 100)

    from sse_starlette.sse import AppStatus

    from depctl_runtime.api.guard import HttpProtocol
    from depctl_runtime.app import create_app

    # tqdm bars in a log file are noise (load stages are logged instead); read when transformers first loads, so
    # the daemon's start does not import it
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

    AppStatus.disable_automatic_graceful_drain()  # streams end through our drain (an error event, [DONE]), not cut
    app = create_app(settings=settings)
    server = _DrainingServer(
        uvicorn.Config(
            app,
            http=HttpProtocol,
            log_level=logging.getLevelName(log.getEffectiveLevel()).lower(),
            timeout_graceful_shutdown=settings.drain_timeout + 5,
        )
    )
    logging.getLogger("uvicorn.access").addFilter(_quiet_polls)  # after uvicorn configured its loggers
    # uvicorn handles SIGTERM (the drain), then re-raises it for the handler that was there before: make that one a
    # normal exit, so that the daemon file is removed and the exit status says the stop went as planned
    signal.signal(signal.SIGTERM, _stopped)
    _write_daemon_file(host, port, settings)
    log.info(
        "depctl daemon %s listening on http://%s:%d (pid %d, home %s%s)",
        __version__,
        host,
        port,
        os.getpid(),
        config.home(),
        ", API key required" if settings.api_key else "",
    )
    try:
        server.run(sockets=[sock])
    finally:
        _remove_daemon_file()
    return 0


def _quiet_polls(record: logging.LogRecord) -> bool:
    """Leave out of the access log the successful reads the CLI polls (a wait asks four times a second), health
    checks and metric scrapes; requests, writes and every error stay."""
    try:
        _, method, path, _, status = record.args
    except (TypeError, ValueError):
        return True
    polled = path == "/" or path.startswith(("/depctl/v1/deployments", "/health", "/metrics", "/v1/models"))
    return not (method in ("GET", "HEAD") and polled and int(status) < 400)


def _stopped(signum, frame) -> None:
    raise SystemExit(0)


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, which on shutdown closes the listening socket and waits for open requests; first it tells the
    service to refuse new requests and to cut, after the drain timeout, those still running."""

    async def shutdown(self, sockets=None) -> None:
        service = self.config.app.state.service
        drain = self.config.app.state.settings.drain_timeout
        log.info("stopping: running requests get %gs to finish", drain)
        service.begin_drain(drain)
        await super().shutdown(sockets)


if __name__ == "__main__":
    sys.exit(main())
