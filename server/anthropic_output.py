"""/v1/messages' answers: the chat format's split of a reply (thinking, answer, tool calls) as Anthropic's content
blocks, whole or as the stream's typed events, and every error of these routes in Anthropic's shape
(server/anthropic.py translates the request)."""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from pydantic import BaseModel
from starlette.types import ASGIApp, Message as AsgiMessage, Receive, Scope, Send

from slipstream.engine.request import FinishReason
from slipstream.engine.request_stream import Delta
from slipstream.server.errors import ServiceError
from slipstream.server.gate import ANTHROPIC_PATHS
from slipstream.server.openai_formats import ChatFormat
from slipstream.server.protocol import ToolCallDelta
from slipstream.server.generation import Generation
from slipstream.server.service import Service
from slipstream.server.typed_events import TypedEvents

from slipstream.server.anthropic import MessagesRequest, Translation


class MessageUsage(BaseModel):
    input_tokens: int             # as Anthropic counts them: the input tokens not read from the cache
    output_tokens: int
    cache_read_input_tokens: int = 0  # the input tokens the prefix cache held


class MessageObject(BaseModel):
    """The reply (also what message_start carries, with no content and no stop reason yet)."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]  # thinking, text and tool_use blocks
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: MessageUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
# Each block's fields as content_block_start shows them, and its deltas' type and field.
_BLOCKS = {"thinking": ({"thinking": "", "signature": ""}, "thinking_delta", "thinking"),
           "text": ({"text": ""}, "text_delta", "text"),
           "tool_use": ({"input": {}}, "input_json_delta", "partial_json")}


class MessageFormat(TypedEvents):
    """One Generation as a message: the chat format's split reply (ChatFormat.chunk) as content blocks, opened and
    closed as the reply goes. A whole message runs the same way over the one collected Delta."""

    kinds = ("thinking", "text")

    def __init__(self, service: Service, gen: Generation, req: MessagesRequest, translation: Translation) -> None:
        self.gen = gen
        self.chat = ChatFormat(service, gen, translation.chat)
        self.stops = sorted(req.stop_sequences or (), key=len, reverse=True)
        self.id = "msg_" + gen.id.partition("-")[2]
        self.model = req.model or service.model_name
        self.content: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the block being written (the last of content)
        self.arguments: list[str] = []  # per tool_use block: its input as the model wrote it
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None

    def body(self) -> MessageObject:
        return MessageObject(id=self.id, model=self.model, content=self.content, stop_reason=self.stop_reason,
                             stop_sequence=self.stop_sequence, usage=MessageUsage(
                                 input_tokens=self.gen.prompt_tokens - self.gen.cached_tokens,
                                 output_tokens=self.gen.completion_tokens,
                                 cache_read_input_tokens=self.gen.cached_tokens))

    def message(self, choices: list[Delta]) -> MessageObject:
        """The whole message from the collected reply."""
        self.whole(choices)
        return self.body()

    def opening(self) -> list[bytes]:
        return [_event("message_start", message=self.body().model_dump(mode="json"))]

    def failed(self, err: ServiceError) -> list[bytes]:
        return [_event("error", error=error_detail(err))]

    # ---- the reply, block by block ----

    def feed(self, d: Delta) -> list[bytes]:
        """The SSE events for one Delta (the last one ends the message)."""
        d = self._matched_stop(d)
        chunk = self.chat.chunk(d)
        events = self.parts(chunk)
        if d.finish_reason is None:
            return events
        events += self._close()
        reason = _STOP_REASONS.get(chunk.choices[0].finish_reason, "end_turn")
        self.stop_reason = "stop_sequence" if self.stop_sequence is not None and reason != "tool_use" else reason
        if self.stop_reason != "stop_sequence":
            self.stop_sequence = None
        return [*events, self._event("message_delta", delta={"stop_reason": self.stop_reason,
                                                             "stop_sequence": self.stop_sequence},
                                     usage={"output_tokens": self.gen.completion_tokens}), self._event("message_stop")]

    def _matched_stop(self, d: Delta) -> Delta:
        """The last Delta without the stop sequence it ends with, noted as the one that matched. The chat request
        keeps a matched stop string in the text for this (include_stop_str_in_output): the engine's earliest match
        ends the text, so it is the longest stop sequence the text ends with."""
        if d.finish_reason is not FinishReason.STOP or not self.stops:
            return d
        found = next((s for s in self.stops if d.text.endswith(s)), None)
        if found is None:
            return d
        self.stop_sequence = found
        return dataclasses.replace(d, text=d.text[:-len(found)])

    def text(self, kind: str, text: str) -> list[bytes]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close() + self._start({"type": kind, **_BLOCKS[kind][0]})
        self.open[kind] += text
        return [*events, self._delta(text)]

    def call(self, call: ToolCallDelta) -> list[bytes]:
        events = []
        if call.id is not None:  # a call's first delta: a new block
            events += self._close()
            self.arguments.append("")
            events += self._start({"type": "tool_use", "id": "toolu_" + call.id.partition("_")[2],
                                   "name": call.function.name, "input": {}})
        if call.function.arguments:
            self.arguments[-1] += call.function.arguments
            events.append(self._delta(call.function.arguments))
        return events

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        self.content.append(block)
        self.open = block
        return [self._event("content_block_start", index=len(self.content) - 1, content_block=block)]

    def _delta(self, text: str) -> bytes:
        _, kind, name = _BLOCKS[self.open["type"]]
        return self._event("content_block_delta", index=len(self.content) - 1, delta={"type": kind, name: text})

    def _close(self) -> list[bytes]:
        """The event that finishes the open block (none when no block is open)."""
        block, self.open = self.open, None
        if block is None:
            return []
        if block["type"] == "tool_use":  # the whole input; {} when the reply was cut inside it
            block["input"] = _json_object(self.arguments[-1])
        return [self._event("content_block_stop", index=len(self.content) - 1)]

    def _event(self, kind: str, **fields: Any) -> bytes:
        # written at once: the blocks they show change afterwards
        return _event(kind, **fields) if self.streaming else b""


def _event(kind: str, **fields: Any) -> bytes:
    data = json.dumps({"type": kind, **fields}, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


# ---- errors ------------------------------------------------------------------------------------------------------

_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_detail(err: ServiceError) -> dict[str, str]:
    """Anthropic's error object: its type by the status, the field named at the message's start (no param field)."""
    message = err.message
    if err.param is not None and not message.startswith(err.param):
        message = f"{err.param}: {message}"
    kind = _ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": kind, "message": message}


class AnthropicErrors:
    """ASGI middleware, outside the one that counts responses (which reads OpenAI's error code): on Anthropic's
    routes, every error body the server writes in OpenAI's shape (server/gate.py: the API key, body limits,
    validation, the routes' own) goes out in Anthropic's, {"type": "error", "error": {"type", "message"}}."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in ANTHROPIC_PATHS:
            await self.app(scope, receive, send)
            return
        start: AsgiMessage | None = None

        async def reshaped(message: AsgiMessage) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message  # held until its body (one message, as every error body here is) is rewritten
                return
            if start is not None and message["type"] == "http.response.body":
                body = _reshaped(start["status"], message.get("body", b""))
                headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
                await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
                start = None
                await send({"type": "http.response.body", "body": body})
                return
            await send(message)

        await self.app(scope, receive, reshaped)


def _reshaped(status: int, body: bytes) -> bytes:
    try:
        error = json.loads(body)["error"]
        err = ServiceError(status, str(error["message"]), param=error.get("param"))
    except (ValueError, KeyError, TypeError):
        err = ServiceError(status, body.decode(errors="replace") or "error")
    return AnthropicError(error=AnthropicErrorDetail(**error_detail(err))).model_dump_json().encode()
