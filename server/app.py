"""FastAPI app: OpenAI /v1 routes (JSON and SSE), health/ready/metrics, and serve() with graceful shutdown.

Routes only translate between HTTP and `server.service`; engine logic stays out of here.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any, AsyncIterator, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from engine.request import TokenLogprob
from server.errors import RequestGate, error_body, install_error_handlers
from server.grpc_service import GrpcServer, start_grpc_server
from server.metrics import Metrics
from server.protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                             ChatCompletionResponse, ChatDelta, ChatLogprobs, ChatResponseMessage, ChatTokenLogprob,
                             CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, ModelCard,
                             ModelList, TopLogprob, Usage)
from server.service import Choice, ChoiceDelta, Generation, Service, ServiceError

log = logging.getLogger(__name__)
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def create_app(service: Service, *, api_key: str | None, max_body_bytes: int = 1 << 20) -> FastAPI:
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    app = FastAPI(title="Slipstream", docs_url=None, redoc_url=None)
    app.state.service = service
    app.state.api_key = api_key  # the gRPC front end checks the same key
    app.state.metrics = metrics = Metrics(service.scheduler, lambda: service.engine.compile_count)
    app.add_middleware(RequestGate, api_key=api_key, max_body_bytes=max_body_bytes)
    install_error_handlers(app)
    created = int(time.time())

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok = service.ready
        return JSONResponse({"status": "ready" if ok else "not ready"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics_text() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def card() -> ModelCard:
        return ModelCard(id=service.model_name, created=created, max_model_len=service.max_model_len)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return ModelList(data=[card()]).model_dump()

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        service.check_model(model)
        return card().model_dump()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        gen = service.submit(await asyncio.to_thread(service.prepare_completion, body))
        fmt = _CompletionFormat(service, gen, body)
        if body.stream:
            return _event_stream(gen, fmt, _include_usage(body))
        choices = await _collect_unless_disconnected(request, gen)
        return _json_response(fmt.response(choices))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        gen = service.submit(await asyncio.to_thread(service.prepare_chat, body))
        fmt = _ChatFormat(service, gen, body)
        if body.stream:
            return _event_stream(gen, fmt, _include_usage(body))
        choices = await _collect_unless_disconnected(request, gen)
        return _json_response(fmt.response(choices))

    return app


# ---- non-streaming: collect, but stop the engine if the client leaves ---------------------------


async def _collect_unless_disconnected(request: Request, gen: Generation) -> list[Choice]:
    collect = asyncio.ensure_future(gen.collect())
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not collect.done():
            collect.cancel()
            gen.cancel()
    if not collect.done() or collect.cancelled():
        raise _ClientGone()
    return collect.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _ClientGone(ServiceError):
    def __init__(self) -> None:
        # 499 (nginx's "client closed request"): nobody reads it, but logs show what happened.
        super().__init__(499, "client disconnected", code="client_disconnected")


# ---- streaming -----------------------------------------------------------------------------------


class _EventStream(StreamingResponse):
    """An SSE response that cancels the engine requests however it ends (done, disconnect, shutdown)."""

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream", headers=_SSE_HEADERS)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            await self.body_iterator.aclose()


def _event_stream(gen: Generation, fmt: "_CompletionFormat | _ChatFormat", include_usage: bool) -> _EventStream:
    async def events() -> AsyncIterator[bytes]:
        try:
            for chunk in fmt.opening_chunks():
                yield _sse(chunk, include_usage)
            async with contextlib.aclosing(gen.deltas()) as deltas:
                async for delta in deltas:
                    chunk = fmt.chunk(delta)
                    if chunk is not None:
                        yield _sse(chunk, include_usage)
            if include_usage:
                yield _sse(fmt.usage_chunk(), include_usage)
        except ServiceError as exc:
            # Headers are gone already; OpenAI clients raise on a data event carrying "error".
            yield b"data: " + json.dumps(error_body(exc), separators=(",", ":")).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    return _EventStream(events(), gen.cancel)


def _sse(chunk: BaseModel, include_usage: bool) -> bytes:
    # OpenAI sends "usage": null on every chunk when usage was asked for, and no key otherwise.
    return b"data: " + chunk.model_dump_json(exclude=None if include_usage else {"usage"}).encode() + b"\n\n"


def _json_response(body: BaseModel) -> Response:
    # pydantic writes a -inf logprob as null; json.dumps (JSONResponse) would refuse it.
    return Response(body.model_dump_json(), media_type="application/json")


def _include_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


# ---- OpenAI response shapes ----------------------------------------------------------------------


class _CompletionFormat:
    def __init__(self, service: Service, gen: Generation, body: CompletionRequest) -> None:
        self.service, self.gen, self.model = service, gen, body.model or service.model_name
        self.created = int(time.time())
        self.offsets = [0] * gen.num_choices  # text_offset continues across stream chunks

    def usage(self) -> Usage:
        p, c = self.gen.prompt_tokens, self.gen.completion_tokens
        return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)

    def logprobs(self, index: int, lps: list[TokenLogprob] | None) -> CompletionLogprobs | None:
        if lps is None:
            return None
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for lp in lps:
            token = self.service.token_text(lp.token_id)
            top: dict[str, float] = {}
            for token_id, logprob in lp.top:
                top.setdefault(self.service.token_text(token_id), logprob)
            top.setdefault(token, lp.logprob)  # OpenAI always includes the sampled token
            out.tokens.append(token)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append(top)
            out.text_offset.append(self.offsets[index])
            self.offsets[index] += len(token)
        return out

    def response(self, choices: list[Choice]) -> CompletionResponse:
        return CompletionResponse(
            id=self.gen.id, created=self.created, model=self.model, usage=self.usage(),
            choices=[CompletionChoice(index=c.index, text=c.text, logprobs=self.logprobs(c.index, c.logprobs),
                                      finish_reason=c.finish_reason) for c in choices])

    def opening_chunks(self) -> list[BaseModel]:
        return []

    def chunk(self, d: ChoiceDelta) -> CompletionResponse | None:
        if not d.text and not d.logprobs and d.finish_reason is None:
            return None
        choice = CompletionChoice(index=d.index, text=d.text, logprobs=self.logprobs(d.index, d.logprobs),
                                  finish_reason=d.finish_reason)
        return self._chunk([choice])

    def usage_chunk(self) -> CompletionResponse:
        return self._chunk([], usage=self.usage())

    def _chunk(self, choices: list, usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.gen.id, created=self.created, model=self.model, choices=choices, usage=usage)


class _ChatFormat:
    def __init__(self, service: Service, gen: Generation, body: ChatCompletionRequest) -> None:
        self.service, self.gen, self.model = service, gen, body.model or service.model_name
        self.created = int(time.time())
        self.top_logprobs = body.top_logprobs or 0

    def usage(self) -> Usage:
        p, c = self.gen.prompt_tokens, self.gen.completion_tokens
        return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)

    def logprobs(self, lps: list[TokenLogprob] | None) -> ChatLogprobs | None:
        if lps is None:
            return None

        def top(token_id: int, logprob: float) -> TopLogprob:
            text = self.service.token_text(token_id)
            return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

        content = []
        for lp in lps:
            chosen = top(lp.token_id, lp.logprob)
            content.append(ChatTokenLogprob(**chosen.model_dump(),
                                            top_logprobs=[top(t, l) for t, l in lp.top[:self.top_logprobs]]))
        return ChatLogprobs(content=content)

    def response(self, choices: list[Choice]) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=self.gen.id, created=self.created, model=self.model, usage=self.usage(),
            choices=[ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                                logprobs=self.logprobs(c.logprobs), finish_reason=c.finish_reason) for c in choices])

    def opening_chunks(self) -> list[ChatCompletionChunk]:
        # OpenAI opens every choice with the role and empty content.
        return [self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""),
                                             logprobs=None, finish_reason=None)])
                for i in range(self.gen.num_choices)]

    def chunk(self, d: ChoiceDelta) -> ChatCompletionChunk | None:
        if not d.text and not d.logprobs and d.finish_reason is None:
            return None
        delta = ChatDelta(content=d.text) if d.text else ChatDelta()
        return self._chunk([ChatChunkChoice(index=d.index, delta=delta, logprobs=self.logprobs(d.logprobs),
                                            finish_reason=d.finish_reason)])

    def usage_chunk(self) -> ChatCompletionChunk:
        return self._chunk([], usage=self.usage())

    def _chunk(self, choices: list, usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.gen.id, created=self.created, model=self.model, choices=choices, usage=usage)


# ---- serving -------------------------------------------------------------------------------------


class SlipstreamServer(uvicorn.Server):
    """uvicorn with Slipstream's shutdown order: stop admitting (/ready 503, new requests 503), let
    in-flight requests finish until the deadline (scheduler.shutdown), then close connections.

    If the engine thread dies after having been ready, the server shuts itself down and sets
    `engine_failed`, so the process can exit non-zero and be restarted instead of idling unready.
    """

    def __init__(self, config: uvicorn.Config, app: FastAPI, *, shutdown_timeout_s: float,
                 started_at: float | None, exit_on_engine_failure: bool, grpc_port: int = 0) -> None:
        super().__init__(config)
        self._service: Service = app.state.service
        self._api_key: str | None = app.state.api_key
        self._grpc_port = grpc_port
        self.grpc: GrpcServer | None = None
        self._metrics: Metrics = app.state.metrics
        self._shutdown_timeout_s = shutdown_timeout_s
        self._started_at = started_at
        self._exit_on_engine_failure = exit_on_engine_failure
        self._was_ready = False
        self.engine_failed = False

    async def startup(self, sockets: list | None = None) -> None:
        if self._grpc_port:
            # before HTTP, so a busy gRPC port fails the start before any traffic is accepted
            self.grpc = await start_grpc_server(self._service, host=self.config.host, port=self._grpc_port,
                                                api_key=self._api_key)
        await super().startup(sockets=sockets)
        if self._started_at is not None:
            self._metrics.set_startup_latency(time.monotonic() - self._started_at)

    async def on_tick(self, counter: int) -> bool:
        ready = self._service.scheduler.ready
        self._was_ready = self._was_ready or ready
        # The scheduler may start after the server (so /health answers during compilation):
        # only a ready -> not-ready transition outside a shutdown is a failure.
        if self._exit_on_engine_failure and self._was_ready and not ready and not self._service.draining:
            log.error("engine thread stopped; shutting the server down")
            self.engine_failed = True
            return True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list | None = None) -> None:
        self._service.begin_drain()
        drain = asyncio.ensure_future(asyncio.to_thread(self._service.scheduler.shutdown, self._shutdown_timeout_s))
        # gRPC refuses new RPCs at once; running ones get the same deadline as HTTP streams
        grpc_stop = asyncio.ensure_future(self.grpc.stop(self._shutdown_timeout_s + 5.0)) if self.grpc else None
        try:
            await super().shutdown(sockets=sockets)
        finally:
            await drain
            if grpc_stop is not None:
                await grpc_stop


def make_server(app: FastAPI, host: str, port: int, *, shutdown_timeout_s: float = 30.0, log_level: str = "info",
                started_at: float | None = None, exit_on_engine_failure: bool = True,
                grpc_port: int = 0) -> SlipstreamServer:
    """`started_at`: a time.monotonic() stamp from process start, exported as startup latency.
    `shutdown_timeout_s`: how long in-flight requests may run after SIGTERM before they fail."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                            # past the scheduler's deadline its streams have ended with an error, so
                            # this margin only covers writing those last events out
                            timeout_graceful_shutdown=shutdown_timeout_s + 5.0)
    return SlipstreamServer(config, app, shutdown_timeout_s=shutdown_timeout_s, started_at=started_at,
                            exit_on_engine_failure=exit_on_engine_failure, grpc_port=grpc_port)


async def serve_async(app: FastAPI, host: str, port: int, **kwargs: Any) -> int:
    """Serve until SIGINT/SIGTERM or an engine failure; returns the process exit code (0, or 1 when
    the engine failed). For running beside the gRPC server in one event loop."""
    server = make_server(app, host, port, **kwargs)
    await server.serve()
    return 1 if server.engine_failed else 0


def serve(app: FastAPI, host: str, port: int, **kwargs: Any) -> int:
    """Blocking serve_async(); see make_server for the keyword arguments. Note that uvicorn re-raises
    a caught SIGTERM/SIGINT after the graceful shutdown, so on a signal this may not return."""
    server = make_server(app, host, port, **kwargs)
    server.run()
    return 1 if server.engine_failed else 0
