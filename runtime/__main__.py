"""``python -m runtime``: the depctl daemon (``depctl daemon start`` runs this in the background).

It binds the socket itself before writing ``$DEPCTL_HOME/daemon.json`` ({pid, host, port, ...}), so port 0 works
(tests use it) and the CLI never reads a port nobody is bound to.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time

from depctl import __version__, config


def _write_daemon_file(host: str, port: int) -> None:
    path = config.daemon_file()
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(
        json.dumps({"pid": os.getpid(), "host": host, "port": port, "started_at": time.time(), "version": __version__})
    )
    os.replace(tmp, path)


def _remove_daemon_file() -> None:
    path = config.daemon_file()
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime", description="the depctl runtime daemon")
    parser.add_argument("--host", default=config.DEFAULT_HOST, help="address to bind (default 127.0.0.1: local only)")
    parser.add_argument("--port", type=int, default=None, help=f"port (default $DEPCTL_PORT or {config.DEFAULT_PORT}; 0 picks a free one)")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    port = config.default_port() if args.port is None else args.port

    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, port))
    except OSError as exc:
        print(f"depctl daemon: cannot bind {args.host}:{port}: {exc.strerror}; set DEPCTL_PORT or --port to another port",
              file=sys.stderr)
        return 1
    host, port = sock.getsockname()[:2]

    import uvicorn

    from runtime.app import create_app

    app = create_app()
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5))
    _write_daemon_file(host, port)
    logging.getLogger("depctl").info("depctl daemon %s listening on http://%s:%d (pid %d, home %s)",
                                     __version__, host, port, os.getpid(), config.home())
    try:
        server.run(sockets=[sock])
    finally:
        _remove_daemon_file()
    return 0


if __name__ == "__main__":
    sys.exit(main())
