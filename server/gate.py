"""The HTTP edge, before and around the routes: RequestGate (API key 401, body size 413, body read
timeout 408, compressed 415, unparseable JSON 400), a uvicorn protocol with a request-head read
timeout (slowloris) and directly framed chunked body writes (chunked_send), and the handlers that
answer every error in OpenAI's shape {"error": {message, type, param, code}}."""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
import h11
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

from slipstream.engine.errors import InvalidParam
from slipstream.server.errors import ServiceError, bearer_token, check_api_key, parse_input, retry_after, service_error
from slipstream.server.metrics import ResponseCounts
from slipstream.server.protocol import ErrorDetail, ErrorResponse

log = logging.getLogger(__name__)


def error_body(exc: ServiceError) -> dict[str, Any]:
    detail = ErrorDetail(message=exc.message, type=exc.type, param=exc.param, code=exc.code)
    return ErrorResponse(error=detail).model_dump()


def error_response(exc: ServiceError) -> JSONResponse:
    headers = {} if exc.retry_after_s is None else {"Retry-After": retry_after(exc.retry_after_s)}
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


_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|function-.*|constrained-.*)$")


def _is_type_tag(part: str) -> bool:
    return bool(_TYPE_TAG.match(part))


_HTTP_CODES = {400: "invalid_json", 404: "not_found", 405: "method_not_allowed"}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(_: Request, exc: ServiceError) -> JSONResponse:
        return error_response(exc)

    # Registered by class, not left to the Exception handler: Starlette re-raises what reaches that
    # one after answering, and uvicorn then closes the client's keep-alive connection.
    @app.exception_handler(InvalidParam)
    async def _invalid_param(_: Request, exc: InvalidParam) -> JSONResponse:
        return error_response(service_error(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Starlette's own refusals (no such route, wrong method; FastAPI: a body it cannot parse)
        code = _HTTP_CODES.get(exc.status_code, "invalid_request" if exc.status_code < 500 else "internal_error")
        response = error_response(ServiceError(exc.status_code, str(exc.detail), code=code))
        for key, value in (exc.headers or {}).items():
            response.headers[key] = value
        return response

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # service_error logs the traceback; the client gets no exception text.
        return error_response(service_error(exc))


class CountResponses:
    """Outermost ASGI middleware: counts every HTTP response (route template, status class, error
    code) and answers an exception no handler caught with a 500 itself. Starlette's last-resort
    handler answers too, but then re-raises, and uvicorn closes the keep-alive connection."""

    def __init__(self, app: ASGIApp, *, counts: ResponseCounts) -> None:
        self.app = app
        self.counts = counts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        seen: dict[str, Any] = {"status": None, "code": None, "error_body": False}

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
                seen["error_body"] = message["status"] >= 400
            elif message["type"] == "http.response.body" and seen["error_body"]:
                seen["error_body"] = False  # our error bodies are one small JSON message
                seen["code"] = _error_code(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception as exc:  # noqa: BLE001 - last resort: logged by service_error, answered here
            if seen["status"] is not None:
                raise  # the response has started: nothing else can be sent
            await error_response(service_error(exc))(scope, receive, counted)
        finally:
            if seen["status"] is not None:
                self.counts.count_http(scope["path"], seen["status"], seen["code"])


def _error_code(body: bytes) -> str | None:
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) else None


# outside /v1/ (vLLM's and llama.cpp's paths), gated like it
GATED_PATHS = ("/tokenize", "/detokenize", "/completion", "/completions", "/infill", "/apply-template", "/props")
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")  # Anthropic's API: its key header, its error shape


class RequestGate:
    """ASGI middleware on /v1/* and GATED_PATHS: API key, then the body (size limit and read deadline), before
    FastAPI parses anything.

    Pure ASGI (not BaseHTTPMiddleware) so `receive` keeps reporting the client's disconnect.
    """

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int, body_timeout_s: float) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not (scope["path"].startswith("/v1/") or scope["path"] in GATED_PATHS):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        try:
            check_api_key(self.api_key, presented_key(headers, scope["path"]))
            if scope["method"] in ("POST", "PUT", "PATCH"):
                try:
                    async with asyncio.timeout(self.body_timeout_s):
                        body = await self._read_body(headers, receive)
                except TimeoutError:
                    raise ServiceError(408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                                       code="request_timeout") from None
                if body is None:
                    return  # the client left while sending
                _check_body(headers, body)
                receive = _replay(body, receive)
        except ServiceError as exc:
            response = error_response(exc)
            if exc.status in (408, 413):
                response.headers["Connection"] = "close"  # the rest of the body is not worth reading
            await response(scope, receive, send)
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


def client_of(request: Request, user: str | None) -> str:
    """Who a request counts against for --max-requests-per-client: its `user` field, else the API
    key it presents, else its address (the key is hashed so that it is never held as a dict key)."""
    if user:
        return f"user:{user}"
    token = presented_key(request.headers, request.url.path)
    if token:
        return "key:" + hashlib.sha256(token.encode()).hexdigest()[:16]
    return f"addr:{request.client.host if request.client else 'unknown'}"


def presented_key(headers: Headers, path: str) -> str | None:
    """The API key a request presents: 'Authorization: Bearer <key>', or on Anthropic's routes its x-api-key header
    (what the anthropic SDK sends)."""
    token = bearer_token(headers.get("authorization"))
    if token is None and path in ANTHROPIC_PATHS:
        token = headers.get("x-api-key")
    return token


def _check_body(headers: Headers, body: bytes) -> None:
    """Refuse what FastAPI would misread: a compressed body (it does not decode one, so gzip bytes
    are "not JSON" while plain JSON labelled gzip passes), and JSON that Python's json reads only
    with a crash (too deep, too many digits) or as non-finite floats (NaN, Infinity)."""
    encoding = headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise ServiceError(415, f"Content-Encoding {encoding!r} is not supported; send the body uncompressed "
                           "(Content-Encoding: identity)", code="unsupported_media_type")
    if body and _is_json(headers.get("content-type")):
        try:
            parse_input("request body", "JSON", _strict_json, body)
        except InvalidParam as exc:
            raise ServiceError(400, exc.message, code="invalid_json") from None


def _is_json(content_type: str | None) -> bool:
    """FastAPI's rule: no Content-Type, application/json, or application/*+json is read as JSON."""
    if not content_type:
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _strict_json(body: bytes) -> object:
    return json.loads(body, parse_constant=_non_finite)


def _non_finite(name: str) -> float:
    raise ValueError(f"{name} is not allowed: JSON numbers must be finite")


def _replay(body: bytes, receive: Receive) -> Receive:
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        # After the body, fall through to the server: that is where http.disconnect arrives.
        return pending.pop() if pending else await receive()

    return replayed


def chunked_send(cycle: RequestResponseCycle) -> Send:
    """`cycle.send` with a shortcut for a chunked response's body chunks (an SSE stream's events, one per
    stream per step): the chunk framed as h11 frames it (size in hex, CRLF, data, CRLF) and written at
    once, instead of through uvicorn's send and h11's event and state machine each time (at 128 streams
    that was a sixth of the event loop's time). A Data event changes no h11 state, so h11 sends the end
    of the body as before. Taken only after h11 framed a body chunk exactly so in this response (never
    for a Content-Length or HTTP/1.0 body), and with uvicorn's send conditions checked as it checks them
    (write paused, disconnected, response not started or complete, HEAD)."""
    slow = cycle.send
    chunked = False

    async def send(message: Message) -> None:
        nonlocal chunked
        if (message["type"] != "http.response.body" or not message.get("more_body", False) or cycle.disconnected
                or cycle.flow.write_paused or not cycle.response_started or cycle.response_complete
                or cycle.scope["method"] == "HEAD"):
            await slow(message)
            return
        body = message.get("body", b"")
        if not body:
            return  # h11 writes nothing for an empty chunk, whatever the framing
        framed = b"%x\r\n%b\r\n" % (len(body), body)
        if not chunked:
            output = cycle.conn.send(event=h11.Data(data=body))
            chunked = output == framed
            cycle.transport.write(output)
            return
        cycle.transport.write(framed)

    return send


def head_timeout_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline on each request head (request line + headers), and its
    responses' body chunks written through chunked_send.

    uvicorn has none: its keep-alive timer stops at the first byte, so a client trickling a
    header byte at a time (slowloris) holds the connection forever. The clock starts when the
    connection opens or the previous response ends, and stops when a whole head has arrived.
    """
    if not header_timeout_s > 0:
        raise ValueError(f"header timeout must be > 0 seconds, got {header_timeout_s}")

    class HeadTimeoutH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_timer()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a whole request head arrived
                self._disarm_head_timer()
                # before its task first runs, which reads cycle.send to hand the app
                self.cycle.send = chunked_send(self.cycle)  # type: ignore[method-assign]

        def on_response_complete(self) -> None:
            # Armed before super(), which may start a pipelined request (and so disarm it).
            self._arm_head_timer()
            super().on_response_complete()

        def _arm_head_timer(self) -> None:
            self._disarm_head_timer()
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timed_out)

        def _disarm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                log.info("closing a connection whose request head took over %.1f s", header_timeout_s)
                self.transport.close()

    return HeadTimeoutH11Protocol
