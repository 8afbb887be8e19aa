"""Errors in OpenAI's envelope: ``{"error": {"message", "type", "param", "code"}}`` with the matching status; on
Anthropic's Messages API paths (``/v1/messages...``) in Anthropic's, ``{"type": "error", "error": {"type",
"message"}}``, so each SDK raises its own matching exception.

Raised as ``APIError`` anywhere below the routes and mapped to a response in exactly one place
(``install_handlers``), so the SDK raises its matching exception (NotFoundError, BadRequestError, ...). Everything
else that can go wrong on the way is mapped here too: an unknown route or method, a body that is not JSON or does not
validate, a body over the size limit, and any bug (a 500 that names the exception, never plain text).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger("depctl.api")

TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable",
    500: "server_error",
}
HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
# pydantic's error types that OpenAI names otherwise; the rest are invalid_type (a *_type error) or invalid_value
VALIDATION_CODES = {"missing": "missing_required_parameter", "extra_forbidden": "unknown_parameter"}
# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors)
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
ANTHROPIC_PATHS = "/v1/messages"


class APIError(Exception):
    """``code`` is required: a client branches on it, and OpenAI's own 400s name one."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict:
        kind = ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, path: str = "") -> JSONResponse:
        """The envelope of the API ``path`` belongs to: Anthropic's on the Messages API, OpenAI's elsewhere."""
        body = self.anthropic_body() if path.startswith(ANTHROPIC_PATHS) else self.body()
        return JSONResponse(body, status_code=self.status)


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":  # loc is ("body", character offset): not a parameter
        where = first.get("loc", ("body", None))[-1]
        detail = (first.get("ctx") or {}).get("error", "JSON decode error")
        return APIError(400, f"the request body is not valid JSON: {detail} at character {where}", code="invalid_json")
    param = _param(first.get("loc", ())) or None
    message = "; ".join(f"{_param(e.get('loc', ())) or 'body'}: {e.get('msg')}" for e in errors[:5])
    kind = first.get("type", "")
    code = VALIDATION_CODES.get(kind, "invalid_type" if kind.endswith("_type") else "invalid_value")
    return APIError(400, message, param=param, code=code)


def _param(loc) -> str:
    """("body", "messages", 0, "content", "str") -> "messages.0.content": the field path without pydantic's union
    member tags (``str``, ``list[int]``, ``function-after[...]``)."""
    tags = {"str", "int", "float", "bool", "list", "dict", "none"}
    return ".".join(str(p) for p in loc if p != "body" and not (isinstance(p, str) and ("[" in p or p in tags)))


def _http_error(request: Request, exc: HTTPException) -> APIError:
    if exc.status_code == 404:
        message = (
            f"no route {request.method} {request.url.path}: the API serves /v1/models, /v1/completions, "
            "/v1/chat/completions, /v1/responses, /v1/messages, /health, /metrics and /depctl/v1/deployments"
        )
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    elif exc.status_code == 400:  # FastAPI's body parsing failed outside the JSON decoder's own errors
        message = f"the request body could not be read as JSON ({exc.detail}; nested too deeply?)"
        return APIError(400, message, code="invalid_json")
    else:
        message = str(exc.detail)
    return APIError(exc.status_code, message, code=HTTP_CODES.get(exc.status_code, "invalid_request"))


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response(request.url.path)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        response = _http_error(request, exc).response(request.url.path)
        if exc.headers:
            response.headers.update(exc.headers)
        return response

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return APIError(
            500,
            f"internal error ({type(exc).__name__}: {exc}); this is a bug in depctl: the daemon log "
            "(`depctl daemon logs`) has the traceback",
            code="internal_error",
        ).response(request.url.path)
