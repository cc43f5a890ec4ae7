"""Replies as typed server-sent events (`event: <type>` lines), the Responses and Anthropic APIs' stream: a format
builds its events Delta by Delta in feed(), and a whole reply runs the same way over its one collected Delta, with
nothing written, so that both end in the same body."""
from __future__ import annotations

import contextlib
from typing import AsyncIterator

from slipstream.engine.request_stream import Delta
from slipstream.server.errors import ServiceError, service_error
from slipstream.server.protocol import ChatCompletionChunk, ToolCallDelta


class TypedEvents:
    streaming = True  # False: the events are not written, only the body built
    kinds = ("", "")  # what holds the thinking and what the answer (output items, content blocks)

    def opening(self) -> list[bytes]:
        """The events before the reply's first."""
        raise NotImplementedError

    def feed(self, d: Delta) -> list[bytes]:
        """The events for one Delta (the last one ends the reply)."""
        raise NotImplementedError

    def failed(self, err: ServiceError) -> list[bytes]:
        """The last events of a stream that failed after its headers went out."""
        raise NotImplementedError

    def text(self, kind: str, text: str) -> list[bytes]:
        """The events for more text of the thinking or the answer."""
        raise NotImplementedError

    def call(self, call: ToolCallDelta) -> list[bytes]:
        """The events for a tool call's delta."""
        raise NotImplementedError

    def parts(self, chunk: ChatCompletionChunk | None) -> list[bytes]:
        """The events for a chat chunk's split (server/openai_formats.ChatFormat.chunk): thinking, answer, tool calls."""
        if chunk is None:
            return []
        delta, events = chunk.choices[0].delta, []
        if delta.reasoning_content:
            events += self.text(self.kinds[0], delta.reasoning_content)
        if delta.content:
            events += self.text(self.kinds[1], delta.content)
        for call in delta.tool_calls or ():
            events += self.call(call)
        return events

    def whole(self, choices: list[Delta]) -> None:
        """Build the body from the collected reply."""
        self.streaming = False
        self.feed(choices[0])

    async def events(self, deltas: AsyncIterator[Delta]) -> AsyncIterator[bytes]:
        try:
            for event in self.opening():
                yield event
            async with contextlib.aclosing(deltas) as stream:
                async for delta in stream:
                    for event in self.feed(delta):
                        yield event
        except Exception as exc:  # noqa: BLE001 - headers are gone: the error becomes the last events
            for event in self.failed(service_error(exc)):
                yield event
