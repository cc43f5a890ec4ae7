"""Transport-neutral serving layer (HTTP and gRPC both call it; no FastAPI/grpc types here): prompt ->
token ids -> SamplingParams -> scheduler -> per-choice deltas. Every failure a client can see is a
`ServiceError` with an HTTP-style status that each transport maps to its own codes."""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import uuid
from typing import Any, AsyncIterator, Sequence

import jinja2

from engine.api import Engine
from engine.request import FinishReason, InvalidParam, Request, SamplingParams, TokenLogprob
from engine.output import Delta
from engine.scheduler import EngineUnavailable, Overloaded, PromptTooLong, RequestStream, Scheduler
from server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest


class ServiceError(Exception):
    """A request failed in a way the client should see: `status` is the HTTP status to answer with."""

    _TYPES = {429: "rate_limit_error"}  # OpenAI itself answers 401 with invalid_request_error

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    @property
    def type(self) -> str:
        if self.status >= 500:
            return "server_error"
        return self._TYPES.get(self.status, "invalid_request_error")


def check_api_key(expected: str | None, presented: str | None) -> None:
    """Raise 401 unless `presented` matches `expected` (no key configured: everything passes)."""
    if expected is None:
        return
    if not presented:
        raise ServiceError(401, "Missing API key: send 'Authorization: Bearer <key>'.", code="invalid_api_key")
    # Constant-time compare so the key cannot be guessed byte by byte from response timing.
    if not hmac.compare_digest(presented.encode(), expected.encode()):
        raise ServiceError(401, "Incorrect API key provided.", code="invalid_api_key")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServiceConfig:
    model_name: str
    default_max_tokens: int = 16     # completions without max_tokens (OpenAI's default); chat: rest of the context
    max_choices: int = 64            # prompts x n per request; more would let one request fill the queue
    vocab_size: int | None = None    # token-id prompts outside [0, vocab_size) are rejected; default: the tokenizer's

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("model_name must be a non-empty string")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.max_choices < 1:
            raise ValueError(f"max_choices must be >= 1, got {self.max_choices}")


@dataclasses.dataclass(frozen=True)
class ChoiceDelta:
    """New output of one choice. `finish_reason` ("stop" | "length") is set on its last delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None


@dataclasses.dataclass(frozen=True)
class Choice:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A validated, tokenized request, ready for `Service.submit`."""

    prompts: list[list[int]]
    params: SamplingParams
    id_prefix: str = "cmpl"        # response id prefix: cmpl / chatcmpl
    prompt_param: str = "prompt"   # the API field a too-long prompt is blamed on


class Generation:
    """The sub-requests of one API request (prompts x n), merged into one stream of ChoiceDeltas.

    Consume it on the event loop it was created on. Leaving the iteration early (client gone,
    task cancelled) cancels every unfinished sub-request, which frees their slots and pages.
    """

    def __init__(self, gen_id: str, streams: list[RequestStream], prompt_tokens: int) -> None:
        self.id = gen_id
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self._streams = streams
        self._open = set(range(len(streams)))

    @property
    def num_choices(self) -> int:
        return len(self._streams)

    def cancel(self) -> None:
        """Cancel the unfinished sub-requests; idempotent."""
        for i in sorted(self._open):
            self._streams[i].cancel()
        self._open.clear()

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Deltas of all choices in arrival order; raises ServiceError if a choice fails."""
        # Bounded: while the consumer is slow the pumps wait, and each RequestStream merges what
        # arrives meanwhile into one pending delta instead of this queue growing per token.
        queue: asyncio.Queue[tuple[int, Delta | Exception | None]] = asyncio.Queue(maxsize=len(self._streams))

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for delta in stream:
                    await queue.put((index, delta))
            except Exception as exc:  # handed to the consumer, which raises it in the caller's context
                await queue.put((index, exc))
            await queue.put((index, None))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(self._streams)]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                    self._open.discard(index)
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield self._choice_delta(index, item)
        finally:
            for task in tasks:
                task.cancel()
            self.cancel()

    async def collect(self) -> list[Choice]:
        parts: list[list[ChoiceDelta]] = [[] for _ in self._streams]
        async for delta in self.deltas():
            parts[delta.index].append(delta)
        # Every stream ends with a delta carrying its finish reason, so no choice is empty.
        return [Choice(index=index, text="".join(d.text for d in deltas),
                       token_ids=[t for d in deltas for t in d.token_ids],
                       logprobs=None if deltas[0].logprobs is None else [lp for d in deltas for lp in d.logprobs or ()],
                       finish_reason=deltas[-1].finish_reason or "stop")
                for index, deltas in enumerate(parts)]

    def _choice_delta(self, index: int, delta: Delta) -> ChoiceDelta:
        reason = delta.finish_reason
        if reason is not None:
            self._open.discard(index)
        if reason is FinishReason.ERROR:
            # 503, not 500: these come from an engine failure or a shutdown deadline, and a client
            # or load balancer should retry them on another replica.
            raise ServiceError(503, f"generation failed: {delta.error or 'engine error'}", code="engine_error")
        if reason is FinishReason.CANCELLED:
            raise ServiceError(503, "the server cancelled this request (shutting down?)", code="cancelled")
        self.completion_tokens += len(delta.token_ids)
        return ChoiceDelta(index=index, text=delta.text, token_ids=list(delta.token_ids), logprobs=delta.logprobs,
                           finish_reason=reason.value if reason is not None else None)


class Service:
    """Holds the scheduler, tokenizer and limits; turns API requests into Generations."""

    def __init__(self, scheduler: Scheduler, engine: Engine, tokenizer: Any, config: ServiceConfig) -> None:
        self.scheduler = scheduler
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.model_name = config.model_name
        self.max_model_len = engine.max_seq_len
        self._draining = False

    # ---- lifecycle --------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.scheduler.ready and not self._draining

    @property
    def draining(self) -> bool:
        return self._draining

    def begin_drain(self) -> None:
        """Stop admitting new requests (answer 503) while in-flight ones finish."""
        self._draining = True

    # ---- request building -------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ServiceError(404, f"The model '{model}' does not exist; this server serves '{self.model_name}'.",
                               param="model", code="model_not_found")

    def encode(self, prompt: str | Sequence[int], *, add_special_tokens: bool = True,
               param: str = "prompt") -> list[int]:
        """Token ids for a text prompt, or validated ids for a pre-tokenized one."""
        if isinstance(prompt, str):
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        else:
            ids = list(prompt)
            vocab = self.config.vocab_size or getattr(self.tokenizer, "vocab_size", None)
            bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
            if bad:
                raise ServiceError(400, f"{param} contains token ids outside the vocabulary [0, {vocab}): {bad[:5]}",
                                   param=param, code="invalid_value")
        if not ids:
            raise ServiceError(400, f"{param} must not be empty", param=param, code="invalid_value")
        return ids

    def render_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        """Apply the model's chat template (with the assistant turn opened) and tokenize."""
        rendered = []
        for i, message in enumerate(messages):
            entry: dict[str, Any] = {"role": message.role, "content": _message_text(message, i)}
            if message.name is not None:
                entry["name"] = message.name
            rendered.append(entry)
        try:
            text = self.tokenizer.apply_chat_template(rendered, add_generation_prompt=True)
        except (jinja2.TemplateError, ValueError) as exc:  # e.g. a template demanding alternating roles
            raise ServiceError(400, f"the model's chat template rejected these messages: {exc}",
                               param="messages", code="invalid_value") from exc
        # The template already carries BOS and friends; adding them again would double them.
        return self.encode(text, add_special_tokens=False, param="messages")

    def sampling_params(self, *, param_names: dict[str, str] | None = None, **fields: Any) -> SamplingParams:
        """SamplingParams from API fields; a rejected value becomes a 400 naming the API field."""
        try:
            return SamplingParams(**fields)
        except InvalidParam as exc:
            param = (param_names or {}).get(exc.field, exc.field)
            message = exc.message if param == exc.field else exc.message.replace(exc.field, param, 1)
            raise ServiceError(400, message, param=param, code="invalid_value") from exc

    # ---- submission -------------------------------------------------------------------------

    def submit(self, prepared: Prepared) -> Generation:
        """Submit len(prompts) x params.n sub-requests; choice index = prompt_index * n + sample.

        All or nothing: if one sub-request is refused, the ones already admitted are cancelled.
        Call it on the event loop that will consume the Generation.
        """
        prompts, params, prompt_param = prepared.prompts, prepared.params, prepared.prompt_param
        if self._draining:
            raise ServiceError(503, "the server is shutting down", code="shutting_down")
        n = params.n
        if len(prompts) * n > self.config.max_choices:
            raise ServiceError(400, f"{len(prompts)} prompt(s) x n={n} exceeds this server's limit of "
                               f"{self.config.max_choices} choices per request", param="n", code="invalid_value")
        gen_id = f"{prepared.id_prefix}-{uuid.uuid4().hex}"
        streams: list[RequestStream] = []
        try:
            for p, prompt_ids in enumerate(prompts):
                for i in range(n):
                    seed = None if params.seed is None else (params.seed + i) % 2**63
                    sub = dataclasses.replace(params, n=1, seed=seed)
                    streams.append(self.scheduler.submit(Request(prompt_ids, sub, request_id=f"{gen_id}-{p * n + i}")))
        except Overloaded as exc:
            raise ServiceError(429, f"The server is overloaded; retry in {exc.retry_after_s:.1f}s.", code="overloaded",
                               retry_after_s=exc.retry_after_s) from exc
        except PromptTooLong as exc:
            raise ServiceError(400, str(exc), param=prompt_param, code="context_length_exceeded") from exc
        except EngineUnavailable as exc:
            raise ServiceError(503, f"The engine is not available: {exc}", code="engine_unavailable") from exc
        finally:
            if len(streams) != len(prompts) * n:
                for stream in streams:
                    stream.cancel()
        return Generation(gen_id, streams, prompt_tokens=sum(len(p) for p in prompts))

    def prepare_completion(self, req: CompletionRequest) -> Prepared:
        """Validate and tokenize; CPU only and thread-safe, so callers may run it off the event loop."""
        self.check_model(req.model)
        _reject_unsupported(req.echo, "echo", req.suffix, "suffix", req.logit_bias, "logit_bias")
        if req.best_of is not None and req.best_of != req.n:
            raise ServiceError(400, "best_of is not supported (use n)", param="best_of", code="unsupported")
        raw = req.prompt
        items = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)
        if not items:
            raise ServiceError(400, "prompt must not be empty", param="prompt", code="invalid_value")
        prompts = [self.encode(item) for item in items]
        max_tokens = req.max_tokens if req.max_tokens is not None else self.config.default_max_tokens
        params = self._params(req, max_tokens=max_tokens, logprobs=req.logprobs)
        return Prepared(prompts=prompts, params=params, id_prefix="cmpl")

    def prepare_chat(self, req: ChatCompletionRequest) -> Prepared:
        """Render the chat template, tokenize, validate; thread-safe like prepare_completion."""
        self.check_model(req.model)
        _reject_unsupported(req.tools, "tools", req.logit_bias, "logit_bias")
        if req.response_format is not None and req.response_format.get("type", "text") != "text":
            raise ServiceError(400, "only response_format {'type': 'text'} is supported", param="response_format",
                               code="unsupported")
        if req.top_logprobs is not None and not req.logprobs:
            raise ServiceError(400, "top_logprobs requires logprobs=true", param="top_logprobs", code="invalid_value")
        prompt = self.render_chat(req.messages)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - len(prompt)
            if max_tokens < 1:
                raise ServiceError(400, f"the messages are {len(prompt)} tokens, which leaves no room in the "
                                   f"model's context of {self.max_model_len} tokens", param="messages",
                                   code="context_length_exceeded")
        names = {"max_tokens": "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
                 "logprobs": "top_logprobs"}
        params = self._params(req, max_tokens=max_tokens, logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                              param_names=names)
        return Prepared(prompts=[prompt], params=params, id_prefix="chatcmpl", prompt_param="messages")

    def _params(self, req: Any, *, max_tokens: int, logprobs: int | None,
                param_names: dict[str, str] | None = None) -> SamplingParams:
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        optional = {"temperature": req.temperature, "top_p": req.top_p, "min_p": req.min_p,
                    "repetition_penalty": req.repetition_penalty,
                    "top_k": 0 if req.top_k == -1 else req.top_k}
        return self.sampling_params(
            param_names=param_names, max_tokens=max_tokens, n=req.n, stop=stop, seed=req.seed, logprobs=logprobs,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty, ignore_eos=req.ignore_eos,
            **{k: v for k, v in optional.items() if v is not None})

    def token_text(self, token_id: int) -> str:
        """One token's text for logprobs; special tokens shown, not skipped (EOS has a logprob too)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _message_text(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ServiceError(400, f"only text content parts are supported, got type {part.get('type')!r}",
                               param=f"messages.{index}.content", code="unsupported")
        texts.append(part["text"])
    return "".join(texts)


def _reject_unsupported(*pairs: Any) -> None:
    for value, name in zip(pairs[::2], pairs[1::2]):
        if value:
            raise ServiceError(400, f"{name} is not supported by this server", param=name, code="unsupported")
