"""HTTP errors in OpenAI's shape {"error": {message, type, param, code}}: ServiceError -> its status,
pydantic's 422 -> 400 naming the field, and RequestGate, which turns away bad API keys (401) and
oversized bodies (413) before a body is parsed."""
from __future__ import annotations

import math
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.protocol import ErrorDetail, ErrorResponse
from server.service import ServiceError, check_api_key

def error_body(exc: ServiceError) -> dict[str, Any]:
    detail = ErrorDetail(message=exc.message, type=exc.type, param=exc.param, code=exc.code)
    return ErrorResponse(error=detail).model_dump()


def error_response(exc: ServiceError) -> JSONResponse:
    headers = {}
    if exc.retry_after_s is not None:
        # Retry-After takes whole seconds; round up so a client never retries too early.
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    return JSONResponse(error_body(exc), status_code=exc.status, headers=headers)


def validation_error(exc: RequestValidationError) -> ServiceError:
    """The first offending field as `param`; the message lists up to three problems."""
    problems: list[str] = []
    param = None
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            return ServiceError(400, f"request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}",
                                code="invalid_json")
        if not loc:
            return ServiceError(400, "request body must be a JSON object sent with Content-Type: application/json",
                                code="invalid_value")
        # A union field (prompt, stop, content) reports once per branch; the branch name is noise.
        field = ".".join(p for p in loc if not _is_type_tag(p))
        param = param or field
        text = f"{field}: {err['msg']}"
        if text not in problems:
            problems.append(text)
    return ServiceError(400, "; ".join(problems[:3]) or "invalid request", param=param, code="invalid_value")


_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|function-.*)$")


def _is_type_tag(part: str) -> bool:
    return bool(_TYPE_TAG.match(part))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(_: Request, exc: ServiceError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = error_response(ServiceError(exc.status_code, str(exc.detail), code=None))
        for key, value in (exc.headers or {}).items():
            response.headers[key] = value
        return response

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after answering, so uvicorn still logs the traceback.
        return error_response(ServiceError(500, f"internal server error: {type(exc).__name__}", code="internal_error"))


class RequestGate:
    """ASGI middleware on /v1/*: API key, then body size, before FastAPI parses anything.

    Pure ASGI (not BaseHTTPMiddleware) so `receive` keeps reporting the client's disconnect.
    """

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        try:
            check_api_key(self.api_key, _bearer(headers.get("authorization")))
            if scope["method"] in ("POST", "PUT", "PATCH"):
                body = await self._read_body(headers, receive)
                if body is None:
                    return  # the client left while sending
                receive = _replay(body, receive)
        except ServiceError as exc:
            await error_response(exc)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _read_body(self, headers: Headers, receive: Receive) -> bytes | None:
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self._too_large(int(declared))
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:  # chunked uploads have no Content-Length to check up front
                raise self._too_large(size)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self, size: int) -> ServiceError:
        return ServiceError(413, f"request body of {size} bytes exceeds the limit of {self.max_body_bytes} bytes",
                            code="request_too_large")


def _bearer(value: str | None) -> str | None:
    if value is None:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _replay(body: bytes, receive: Receive) -> Receive:
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        # After the body, fall through to the server: that is where http.disconnect arrives.
        return pending.pop() if pending else await receive()

    return replayed
