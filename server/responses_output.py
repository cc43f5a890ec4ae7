"""/v1/responses' answers: the chat format's split of a reply (thinking, answer, tool calls) as the Responses API's
output items, whole or as the stream's typed events (server/responses.py translates the request)."""
from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel

from slipstream.engine.request_stream import Delta
from slipstream.server.errors import ServiceError
from slipstream.server.openai_formats import ChatFormat
from slipstream.server.protocol import ToolCallDelta
from slipstream.server.response_store import ResponseStore
from slipstream.server.responses import ResponsesRequest, Translation
from slipstream.server.generation import Generation
from slipstream.server.service import Service
from slipstream.server.typed_events import TypedEvents



class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()


class ResponseObject(BaseModel):
    """The response (also what the stream's response.* events carry, without usage until it completes)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, str] | None = None
    model: str
    output: list[dict[str, Any]]  # reasoning, message and function_call items
    usage: ResponseUsage | None = None
    # the request's parameters, as OpenAI echoes them
    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    text: dict[str, Any]
    parallel_tool_calls: bool
    metadata: dict[str, str]
    previous_response_id: str | None
    reasoning: dict[str, Any] | None
    store: bool
    truncation: str = "disabled"
    user: str | None


@dataclasses.dataclass(frozen=True)
class _TextItem:
    """How an item of text (the answer, or the thinking) is shown: its id prefix and fields, its part, its events."""

    prefix: str
    fields: dict[str, Any]
    part: dict[str, Any]
    events: str                # the delta and done events' prefix
    extra: dict[str, Any]      # what those events carry besides the text


_TEXT_ITEMS = {
    "message": _TextItem("msg", {"role": "assistant"}, {"type": "output_text", "text": "", "annotations": []},
                         "response.output_text", {"logprobs": []}),
    "reasoning": _TextItem("rs", {"summary": []}, {"type": "reasoning_text", "text": ""},
                           "response.reasoning_text", {})}


class ResponseFormat(TypedEvents):
    """One Generation as a response: the chat format's split reply (ChatFormat.chunk) as output items, opened
    and closed as the reply goes. Whole responses run the same way over the one collected Delta."""

    kinds = ("reasoning", "message")

    def __init__(self, service: Service, gen: Generation, req: ResponsesRequest, translation: Translation,
                 store: ResponseStore) -> None:
        self.gen, self.req, self.translation = gen, req, translation
        self.store = store if req.store is not False else None
        self.chat = ChatFormat(service, gen, translation.chat)
        self.id = "resp_" + gen.id.partition("-")[2]
        self.model = req.model or service.model_name
        self.created_at = int(time.time())
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written (the last of output)
        self.status, self.reason = "in_progress", None
        self.sequence = 0
        self.tokens, self.thought = 0, None  # tokens so far; of them, those up to the thinking's end once it ends

    # ---- the response ----

    def body(self, error: ServiceError | None = None) -> ResponseObject:
        req, done = self.req, self.status != "in_progress"
        p, c = self.gen.prompt_tokens, self.gen.completion_tokens
        thinking = any(item["type"] == "reasoning" for item in self.output)
        reasoning_tokens = (self.tokens if self.thought is None else self.thought) if thinking else 0
        return ResponseObject(
            id=self.id, created_at=self.created_at, status=self.status, model=self.model, output=self.output,
            error=None if error is None else {"code": "server_error", "message": error.message},
            incomplete_details=None if self.reason is None else {"reason": self.reason},
            usage=ResponseUsage(input_tokens=p, output_tokens=c, total_tokens=p + c,
                                input_tokens_details=InputTokensDetails(cached_tokens=self.gen.cached_tokens),
                                output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens))
            if done else None,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, previous_response_id=req.previous_response_id,
            tools=req.tools or [], tool_choice=req.tool_choice or "auto",
            text=req.text or {"format": {"type": "text"}},
            parallel_tool_calls=True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            metadata=req.metadata or {}, reasoning=req.reasoning, store=req.store is not False, user=req.user)

    def response(self, choices: list[Delta]) -> ResponseObject:
        """The whole response from the collected reply."""
        self.whole(choices)
        return self.body()

    def opening(self) -> list[bytes]:
        return [self._event("response.created", response=self._dump()),
                self._event("response.in_progress", response=self._dump())]

    def failed(self, err: ServiceError) -> list[bytes]:
        """An error event, then response.failed."""
        event = self._event("error", code=err.code, message=err.message, param=err.param)
        self.status = "failed"
        return [event, self._event("response.failed", response=self._dump(err))]

    # ---- the reply, item by item ----

    def feed(self, d: Delta) -> list[bytes]:
        """The SSE events for one Delta (the last one closes the response)."""
        chunk = self.chat.chunk(d)
        events = self.parts(chunk)
        close = self.chat.reasoning.close_id if self.chat.reasoning is not None else None
        if self.thought is None and close in d.token_ids:
            self.thought = self.tokens + d.token_ids.index(close) + 1
        self.tokens += len(d.token_ids)
        if d.finish_reason is None:
            return events
        cut = chunk is not None and chunk.choices[0].finish_reason == "length"
        self.status, self.reason = ("incomplete", "max_output_tokens") if cut else ("completed", None)
        events += self._close()
        if not self.output:  # nothing said: an empty answer, as OpenAI gives one
            events += self.text("message", "") + self._close()
        if self.store is not None:
            items = self.translation.items
            self.store.put(self.id, self.body().model_dump_json().encode(), [*items, *self.output],
                           new=[*items[self.translation.earlier:], *self.output])
        if self.streaming:
            events.append(self._event(f"response.{self.status}", response=self._dump()))
        return events

    def text(self, kind: str, text: str) -> list[bytes]:
        shown, events = _TEXT_ITEMS[kind], []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            item = {"id": f"{shown.prefix}_{uuid.uuid4().hex}", "type": kind, "status": "in_progress",
                    **shown.fields, "content": []}
            events += self._add(item)
            item["content"].append(dict(shown.part))
            events.append(self._event("response.content_part.added", **self._where(), part=item["content"][0]))
        if text:
            self.open["content"][0]["text"] += text
            events.append(self._event(f"{shown.events}.delta", **self._where(), delta=text, **shown.extra))
        return events

    def call(self, call: ToolCallDelta) -> list[bytes]:
        events = []
        if call.id is not None:  # a call's first delta: a new item
            events += self._close()
            events += self._add({"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                                 "call_id": call.id, "name": call.function.name, "arguments": ""})
        if call.function.arguments:
            self.open["arguments"] += call.function.arguments
            events.append(self._event("response.function_call_arguments.delta", item_id=self.open["id"],
                                      output_index=len(self.output) - 1, delta=call.function.arguments))
        return events

    def _add(self, item: dict[str, Any]) -> list[bytes]:
        self.output.append(item)
        self.open = item
        return [self._event("response.output_item.added", output_index=len(self.output) - 1, item=item)]

    def _close(self) -> list[bytes]:
        """The events that finish the open item (none when no item is open)."""
        item, self.open = self.open, None
        if item is None:
            return []
        last = self.status == "incomplete"  # closed by the end of a reply cut short
        item["status"] = "incomplete" if last else "completed"
        where = {"item_id": item["id"], "output_index": len(self.output) - 1}
        if item["type"] == "function_call":
            events = [self._event("response.function_call_arguments.done", **where, arguments=item["arguments"])]
        else:
            shown, part = _TEXT_ITEMS[item["type"]], item["content"][0]
            events = [self._event(f"{shown.events}.done", **where, content_index=0, text=part["text"], **shown.extra),
                      self._event("response.content_part.done", **where, content_index=0, part=part)]
        return [*events, self._event("response.output_item.done", output_index=len(self.output) - 1, item=item)]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1, "content_index": 0}

    def _event(self, kind: str, **fields: Any) -> bytes:
        """The event as SSE bytes, written at once: the items it shows change afterwards."""
        self.sequence += 1
        if not self.streaming:
            return b""
        data = json.dumps({"type": kind, "sequence_number": self.sequence - 1, **fields}, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def _dump(self, error: ServiceError | None = None) -> dict[str, Any]:
        return self.body(error).model_dump(mode="json")
