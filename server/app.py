"""FastAPI app: OpenAI /v1 routes (JSON and SSE), health/ready/metrics (server/http_server.py runs it, with its drain).

Routes only translate between HTTP and the service (request preparation in server/openai_api.py, response shapes
in server/openai_formats.py; the Responses and Anthropic APIs in their own modules); engine logic stays out of here.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from slipstream.server.anthropic import CountTokensRequest, MessagesRequest, translate as translate_messages
from slipstream.server.anthropic_output import (AnthropicError, AnthropicErrors, CountTokensResponse, MessageFormat,
                                                MessageObject)
from slipstream.server.embeddings import Embedder
from slipstream.server.errors import service_error
from slipstream.server.http_streams import (EventStream, admitted, collect_unless_disconnected, json_response,
                                             unless_disconnected)
from slipstream.server.gate import CountResponses, RequestGate, client_of, error_body, install_error_handlers
from slipstream.server.lora import LoraUsage
from slipstream.server.lora_routes import add_lora_routes
from slipstream.server.metrics import Metrics
from slipstream.server.openai_api import prepare_chat, prepare_completion
from slipstream.server.openai_formats import ChatFormat, CompletionFormat, sse_event
from slipstream.server.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse,
                             EmbeddingRequest, EmbeddingResponse, ErrorResponse, ModelCard, ModelList)
from slipstream.server.response_store import ResponseStore
from slipstream.server.responses import ResponsesRequest, translate
from slipstream.server.responses_output import ResponseFormat, ResponseObject
from slipstream.server.generation import Generation
from slipstream.server.service import Service
from slipstream.server.llamacpp_routes import add_llamacpp_routes
from slipstream.server.tokenize_routes import add_tokenize_routes

_STATIC = Path(__file__).with_name("static")
# The chat page runs only its own files: no inline script or style, no other origin, no framing.
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


def _error(description: str, **extra: Any) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description, **extra}


# What the /v1 routes really answer besides 200 (the OpenAPI document lists these, and no 422).
_V1_ERRORS: dict[int | str, dict[str, Any]] = {
    400: _error("Invalid request: `error.param` names the field; `error.code` is invalid_value, invalid_json, "
                "unsupported or context_length_exceeded."),
    401: _error("Missing or wrong API key (when the server has one): send 'Authorization: Bearer <key>'."),
    404: _error("The `model` field names a model this server does not serve."),
    408: _error("The request body did not arrive within the body read timeout."),
    413: _error("The request body exceeds the size limit."),
    415: _error("The body is compressed (Content-Encoding other than identity); send it uncompressed."),
    429: _error("The waiting queue is full; retry after the Retry-After header's seconds.",
                headers={"Retry-After": {"description": "Seconds to wait before retrying (whole, rounded up).",
                                         "schema": {"type": "integer"}}}),
    500: _error("An unexpected server error; the details are in the server's log, not in the response."),
    503: _error("Not ready, shutting down, or the engine failed; retry on another replica."),
}


# One server-sent event (the schema applies per event, as OpenAPI 3.2's itemSchema does).
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {
    "type": "string", "description": "A chunk as JSON (the response's shape, one choice delta per chunk; a body "
    "with `error` if the request fails mid-stream), or `[DONE]` last."}}}


def _generation_responses(model: type[BaseModel], events: str = "chunks in the same shape, ending with "
                          "`data: [DONE]`") -> dict[int | str, dict[str, Any]]:
    return {200: {"model": model, "description": f"The reply; with `stream: true`, server-sent events of {events}.",
                  "content": {"text/event-stream": {"schema": _SSE_EVENT}}}, **_V1_ERRORS}


def create_app(service: Service, *, api_key: str | None, max_body_bytes: int = 1 << 20,
               body_timeout_s: float = 30.0, web_ui: bool = True, lora_updates: bool = False,
               pooling: str = "last") -> FastAPI:
    """`web_ui`: serve the chat page at / and /chat (static files; --no-web-ui turns it off).
    `lora_updates`: the runtime LoRA endpoints (--enable-lora-runtime-updates; needs service.lora).
    `pooling`: how /v1/embeddings pools a prompt's hidden states (server/embeddings.py: "last" or "mean")."""
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    if not body_timeout_s > 0:
        raise ValueError(f"body_timeout_s must be > 0, got {body_timeout_s}")
    app = FastAPI(title="Slipstream", docs_url=None, redoc_url=None)
    app.state.service = service
    app.state.api_key = api_key  # the gRPC front end checks the same key
    app.state.metrics = metrics = Metrics(service.scheduler, lambda: service.engine.compile_count, service.responses)
    app.add_middleware(RequestGate, api_key=api_key, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s)
    app.add_middleware(CountResponses, counts=service.responses)  # sees the gate's answers too
    app.add_middleware(AnthropicErrors)  # outermost: Anthropic's routes' errors in their shape, once counted
    install_error_handlers(app)
    created = int(time.time())
    if service.lora is not None:
        service.lora_usage = LoraUsage(service.lora)
        metrics.registry.register(service.lora_usage)
        if lora_updates:
            add_lora_routes(app, service.lora, service.model_name)

    add_tokenize_routes(app, service)
    add_llamacpp_routes(app, service)

    @app.get("/health", responses={200: {"description": "The process is alive."}})
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready", responses={200: {"description": "Serving."},
                                  503: {"description": "Not ready: compiling, draining or the engine failed."}})
    async def ready() -> JSONResponse:
        ok = service.ready
        return JSONResponse({"status": "ready" if ok else "not ready"}, status_code=200 if ok else 503)

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition format.",
                              "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics_text() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def card(adapter: Any = None) -> ModelCard:
        if adapter is not None:  # a LoRA adapter: its base model is the parent
            return ModelCard(id=adapter.name, created=created, max_model_len=service.max_seq_len,
                             root=adapter.name, parent=service.model_name)
        return ModelCard(id=service.model_name, created=created, max_model_len=service.max_seq_len)

    @app.get("/v1/models", response_model=ModelList, responses={401: _V1_ERRORS[401]})
    async def models() -> dict[str, Any]:
        adapters = [] if service.lora is None else [service.lora.get(n) for n in service.lora.names()]
        return ModelList(data=[card(), *(card(a) for a in adapters if a is not None)]).model_dump()

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses={k: _V1_ERRORS[k] for k in (401, 404)})
    async def model(model: str) -> dict[str, Any]:
        return card(service.check_model(model)).model_dump()

    @app.post("/v1/completions", response_model=None, responses=_generation_responses(CompletionResponse))
    async def completions(body: CompletionRequest, request: Request) -> Response:
        gen = await service.start(lambda: prepare_completion(service, body), client_of(request, body.user))
        fmt = CompletionFormat(service, gen, body)
        if body.stream:
            return await _event_stream_once_admitted(gen, fmt, _include_usage(body))
        choices = await collect_unless_disconnected(request, gen)
        return json_response(fmt.response(choices))

    embedder = Embedder(service, pooling)

    @app.post("/v1/embeddings", response_model=EmbeddingResponse,
              responses={200: {"description": "One embedding per input, in input order."}, **_V1_ERRORS})
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return json_response(await unless_disconnected(request, embedder.embed(body, client_of(request, body.user))))

    @app.post("/v1/chat/completions", response_model=None, responses=_generation_responses(ChatCompletionResponse))
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        gen = await service.start(lambda: prepare_chat(service, body), client_of(request, body.user))
        fmt = ChatFormat(service, gen, body)
        if body.stream:
            return await _event_stream_once_admitted(gen, fmt, _include_usage(body))
        choices = await collect_unless_disconnected(request, gen)
        return json_response(fmt.response(choices))

    @app.post("/v1/responses", response_model=None, responses=_generation_responses(
        ResponseObject, "OpenAI's typed events (`event: <type>`), response.created to response.completed"))
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        translation = translate(body, stored)
        gen = await translation.start(service, client_of(request, body.user))
        fmt = ResponseFormat(service, gen, body, translation, stored)
        if body.stream:
            await admitted(gen)
            return EventStream(fmt.events(gen.deltas()), gen.cancel)
        return json_response(fmt.response(await collect_unless_disconnected(request, gen)))

    stored = ResponseStore()  # in memory, for previous_response_id

    @app.get("/v1/responses/{response_id}", response_model=ResponseObject, responses={
        k: _V1_ERRORS[k] if k != 404 else _error("No such response is kept.") for k in (401, 404)})
    async def stored_response(response_id: str) -> Response:
        return Response(stored.get(response_id).body, media_type="application/json")

    @app.delete("/v1/responses/{response_id}", responses={
        k: _V1_ERRORS[k] if k != 404 else _error("No such response is kept.") for k in (401, 404)})
    async def delete_response(response_id: str) -> dict[str, Any]:
        stored.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    anthropic_errors = {k: {**v, "model": AnthropicError} for k, v in _V1_ERRORS.items()}
    anthropic_errors[400] = _error("Invalid request: `error.message` starts with the field.", model=AnthropicError)
    anthropic_errors[401] = _error("Missing or wrong API key (when the server has one): send 'x-api-key: <key>' or "
                                   "'Authorization: Bearer <key>'.", model=AnthropicError)

    @app.post("/v1/messages", response_model=None, responses={**_generation_responses(
        MessageObject, "Anthropic's typed events (`event: <type>`), message_start to message_stop"),
        **anthropic_errors})
    async def messages(body: MessagesRequest, request: Request) -> Response:
        translation = translate_messages(body)
        gen = await translation.start(service, client_of(request, translation.chat.user))
        fmt = MessageFormat(service, gen, body, translation)
        if body.stream:
            await admitted(gen)
            return EventStream(fmt.events(gen.deltas()), gen.cancel)
        return json_response(fmt.message(await collect_unless_disconnected(request, gen)))

    @app.post("/v1/messages/count_tokens", response_model=CountTokensResponse, responses=anthropic_errors)
    async def count_tokens(body: CountTokensRequest) -> CountTokensResponse:
        return CountTokensResponse(input_tokens=await asyncio.to_thread(translate_messages(body).count, service))

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            # FastAPI adds a 422 to every route with a body; validation errors are 400s here.
            for path in schema["paths"].values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    if web_ui:
        _add_chat_page(app)
    return app


def _add_chat_page(app: FastAPI) -> None:
    """The chat page: read once here, so serving it is a static answer (the browser calls /v1 itself)."""
    page = (_STATIC / "chat.html").read_bytes()

    @app.get("/", include_in_schema=False)
    @app.get("/chat", include_in_schema=False)
    async def chat_page() -> Response:
        return HTMLResponse(page, headers=_PAGE_HEADERS)

    app.mount("/static", StaticFiles(directory=_STATIC), name="static")


async def _event_stream_once_admitted(gen: Generation, fmt: CompletionFormat | ChatFormat,
                                      include_usage: bool) -> EventStream:
    """_event_stream, once the engine has launched the request's first step (http_streams.admitted)."""
    await admitted(gen)
    return _event_stream(gen, fmt, include_usage)


def _event_stream(gen: Generation, fmt: CompletionFormat | ChatFormat, include_usage: bool) -> EventStream:
    async def events() -> AsyncIterator[bytes]:
        try:
            for chunk in fmt.opening_chunks():
                yield sse_event(chunk, include_usage)
            async with contextlib.aclosing(gen.deltas()) as deltas:
                async for delta in deltas:
                    if event := fmt.sse(delta, include_usage):
                        yield event
            if include_usage:
                yield sse_event(fmt.usage_chunk(), include_usage)
        except Exception as exc:  # noqa: BLE001 - headers are gone: the error becomes the last event
            # OpenAI clients raise on a data event carrying "error".
            yield b"data: " + json.dumps(error_body(service_error(exc)), separators=(",", ":")).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    return EventStream(events(), gen.cancel)


def _include_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage
