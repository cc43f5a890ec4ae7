"""The HTTP side of a generation, shared by every route module: a non-streaming reply collected unless the client
leaves first, an SSE response that cancels its engine requests however it ends, the short wait for admission before a
stream's headers go out, and a JSON body written by pydantic."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from slipstream.engine.request_stream import Delta
from slipstream.server.errors import ServiceError
from slipstream.server.generation import Generation

T = TypeVar("T")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# ---- non-streaming: collect, but stop the engine if the client leaves ---------------------------


async def collect_unless_disconnected(request: Request, gen: Generation) -> list[Delta]:
    return await unless_disconnected(request, gen.collect(), gen.cancel)


async def unless_disconnected(request: Request, work: Awaitable[T], on_gone: Callable[[], None] | None = None) -> T:
    """`work`'s result, unless the client leaves first: then `work` is cancelled (and on_gone called)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            if on_gone is not None:
                on_gone()
    if not task.done() or task.cancelled():
        raise ClientGone()
    return task.result()


async def disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClientGone(ServiceError):
    def __init__(self) -> None:
        # 499 (nginx's "client closed request"): nobody reads it, but logs show what happened.
        super().__init__(499, "client disconnected", code="client_disconnected")


# ---- streaming -----------------------------------------------------------------------------------


class EventStream(StreamingResponse):
    """An SSE response that cancels the engine requests however it ends (done, disconnect, shutdown)."""

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream", headers=SSE_HEADERS)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            await self.body_iterator.aclose()


# How long a streaming response waits for its request's first step to launch before sending its headers anyway.
ADMISSION_WAIT_S = 0.05


async def admitted(gen: Generation) -> None:
    """Wait for the request's first step to launch, at most ADMISSION_WAIT_S: a stream's headers and first events then
    go out while the device runs that step, instead of taking the host (the GIL) from the engine thread while it admits
    the request and launches the step."""
    try:
        await gen.admitted(ADMISSION_WAIT_S)
    except BaseException:  # cancelled meanwhile: nobody will consume the generation
        gen.cancel()
        raise


def json_response(body: BaseModel) -> Response:
    # pydantic writes a -inf logprob as null; json.dumps (JSONResponse) would refuse it.
    return Response(body.model_dump_json(), media_type="application/json")


