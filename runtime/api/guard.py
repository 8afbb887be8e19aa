"""The daemon's front door, as one pure ASGI middleware (no buffering, streams pass straight through):

1. **Host header**: on a loopback address a request is answered only with exactly one ``Host`` naming ``localhost``,
   ``127.0.0.1``, ``[::1]`` or the bound address (with a numeric port or none), and a request line in absolute form
   only to one of those, so a web page that rebinds its own domain to 127.0.0.1 (DNS rebinding) cannot drive the API
   from a browser. Bound elsewhere, the API key is the protection.
2. **API key**: with one configured, every route but ``/health`` needs ``Authorization: Bearer KEY`` or, as
   Anthropic's clients send it, ``x-api-key: KEY`` (401 otherwise).
3. **Body size**: a body over ``max_body_bytes`` is refused with 413 from its ``Content-Length``, or as soon as a
   chunked body passes the limit, before it is buffered or parsed.

Refusals use the path's API's error envelope like every other error.
"""

from __future__ import annotations

import hashlib
import secrets
from urllib.parse import urlsplit

from starlette.exceptions import HTTPException
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from depctl.settings import Settings, is_loopback
from depctl_runtime.api.errors import APIError

OPEN_PATHS = ("/", "/health")  # a probe and a health check, which say nothing of what is served
LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` once a chunked body passes the limit. An HTTPException so that FastAPI's body parsing
    re-raises it (it turns other exceptions into a 400) and the app's handler answers 413 in the envelope."""

    def __init__(self, size: int, limit: int):
        super().__init__(413, _too_large(size, limit).message)


TARGET = "depctl.request_target"  # the scope extension HttpProtocol fills in


class HttpProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol, which also hands the app the request line's target as sent: for
    ``GET http://evil.example/v1/models`` the scope's path is ``/v1/models`` and the host it named is lost."""

    def on_headers_complete(self) -> None:
        self.scope.setdefault("extensions", {})[TARGET] = self.url.decode("latin-1")
        super().on_headers_complete()


def _hostname(authority: str) -> str | None:
    """The host of ``host[:port]`` (``[v6]:port`` for IPv6), lower case; None where it is not one."""
    host = authority.strip().lower()
    if host.startswith("["):
        name, bracket, rest = host[1:].partition("]")
        if not bracket:
            return None
    else:
        name, colon, rest = host.partition(":")
        rest = colon + rest
    return name if name and (not rest or (rest[0] == ":" and rest[1:].isdigit())) else None


class Guard:
    def __init__(self, app, settings: Settings):
        self.app = app
        self.settings = settings
        self.allowed_hosts = LOCAL_NAMES | {settings.host.lower()} if is_loopback(settings.host) else None
        self._key = settings.api_key.encode() if settings.api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        hosts = [v.decode("latin-1") for k, v in scope["headers"] if k == b"host"]
        refusal = self._foreign_host(scope, hosts) or self._unauthorized(scope, headers)
        if refusal is None:
            limit = self.settings.max_body_bytes
            length = headers.get("content-length", "")
            if length.isdigit() and int(length) > limit:
                refusal = _too_large(int(length), limit)
        if refusal is not None:
            return await _send_error(scope, receive, send, refusal)
        received, started = 0, False

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(received, limit)
            return message

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await _send_error(scope, receive, send, _too_large(received, limit))

    def _foreign_host(self, scope, hosts: list[str]) -> APIError | None:
        if self.allowed_hosts is None:
            return None
        target = scope.get("extensions", {}).get(TARGET, scope["path"])
        if len(hosts) != 1:
            problem = f"{len(hosts)} Host headers" if hosts else "no Host header"
        elif _hostname(hosts[0]) not in self.allowed_hosts:
            problem = f"the Host header {hosts[0]!r}"
        elif not target.startswith("/") and _hostname(urlsplit(target).netloc) not in self.allowed_hosts:
            problem = f"the request line's URL {target!r}"
        else:
            return None
        return APIError(
            400,
            f"{problem}: this daemon answers requests with one Host header naming localhost, 127.0.0.1, [::1] or "
            f"{self.settings.host} only (a guard against DNS rebinding)",
            code="invalid_host",
        )

    def _unauthorized(self, scope, headers: dict) -> APIError | None:
        if self._key is None or scope["path"] in OPEN_PATHS:
            return None
        token = _presented_key(headers)
        if not token:
            return APIError(
                401,
                "this daemon needs an API key: send `Authorization: Bearer KEY` or `x-api-key: KEY` (the depctl CLI "
                "reads DEPCTL_API_KEY or the running daemon's daemon.json)",
                code="missing_api_key",
            )
        if not secrets.compare_digest(token.encode(), self._key):
            return APIError(401, "the API key is not this daemon's", code="invalid_api_key")
        return None


def _presented_key(headers) -> str:
    """The API key a request presented: ``Authorization: Bearer KEY`` (OpenAI's clients), else ``x-api-key``
    (Anthropic's); "" for none."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("x-api-key", "").strip()


def key_digest(headers) -> str:
    """A digest of the API key a request presented ("" for none): what keeps one key's traffic from informing
    another's (suffix speculation, the prefix cache), without holding the key itself."""
    token = _presented_key(headers)
    return hashlib.sha256(token.encode()).hexdigest()[:16] if token else ""


def _too_large(size: int, limit: int) -> APIError:
    return APIError(
        413,
        f"the request body is {size} bytes or more; this daemon accepts at most {limit} "
        f"(DEPCTL_MAX_BODY_BYTES, or `depctl daemon start --max-body-bytes`)",
        code="request_too_large",
    )


async def _send_error(scope, receive, send, error: APIError) -> None:
    response = error.response(scope["path"])
    if error.status == 401:
        response.headers["www-authenticate"] = "Bearer"
    await response(scope, receive, send)
