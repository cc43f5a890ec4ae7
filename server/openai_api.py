"""OpenAI requests in, OpenAI responses out: turns a CompletionRequest / ChatCompletionRequest into a
`Prepared` (cheap checks first, then tokenization), and Deltas into response bodies and stream
chunks. The HTTP routes call these; the transport-neutral service knows nothing of OpenAI."""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from pydantic import BaseModel
from pydantic_core import to_json

from slipstream.engine.request_stream import Delta
from slipstream.engine.request import DEFAULT_MAX_TOKENS, SamplingParams, TokenLogprob
from slipstream.engine.structured import Reasoning
from slipstream.server.errors import ServiceError, parse_input
from slipstream.server.protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                             ChatCompletionResponse, ChatDelta, ChatLogprobs, ChatMessage, ChatResponseMessage,
                             ChatTokenLogprob, CompletionChoice, CompletionLogprobs, CompletionRequest,
                             CompletionResponse, ToolCall, ToolCallDelta, TopLogprob, Usage, valid_unicode)
from slipstream.server.reasoning import ReasoningStream
from slipstream.server.service import Generation, Prepared, Service
from slipstream.server.structured import (Constraint, ToolStream, compile_constraint, parse_reply, request_constraint,
                                          tool_plan, with_tools)

# ---- requests ------------------------------------------------------------------------------------


def prepare_completion(service: Service, req: CompletionRequest) -> Prepared:
    """Validate, then tokenize; CPU only and thread-safe, so callers may run it off the event loop."""
    lora = service.check_model(req.model)
    priority = service.check_priority(req.priority)
    if req.best_of is not None and req.best_of != req.n:
        raise ServiceError(400, "best_of is not supported (use n)", param="best_of", code="unsupported")
    items = prompt_items(req)
    if not items:
        raise ServiceError(400, "prompt must not be empty", param="prompt", code="invalid_value")
    # Everything that costs no tokenization first: 200,000 tiny prompts must not be tokenized to learn
    # that they exceed max_choices.
    service.check_choices(len(items), req.n)
    max_tokens = req.max_tokens if req.max_tokens is not None else DEFAULT_MAX_TOKENS
    if max_tokens == 0 and not req.echo:
        raise ServiceError(400, "max_tokens must be at least 1 (0, the prompt alone, needs echo)", param="max_tokens",
                           code="invalid_value")
    if req.suffix is not None:
        items = _fills(service, req, items)
    if req.echo and req.truncate_prompt_tokens is not None:
        raise ServiceError(400, "truncate_prompt_tokens cannot be used with echo (the echoed prompt would not be the "
                           "one that ran)", param="truncate_prompt_tokens", code="unsupported")
    keep = prompt_tokens_kept(service, req.truncate_prompt_tokens)
    # echo with logprobs: the prompt's tokens get theirs too, computed (never from the prefix cache)
    params = _params(service, req, max_tokens=max_tokens, logprobs=req.logprobs, constraint=request_constraint(req),
                     prompt_logprobs=req.logprobs if req.echo else None)
    prompts = [truncated(service.encode(item), keep) for item in items]
    return Prepared(prompts=prompts, params=params, id_prefix="cmpl", lora=lora, priority=priority)


def prepare_chat(service: Service, req: ChatCompletionRequest) -> Prepared:
    """Render the chat template, tokenize, validate; thread-safe like prepare_completion."""
    lora = service.check_model(req.model)
    priority = service.check_priority(req.priority)
    plan = tool_plan(req.tools, req.tool_choice)
    constraint = request_constraint(req)
    forced = parse_input("tools", "tool definitions", plan.constraint) if plan is not None else None
    if forced is not None:
        if constraint is not None:
            raise ServiceError(400, f"tool_choice {plan.mode} constrains the reply already; drop {constraint.field}",
                               param=constraint.field, code="invalid_value")
        constraint = forced
    if req.top_logprobs is not None and not req.logprobs:
        raise ServiceError(400, "top_logprobs requires logprobs=true", param="top_logprobs", code="invalid_value")
    service.check_choices(1, req.n, "messages")
    keep = prompt_tokens_kept(service, req.truncate_prompt_tokens)
    messages = chat_messages(req.messages)
    explicit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    names = {"max_tokens": "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
             "logprobs": "top_logprobs"}
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    # Validate the sampling fields before the template and the tokenizer run. Without a limit a
    # reply may fill the rest of the context (max_tokens None, resolved against the prompt at submit).
    params = _params(service, req, max_tokens=explicit, logprobs=logprobs, param_names=names, constraint=None)
    prompt = truncated(_chat_prompt(service, req, with_tools(messages, plan)), keep)
    if constraint is not None:
        grammar = compile_constraint(service, _after_thinking(service, constraint, prompt))
        params = service.sampling_params(base=params, constraint=grammar)
    return Prepared(prompts=[prompt], params=params, id_prefix="chatcmpl", prompt_param="messages", lora=lora,
                    priority=priority)


def _chat_prompt(service: Service, req: ChatCompletionRequest, messages: list[dict[str, Any]]) -> list[int]:
    """The rendered conversation's ids: a new assistant turn opened, none, or the final assistant message left open
    (continue_final_message)."""
    if req.continue_final_message and (req.add_generation_prompt or messages[-1]["role"] != "assistant"):
        raise ServiceError(400, "continue_final_message goes on with a final assistant message: it needs the last "
                           "message's role to be assistant and add_generation_prompt false",
                           param="continue_final_message", code="invalid_value")
    return service.render_chat(messages, template_kwargs=template_kwargs(req.chat_template_kwargs),
                               add_generation_prompt=req.add_generation_prompt,
                               continue_final=req.continue_final_message)


def _after_thinking(service: Service, constraint: Constraint, prompt: list[int]) -> Constraint:
    """A reasoning model thinks first: its grammar lets the thinking through (from inside it when the prompt
    opened it), then holds the answer to the constraint."""
    fmt = service.reasoning
    if fmt is None:
        return constraint
    return dataclasses.replace(constraint, reasoning=Reasoning(fmt.open_id, fmt.close_id,
                                                               inside=fmt.starts_inside(prompt)))


# the chat template's own variables, which chat_template_kwargs may not replace
_TEMPLATE_NAMES = ("messages", "add_generation_prompt", "bos_token", "eos_token")


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """chat_template_kwargs checked: a name the server sets itself is a 400 naming it."""
    for name in kwargs or {}:
        if name in _TEMPLATE_NAMES:
            raise ServiceError(400, f"chat_template_kwargs.{name} is set by the server and cannot be replaced",
                               param=f"chat_template_kwargs.{name}", code="invalid_value")
    return kwargs or {}


def _fills(service: Service, req: CompletionRequest, items: list[str | list[int]]) -> list[str]:
    """The prompts of a fill in the middle (server/fim.py): each text prompt between the model's tags with the
    suffix; a 400 naming suffix where the model has no such tags, or with echo."""
    fim = service.fim
    if fim is None:
        raise ServiceError(400, "suffix (fill in the middle) needs a model with fill-in-the-middle tokens "
                           "(<|fim_prefix|>... or <fim_prefix>...); this one has none", param="suffix",
                           code="unsupported")
    if req.echo:
        raise ServiceError(400, "suffix cannot be used with echo", param="suffix", code="unsupported")
    if not all(isinstance(item, str) for item in items):
        raise ServiceError(400, "suffix needs text prompts, not token ids", param="prompt", code="invalid_value")
    return [fim.text(item, req.suffix) for item in items]


def prompt_tokens_kept(service: Service, k: int | None) -> int | None:
    """How many of a prompt's last tokens truncate_prompt_tokens keeps (-1: the context), None to keep them all;
    a 400 naming the field for 0 or more than the context."""
    if k is None:
        return None
    if k == 0 or k > service.max_seq_len:
        raise ServiceError(400, f"truncate_prompt_tokens must be -1 (the context) or 1 .. {service.max_seq_len} (this "
                           f"server's context), got {k}", param="truncate_prompt_tokens", code="invalid_value")
    return service.max_seq_len if k == -1 else k


def truncated(ids: list[int], keep: int | None) -> list[int]:
    """The prompt's last `keep` tokens (vLLM's truncate_prompt_tokens: the start is dropped)."""
    return ids if keep is None else ids[-keep:]


def prompt_items(req: CompletionRequest) -> list[str | list[int]]:
    """A completion request's prompts: its text, texts, ids or lists of ids, as a list."""
    return as_items(req.prompt)


def as_items(raw: str | list) -> list[str | list[int]]:
    """A text, texts, one prompt's ids or lists of ids (OpenAI's prompt and input fields), as a list of prompts."""
    return [raw] if is_single(raw) else list(raw)


def is_single(raw: str | list) -> bool:
    """Whether the field holds one prompt (a text or one prompt's ids), not a list of them."""
    return isinstance(raw, str) or bool(raw and isinstance(raw[0], int))


def _params(service: Service, req: CompletionRequest | ChatCompletionRequest, *, max_tokens: int | None,
            logprobs: int | None, constraint: Constraint | None,
            param_names: dict[str, str] | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
    """The request's one SamplingParams (the n sub-requests differ only in their seed)."""
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    optional = {"temperature": req.temperature, "top_p": req.top_p, "min_p": req.min_p,
                "repetition_penalty": req.repetition_penalty,
                "top_k": 0 if req.top_k == -1 else req.top_k}  # -1 is vLLM's "off"
    grammar = compile_constraint(service, constraint) if constraint is not None else None
    _reject_vllm_unsupported(req)
    return service.sampling_params(
        param_names=param_names, constraint=grammar, max_tokens=max_tokens, n=req.n, stop=stop, seed=req.seed,
        stop_token_ids=service.token_ids(req.stop_token_ids or (), "stop_token_ids"),
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output, min_tokens=req.min_tokens,
        allowed_token_ids=None if req.allowed_token_ids is None else service.token_ids(req.allowed_token_ids,
                                                                                       "allowed_token_ids"),
        logit_bias=_logit_bias(service, req.logit_bias),
        logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        ignore_eos=req.ignore_eos, **{k: v for k, v in optional.items() if v is not None})


def _logit_bias(service: Service, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as (id, bias) pairs, checked by Service.logit_bias."""
    bias = bias or {}
    bad = [key for key in bias if not (key.isascii() and key.isdecimal())]
    if bad:
        raise ServiceError(400, f"logit_bias keys must be token ids in [0, {service.vocab_size}), got {bad[0]!r}",
                           param="logit_bias", code="invalid_value")
    return service.logit_bias([(int(key), value) for key, value in bias.items()])


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """A request's messages as the chat template takes them (text parts joined; other parts a 400)."""
    return [_message(m, i) for i, m in enumerate(messages)]


def _message(message: ChatMessage, index: int) -> dict[str, Any]:
    entry: dict[str, Any] = {"role": message.role, "content": _message_text(message, index)}
    if message.name is not None:
        entry["name"] = message.name
    if message.tool_calls:
        entry["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    thinking = message.reasoning_content if message.reasoning_content is not None else message.reasoning
    if thinking is not None:
        entry["reasoning_content"] = thinking
    return entry


def _message_text(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    param = f"messages.{index}.content"
    for j, part in enumerate(content):
        if part.get("type") != "text":
            raise ServiceError(400, f"only text content parts are supported, got type {part.get('type')!r}",
                               param=param, code="unsupported")
        if not isinstance(part.get("text"), str):
            got = "missing" if "text" not in part else f"a {type(part['text']).__name__}, not a string"
            raise ServiceError(400, f"{param}.{j}.text is {got}: a text part carries its text as a string",
                               param=f"{param}.{j}.text", code="invalid_value")
        try:
            texts.append(valid_unicode(part["text"]))
        except ValueError as exc:
            raise ServiceError(400, str(exc), param=param, code="invalid_value") from None
    return "".join(texts)


def _reject_vllm_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    """vLLM's fields this server does not implement, at anything but their neutral value: a 400 naming the field."""
    if req.prompt_logprobs is not None:
        raise ServiceError(400, "prompt_logprobs is not supported by this server (on /v1/completions, echo with "
                           "logprobs returns the prompt's log-probabilities)", param="prompt_logprobs",
                           code="unsupported")
    _reject_unsupported(req.use_beam_search, "use_beam_search", req.bad_words, "bad_words")


def _reject_unsupported(*pairs: Any) -> None:
    for value, name in zip(pairs[::2], pairs[1::2]):
        if value:
            raise ServiceError(400, f"{name} is not supported by this server", param=name, code="unsupported")


# ---- responses -----------------------------------------------------------------------------------


def _reason(d: Delta) -> str | None:
    return None if d.finish_reason is None else d.finish_reason.value


def sse_event(chunk: BaseModel, include_usage: bool) -> bytes:
    """A streamed chunk as its SSE event. OpenAI sends "usage": null on every chunk when usage was
    asked for, and no key otherwise."""
    return b"data: " + chunk.model_dump_json(exclude=None if include_usage else {"usage"}).encode() + b"\n\n"


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
        p, c = self.gen.prompt_tokens, self.gen.completion_tokens
        return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)

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
        self.tools = tool_plan(body.tools, body.tool_choice)
        self.tool_streams = [ToolStream(self.tools) for _ in range(gen.num_choices)] if self.tools else []
        # a reasoning model's choices: whether each starts inside the thinking, and its stream's split
        self.reasoning, self.include_reasoning = service.reasoning, body.include_reasoning
        self.inside = [self.reasoning.starts_inside(gen.prompt_ids(i)) for i in range(gen.num_choices)] \
            if self.reasoning else []
        self.reasoning_streams = [ReasoningStream(self.reasoning, inside) for inside in self.inside]

    def usage(self) -> Usage:
        p, c = self.gen.prompt_tokens, self.gen.completion_tokens
        return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)

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
