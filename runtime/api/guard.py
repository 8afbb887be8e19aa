"""The daemon's front door, as one pure ASGI middleware (no buffering, streams pass straight through):

1. **Host header**: on a loopback address only ``localhost``, ``127.0.0.1``, ``::1`` and the bound address are
   answered, so a web page that rebinds its own domain to 127.0.0.1 (DNS rebinding) cannot drive the API from a
   browser. Bound elsewhere, the API key is the protection.
2. **API key**: with one configured, every route but ``/health`` needs ``Authorization: Bearer KEY`` (401 otherwise).
3. **Body size**: a body over ``max_body_bytes`` is refused with 413 from its ``Content-Length``, or as soon as a
   chunked body passes the limit, before it is buffered or parsed.

Refusals use OpenAI's error envelope like every other error.
"""

from __future__ import annotations

import secrets

from starlette.exceptions import HTTPException

from depctl.settings import Settings, is_loopback
from depctl_runtime.api.errors import APIError

OPEN_PATHS = ("/health",)
LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` once a chunked body passes the limit. An HTTPException so that FastAPI's body parsing
    re-raises it (it turns other exceptions into a 400) and the app's handler answers 413 in the envelope."""

    def __init__(self, size: int, limit: int):
        super().__init__(413, _too_large(size, limit).message)


def _hostname(host_header: str) -> str:
    host = host_header.strip().lower()
    if host.startswith("["):  # [::1]:8642
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


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
        refusal = self._refusal(scope, headers)
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

    def _refusal(self, scope, headers: dict) -> APIError | None:
        host = headers.get("host")
        if self.allowed_hosts is not None and host is not None and _hostname(host) not in self.allowed_hosts:
            return APIError(
                400,
                f"the Host header {host!r} is not this daemon's address; it answers requests to "
                f"localhost or {self.settings.host} only (a guard against DNS rebinding)",
                code="invalid_host",
            )
        if self._key is None or scope["path"] in OPEN_PATHS:
            return None
        auth = headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return APIError(
                401,
                "this daemon needs an API key: send `Authorization: Bearer KEY` (the depctl CLI reads "
                "DEPCTL_API_KEY or the running daemon's daemon.json)",
                code="missing_api_key",
            )
        if not secrets.compare_digest(token.strip().encode(), self._key):
            return APIError(401, "the API key is not this daemon's", code="invalid_api_key")
        return None


def _too_large(size: int, limit: int) -> APIError:
    return APIError(
        413,
        f"the request body is {size} bytes or more; this daemon accepts at most {limit} "
        f"(DEPCTL_MAX_BODY_BYTES, or `depctl daemon start --max-body-bytes`)",
        code="request_too_large",
    )


async def _send_error(scope, receive, send, error: APIError) -> None:
    response = error.response()
    if error.status == 401:
        response.headers["www-authenticate"] = "Bearer"
    await response(scope, receive, send)
