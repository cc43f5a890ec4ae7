"""OpenAI responses out: Deltas into /v1/completions and /v1/chat/completions bodies and SSE chunks (a reasoning
model's thinking split from its answer, tool calls parsed from the answer); server/openai_api.py prepares the requests."""
from __future__ import annotations

import time

from pydantic import BaseModel
from pydantic_core import to_json

from slipstream.engine.request import TokenLogprob
from slipstream.engine.request_stream import Delta
from slipstream.server.openai_api import prompt_items
from slipstream.server.protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                                        ChatCompletionResponse, ChatDelta, ChatLogprobs, ChatResponseMessage,
                                        ChatTokenLogprob, CompletionChoice, CompletionLogprobs, CompletionRequest,
                                        CompletionResponse, PromptTokensDetails, ToolCall, ToolCallDelta, TopLogprob,
                                        Usage)
from slipstream.server.reasoning import ReasoningStream
from slipstream.server.generation import Generation
from slipstream.server.service import Service
from slipstream.server.tool_calls import ToolStream, parse_reply, tool_plan


def _reason(d: Delta) -> str | None:
    return None if d.finish_reason is None else d.finish_reason.value


def sse_event(chunk: BaseModel, include_usage: bool) -> bytes:
    """A streamed chunk as its SSE event. OpenAI sends "usage": null on every chunk when usage was
    asked for, and no key otherwise."""
    return b"data: " + chunk.model_dump_json(exclude=None if include_usage else {"usage"}).encode() + b"\n\n"


def usage(gen: Generation) -> Usage:
    p, c = gen.prompt_tokens, gen.completion_tokens
    return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=gen.cached_tokens))


class _ChunkEvents:
    """A generation's one-choice chunk events as bytes, without building their pydantic models: the
    event of a chunk with no choices, split where its choices go, around a choice written directly.
    At high concurrency one event per token per stream is most of the event loop's work; the bytes
    equal sse_event's (tests/server/test_sse_events.py)."""

    def __init__(self, empty: BaseModel, include_usage: bool) -> None:
        whole = sse_event(empty, include_usage)
        at = whole.index(b'"choices":[]') + len(b'"choices":[')
        self.head, self.tail = whole[:at], whole[at:]

    def event(self, index: int, body: bytes, reason: str | None) -> bytes:
        """body: the choice's fields between its index and its (null) logprobs."""
        return (self.head + b'{"index":' + str(index).encode() + body + b',"logprobs":null,"finish_reason":'
                + (b"null" if reason is None else to_json(reason)) + b"}" + self.tail)


class _StreamEvents:
    """sse() for a format with chunk(), _chunk() and _direct(): the choice's fields written directly, or None
    where the delta needs the model (logprobs, tool calls)."""

    _events: tuple[bool, _ChunkEvents] | None = None  # per include_usage
    service: Service
    continuous = False  # stream_options.continuous_usage_stats: each chunk with the usage so far
    token_ids_as_text = False  # return_tokens_as_token_ids

    def _options(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        options = body.stream_options
        self.continuous = bool(options and options.include_usage and options.continuous_usage_stats)
        self.token_ids_as_text = body.return_tokens_as_token_ids

    def token_text(self, token_id: int) -> str:
        """A token as logprobs name it: its text, or "token_id:<id>" (return_tokens_as_token_ids)."""
        return f"token_id:{token_id}" if self.token_ids_as_text else self.service.token_text(token_id)

    def sse(self, d: Delta, include_usage: bool) -> bytes:
        """chunk(d)'s SSE event (b"" for none)."""
        if self.continuous:
            chunk = self.chunk(d)
            if chunk is None:
                return b""
            chunk.usage = self.usage()
            return sse_event(chunk, include_usage)
        body = self._direct(d)
        if body is None:
            chunk = self.chunk(d)
            return b"" if chunk is None else sse_event(chunk, include_usage)
        if not d.text and d.finish_reason is None:
            return b""
        if self._events is None or self._events[0] != include_usage:
            self._events = (include_usage, _ChunkEvents(self._chunk([]), include_usage))
        return self._events[1].event(d.index, body, _reason(d))


class CompletionFormat(_StreamEvents):
    """/v1/completions bodies and chunks for one Generation."""

    def __init__(self, service: Service, gen: Generation, body: CompletionRequest) -> None:
        self.service, self.gen, self.model = service, gen, body.model or service.model_name
        self.created = int(time.time())
        self.offsets = [0] * gen.num_choices  # text_offset continues across stream chunks
        # echo: each choice's prompt text, until its first chunk (or its response) shows it
        self.echo: list[str | None] = [None] * gen.num_choices
        self._options(body)
        if body.echo:
            items = prompt_items(body)
            self.echo = [item if isinstance(item, str) else service.tokenizer.decode(item)
                         for item in items for _ in range(body.n)]

    def usage(self) -> Usage:
        return usage(self.gen)

    def logprobs(self, index: int, lps: list[TokenLogprob] | None,
                 prompt: tuple[TokenLogprob | None, ...] | None = None) -> CompletionLogprobs | None:
        """The choice's logprobs; `prompt`: an echoed prompt's first (None: its first token's has nothing before
        it, so OpenAI gives null)."""
        if lps is None:
            return None
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        if prompt is not None:
            first = self.gen.prompt_ids(index)[0]
            self._add(out, index, self.token_text(first), None, None)
        for lp in [*(prompt or ())[1:], *lps]:
            token = self.token_text(lp.token_id)
            top: dict[str, float] = {}
            for token_id, logprob in lp.top:
                top.setdefault(self.token_text(token_id), logprob)
            top.setdefault(token, lp.logprob)  # OpenAI always includes the sampled token
            self._add(out, index, token, lp.logprob, top)
        return out

    def _add(self, out: CompletionLogprobs, index: int, token: str, logprob: float | None,
             top: dict[str, float] | None) -> None:
        out.tokens.append(token)
        out.token_logprobs.append(logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(self.offsets[index])
        self.offsets[index] += len(token)

    def _choice(self, d: Delta) -> CompletionChoice:
        """Its choice, after the echoed prompt (text, and with logprobs the prompt's) when this is its first."""
        echo, self.echo[d.index] = self.echo[d.index], None
        prompt = None if echo is None else d.prompt_logprobs
        return CompletionChoice(index=d.index, text=d.text if echo is None else echo + d.text,
                                logprobs=self.logprobs(d.index, d.logprobs, prompt), finish_reason=_reason(d))

    def response(self, choices: list[Delta]) -> CompletionResponse:
        return CompletionResponse(id=self.gen.id, created=self.created, model=self.model, usage=self.usage(),
                                  choices=[self._choice(c) for c in choices])

    def opening_chunks(self) -> list[BaseModel]:
        return []

    def chunk(self, d: Delta) -> CompletionResponse | None:
        if not d.text and not d.logprobs and d.finish_reason is None and self.echo[d.index] is None:
            return None
        return self._chunk([self._choice(d)])

    def _direct(self, d: Delta) -> bytes | None:
        if d.logprobs is not None or self.echo[d.index] is not None:
            return None
        return b',"text":' + to_json(d.text)

    def usage_chunk(self) -> CompletionResponse:
        return self._chunk([], usage=self.usage())

    def _chunk(self, choices: list, usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.gen.id, created=self.created, model=self.model, choices=choices, usage=usage)


class ChatFormat(_StreamEvents):
    """/v1/chat/completions bodies and chunks for one Generation."""

    def __init__(self, service: Service, gen: Generation, body: ChatCompletionRequest) -> None:
        self.service, self.gen, self.model = service, gen, body.model or service.model_name
        self.created = int(time.time())
        self.top_logprobs = body.top_logprobs or 0
        self._options(body)
        self.tools = (tool_plan(body.tools, body.tool_choice, service.tool_format, body.parallel_tool_calls)
                      if body.tools else None)
        self.tool_streams = [ToolStream(self.tools) for _ in range(gen.num_choices)] if self.tools else []
        # a reasoning model's choices: whether each starts inside the thinking, and its stream's split
        self.reasoning, self.include_reasoning = service.reasoning, body.include_reasoning
        self.inside = [self.reasoning.starts_inside(gen.prompt_ids(i)) for i in range(gen.num_choices)] \
            if self.reasoning else []
        self.reasoning_streams = [ReasoningStream(self.reasoning, inside) for inside in self.inside]

    def usage(self) -> Usage:
        return usage(self.gen)

    def logprobs(self, lps: list[TokenLogprob] | None) -> ChatLogprobs | None:
        if lps is None:
            return None

        def top(token_id: int, logprob: float) -> TopLogprob:
            text = self.token_text(token_id)
            return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

        content = []
        for lp in lps:
            chosen = top(lp.token_id, lp.logprob)
            content.append(ChatTokenLogprob(**chosen.model_dump(),
                                            top_logprobs=[top(t, l) for t, l in lp.top[:self.top_logprobs]]))
        return ChatLogprobs(content=content)

    def response(self, choices: list[Delta]) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=self.gen.id, created=self.created, model=self.model, usage=self.usage(),
            choices=[self._choice(c) for c in choices])

    def _choice(self, c: Delta) -> ChatChoice:
        text, thinking = c.text, None
        if self.reasoning:
            thinking, text = self.reasoning.split(c.text, self.inside[c.index])
            text = text or None  # all thinking (cut short, or nothing after it): no content, as vLLM
        content, calls = parse_reply(self.tools, text) if self.tools and text is not None else (text, [])
        reason = _reason(c) or "stop"
        return ChatChoice(index=c.index, message=ChatResponseMessage(
            content=content, tool_calls=[ToolCall(**call) for call in calls] or None, **self._thinking(thinking)),
            logprobs=self.logprobs(c.logprobs), finish_reason="tool_calls" if calls and reason == "stop" else reason)

    def _thinking(self, text: str | None) -> dict[str, str]:
        """A message's or delta's reasoning fields: under both names, when there is any to return."""
        return {"reasoning_content": text, "reasoning": text} if text and self.include_reasoning else {}

    def opening_chunks(self) -> list[ChatCompletionChunk]:
        # OpenAI opens every choice with the role and empty content.
        return [self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""),
                                             logprobs=None, finish_reason=None)])
                for i in range(self.gen.num_choices)]

    def chunk(self, d: Delta) -> ChatCompletionChunk | None:
        text, calls, reason, thinking = d.text, None, _reason(d), ""
        if self.reasoning_streams:
            split = self.reasoning_streams[d.index]
            thinking, text = split.feed(d.text)
            if d.finish_reason is not None:
                more, tail = split.finish()
                thinking, text = thinking + more, text + tail
        if self.tools:
            stream = self.tool_streams[d.index]
            text, deltas = stream.feed(text)
            if d.finish_reason is not None:
                tail, more = stream.finish()
                text, deltas = text + tail, deltas + more
                reason = "tool_calls" if stream.calls and reason == "stop" else reason
            calls = [ToolCallDelta(**c) for c in deltas] or None
        fields = self._thinking(thinking)
        if not text and not calls and not fields and not d.logprobs and d.finish_reason is None:
            return None
        delta = ChatDelta(content=text or None, tool_calls=calls, **fields)
        return self._chunk([ChatChunkChoice(index=d.index, delta=delta, logprobs=self.logprobs(d.logprobs),
                                            finish_reason=reason)])

    def _direct(self, d: Delta) -> bytes | None:
        if self.tools or self.reasoning or d.logprobs is not None:
            return None
        return b',"delta":' + (b'{"content":' + to_json(d.text) + b"}" if d.text else b"{}")

    def usage_chunk(self) -> ChatCompletionChunk:
        return self._chunk([], usage=self.usage())

    def _chunk(self, choices: list, usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.gen.id, created=self.created, model=self.model, choices=choices, usage=usage)

