"""Transport-neutral serving layer (HTTP and gRPC both call it; no FastAPI, grpc or OpenAI types
here): prompt -> token ids -> scheduler (which makes the one context-length check) -> one stream of Deltas per
API request. Every failure a client can see is a `ServiceError` (server/errors.py)."""
from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import uuid
import threading
from typing import Any, Callable, Sequence

import jinja2

from slipstream.engine.api import Engine
from slipstream.engine.lora_registry import LoraRegistry
from slipstream.engine.request import MAX_LOGIT_BIAS, Request, SamplingParams
from slipstream.engine.scheduler import RequestStream, Scheduler
from slipstream.server.errors import ServiceError, parse_input, service_error
from slipstream.server.metrics import ResponseCounts
from slipstream.server.fim import FimFormat
from slipstream.server.generation import Generation, Prepared
from slipstream.server.images import ImageInputs
from slipstream.server.reasoning import ReasoningFormat
from slipstream.server.tool_formats import FALLBACK, ToolFormat

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServiceConfig:
    model_name: str
    max_choices: int = 64            # prompts x n per request; more would let one request fill the queue
    max_prompt_bytes: int = 1 << 20  # UTF-8 bytes of one text prompt: tokenization is bounded before it starts
    max_requests_per_client: int = 0  # queued + running API requests per client (429 beyond); 0: no limit
    priority_scheduling: bool = False  # requests may carry a priority (--scheduling-policy priority)

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("model_name must be a non-empty string")
        for name in ("max_choices", "max_prompt_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_requests_per_client < 0:
            raise ValueError(f"max_requests_per_client must be >= 0 (0: no limit), got {self.max_requests_per_client}")


class Service:
    """Holds the scheduler, tokenizer and limits; turns prepared requests into Generations."""

    def __init__(self, scheduler: Scheduler, engine: Engine, tokenizer: Any, config: ServiceConfig,
                 lora: LoraRegistry | None = None, reasoning: ReasoningFormat | None = None,
                 fim: FimFormat | None = None, images: ImageInputs | None = None,
                 tool_format: ToolFormat = FALLBACK) -> None:
        self.scheduler = scheduler
        self.images = images  # a vision-language model's image inputs (None: a text-only model; image parts are a 400)
        self.tool_format = tool_format  # how chat requests' tools reach the template and calls come back
        self.reasoning = reasoning  # how chat replies' thinking is told from their answer (None: it is not)
        self.fim = fim  # the model's fill-in-the-middle tags, for completions with a suffix (None: it has none)
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.model_name = config.model_name
        self.max_seq_len = engine.max_seq_len  # /v1/models reports it as vLLM's max_model_len
        # Token-id prompts are checked against the model's vocabulary (its logits' width), the one
        # the sampler indexes, not the tokenizer's (which may count added tokens differently).
        self.vocab_size: int = engine.vocab_size
        self._draining = False
        self.responses = ResponseCounts()  # what both front ends answered (exported by /metrics)
        self._per_client: dict[str, int] = {}  # client -> its API requests queued or running
        self._per_client_lock = threading.Lock()
        self.lora = lora  # LoRA adapters a request's model may name (None: LoRA off)
        self.lora_usage = None  # server.lora.LoraUsage, which the app installs: requests and tokens per adapter

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

    def check_model(self, model: str | None) -> Any:
        """The LoRA adapter `model` names, None for the base model; 404 for any other name."""
        if model is None or model == self.model_name:
            return None
        if self.lora is not None and (adapter := self.lora.get(model)) is not None:
            return adapter
        if model is not None:
            raise ServiceError(404, f"The model {model!r} does not exist; this server serves '{self.model_name}'.",
                               param="model", code="model_not_found")

    def check_choices(self, num_prompts: int, n: int, prompt_param: str = "prompt") -> None:
        """Before any tokenization: the count of prompts x n against max_choices."""
        limit = self.config.max_choices
        if num_prompts > limit:
            raise ServiceError(400, f"{num_prompts} prompts exceed this server's limit of {limit} choices per "
                               "request", param=prompt_param, code="invalid_value")
        if num_prompts * n > limit:
            raise ServiceError(400, f"{num_prompts} prompt(s) x n={n} exceeds this server's limit of {limit} "
                               "choices per request", param="n", code="invalid_value")
        # Each choice waits in the scheduler's queue: a request with more choices than the queue holds
        # would get 429 Retry-After on an idle server forever.
        queue = self.scheduler.max_queue
        if num_prompts * n > queue:
            raise ServiceError(400, f"this request needs {num_prompts * n} queue places ({num_prompts} prompt(s) x "
                               f"n={n}); the server's queue holds {queue} (--max-queue)",
                               param="n" if n > 1 else prompt_param, code="invalid_value")

    def encode(self, prompt: str | Sequence[int], *, add_special_tokens: bool = True,
               param: str = "prompt") -> list[int]:
        """Token ids for a text prompt, or validated ids for a pre-tokenized one."""
        if isinstance(prompt, str):
            try:
                size = len(prompt.encode("utf-8"))
            except UnicodeEncodeError as exc:
                raise ServiceError(400, f"{param} must be valid Unicode: lone surrogate at index {exc.start}",
                                   param=param, code="invalid_value") from None
            if size > self.config.max_prompt_bytes:
                raise ServiceError(400, f"{param} is {size} bytes; the limit is {self.config.max_prompt_bytes}",
                                   param=param, code="context_length_exceeded")
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        else:
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ServiceError(400, f"{param} contains token ids outside the vocabulary [0, {self.vocab_size}): "
                                   f"{bad[:5]}", param=param, code="invalid_value")
        if not ids:
            raise ServiceError(400, f"{param} must not be empty", param=param, code="invalid_value")
        return ids

    def render_chat(self, messages: list[dict[str, Any]], *, param: str = "messages",
                    template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True,
                    continue_final: bool = False) -> list[int]:
        """Apply the model's chat template (render_chat_text) and tokenize."""
        text = self.render_chat_text(messages, param=param, template_kwargs=template_kwargs,
                                     add_generation_prompt=add_generation_prompt, continue_final=continue_final)
        # The template already carries BOS and friends; adding them again would double them.
        return self.encode(text, add_special_tokens=False, param=param)

    def render_chat_text(self, messages: list[dict[str, Any]], *, param: str = "messages",
                         template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True,
                         continue_final: bool = False) -> str:
        """The model's chat template applied (with the assistant turn opened; `template_kwargs`: more variables
        for it, such as Qwen3's enable_thinking). continue_final: the text ends where the final message's content
        does (what the template puts after it, an end-of-turn token, is cut), for the model to go on with it."""
        try:
            text = parse_input(param, "chat template input", self._render, messages, template_kwargs or {},
                               add_generation_prompt)
        except (jinja2.TemplateError, ValueError) as exc:  # e.g. a template demanding alternating roles
            log.info("chat template rejected a request: %s", exc)
            raise ServiceError(400, "the model's chat template rejected these messages (check the order of roles)",
                               param=param, code="invalid_value") from None
        if continue_final:
            final = messages[-1].get("content") or ""
            if isinstance(final, list):  # a vision-language model's parts (openai_api._message_parts)
                final = "".join(part.get("text", "") for part in final)
            end = text.rfind(final) if final.strip() else -1
            if end < 0:
                raise ServiceError(400, "continue_final_message: the final message's content is empty, or the chat "
                                   "template does not render it as given", param=param, code="invalid_value")
            text = text[:end + len(final)]
        return text

    def _render(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any],
                add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  **template_kwargs)

    def sampling_params(self, *, param_names: dict[str, str] | None = None, base: SamplingParams | None = None,
                        **fields: Any) -> SamplingParams:
        """SamplingParams from API fields (`base` with these changed); a rejected value becomes a 400 naming the API
        field."""
        try:
            return SamplingParams(**fields) if base is None else dataclasses.replace(base, **fields)
        except ValueError as exc:
            err = service_error(exc)
            if err.param is not None and param_names and err.param in param_names:
                name = param_names[err.param]
                err = ServiceError(400, err.message.replace(err.param, name, 1), param=name, code=err.code)
            raise err from None

    def logit_bias(self, pairs: Sequence[tuple[int, float]],
                   param: str = "logit_bias") -> tuple[tuple[int, float], ...]:
        """(token id, bias) pairs checked against the vocabulary and the count a slot holds (the biases' range
        is SamplingParams' check)."""
        if len(pairs) > MAX_LOGIT_BIAS:
            raise ServiceError(400, f"{param} must bias at most {MAX_LOGIT_BIAS} tokens, got {len(pairs)}",
                               param=param, code="invalid_value")
        bad = [token for token, _ in pairs if not 0 <= token < self.vocab_size]
        if bad:
            raise ServiceError(400, f"{param} keys must be token ids in [0, {self.vocab_size}), got {bad[:5]}",
                               param=param, code="invalid_value")
        return tuple((int(token), float(bias)) for token, bias in pairs)

    def token_text(self, token_id: int) -> str:
        """One token's text for logprobs; special tokens shown, not skipped (EOS has a logprob too)."""
        if (text := getattr(self.tokenizer, "token_text", None)) is not None:
            return text(token_id)  # models/tokenizer.Tokenizer: a SentencePiece piece keeps its space
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # ---- submission -------------------------------------------------------------------------

    async def start(self, prepare: Callable[[], Prepared], client: str | None = None) -> Generation:
        """`prepare()` (validation, tokenization) and `submit` together on a worker thread, off the event loop.

        Submitted there, the engine thread takes the request up as soon as it is tokenized; submitted from the
        loop, it waited for the GIL until the loop had begun the response and gone idle (~0.8 ms for a lone
        1024-token request on a 2-core host), after the hop back. If the caller is cancelled meanwhile, the
        Generation is cancelled as soon as it exists, so its requests and client place are not left behind.
        """
        work = asyncio.get_running_loop().run_in_executor(
            None, contextvars.copy_context().run, lambda: self.submit(prepare(), client))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            work.add_done_callback(_cancel_generation)
            raise

    def submit(self, prepared: Prepared, client: str | None = None) -> Generation:
        """Submit len(prompts) x params.n sub-requests; choice index = prompt_index * n + sample.

        All or nothing: if one sub-request is refused, the ones already admitted are cancelled.
        `client` identifies the caller for --max-requests-per-client (None: not limited).
        Consume the Generation on one event loop: its streams bind to the loop that first iterates
        them (created on a worker thread, as `start` does) or that was running when they were made.
        """
        prompts, params = prepared.prompts, prepared.params
        if self._draining:
            raise ServiceError(503, "the server is shutting down", code="shutting_down")
        n = params.n
        self.check_choices(len(prompts), n, prepared.prompt_param)
        release = self.hold_client_place(client)
        try:
            return self._submit(prepared, release)
        except BaseException:
            release()
            raise

    def check_priority(self, priority: int, param: str = "priority") -> int:
        """A request's priority, allowed only under --scheduling-policy priority (else any but 0 is a 400, as
        on vLLM: one client must not jump the others' queue unless the operator said so)."""
        if priority and not self.config.priority_scheduling:
            raise ServiceError(400, f"{param} {priority} needs a server started with --scheduling-policy priority "
                               "(this one serves first come, first served)", param=param, code="unsupported")
        return priority

    def token_ids(self, ids: Sequence[int], param: str) -> tuple[int, ...]:
        """Token ids a request field names, checked against the vocabulary (a 400 naming the field)."""
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ServiceError(400, f"{param} must be token ids in [0, {self.vocab_size}), got {bad[0]}",
                               param=param, code="invalid_value")
        return tuple(ids)

    def hold_client_place(self, client: str | None) -> Callable[[], None]:
        """Count one more request for `client` (429 past the limit); returns what gives it back."""
        limit = self.config.max_requests_per_client
        if not limit or client is None:
            return lambda: None
        with self._per_client_lock:
            held = self._per_client.get(client, 0)
            if held >= limit:
                raise ServiceError(429, f"this client has {held} requests queued or running; the limit is {limit} "
                                   "per client (--max-requests-per-client)", code="too_many_requests",
                                   retry_after_s=1.0)
            self._per_client[client] = held + 1

        def release() -> None:
            with self._per_client_lock:
                left = self._per_client.pop(client) - 1
                if left:
                    self._per_client[client] = left

        return release

    def _submit(self, prepared: Prepared, release: Callable[[], None]) -> Generation:
        prompts, params = prepared.prompts, prepared.params
        n = params.n
        gen_id = f"{prepared.id_prefix}-{uuid.uuid4().hex}"
        streams: list[RequestStream] = []
        try:
            for p, prompt_ids in enumerate(prompts):
                for i in range(n):
                    # one SamplingParams per request; with n > 1 each sample gets its own seed
                    sub = params if n == 1 else dataclasses.replace(
                        params, n=1, seed=None if params.seed is None else (params.seed + i) % 2**63)
                    streams.append(self.scheduler.submit(Request(prompt_ids, sub, request_id=f"{gen_id}-{p * n + i}",
                                                                 lora=prepared.lora, priority=prepared.priority,
                                                                 images=prepared.images)))
        except Exception as exc:
            raise service_error(exc, prompt_param=prepared.prompt_param) from exc
        finally:
            if len(streams) != len(prompts) * n:
                for stream in streams:
                    stream.cancel()
        usage, lora = self.lora_usage, prepared.lora
        if usage is None or lora is None:
            return Generation(gen_id, streams, prompt_tokens=sum(len(p) for p in prompts), on_done=release,
                              prompts=prompts)
        usage.count(lora.name, requests=1)

        def done() -> None:
            release()
            usage.count(lora.name, tokens=gen.completion_tokens)

        gen = Generation(gen_id, streams, prompt_tokens=sum(len(p) for p in prompts), on_done=done, prompts=prompts)
        return gen


def _cancel_generation(work: asyncio.Future) -> None:
    """A done callback: cancel the Generation `work` made, when nobody awaits it any more."""
    if not work.cancelled() and work.exception() is None:
        work.result().cancel()
