"""What the service hands the front ends: a validated, tokenized request (`Prepared`) and the stream of Deltas of its
sub-requests (`Generation`, prompts x n merged into one stream indexed by choice)."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, AsyncIterator, Callable

from slipstream.engine.request import FinishReason, SamplingParams
from slipstream.engine.request_stream import Delta
from slipstream.engine.scheduler import RequestStream
from slipstream.server.errors import ServiceError, service_error

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A validated, tokenized request, ready for `Service.submit`."""

    prompts: list[list[int]]
    params: SamplingParams
    id_prefix: str = "cmpl"        # response id prefix: cmpl / chatcmpl / decode
    prompt_param: str = "prompt"   # the API field a too-long prompt is blamed on
    lora: Any = None               # the LoRA adapter the request's model names (None: the base model)
    priority: int = 0              # lower runs first, and preempts running requests of a higher value
    images: tuple[Any, ...] = ()   # engine.request.ImageInput of its one prompt (a vision-language model's chat)


class Generation:
    """The sub-requests of one API request (prompts x n), merged into one stream of Deltas whose
    `index` is the choice (prompt_index * n + sample).

    Consume it on the event loop it was created on. Leaving the iteration early (client gone,
    task cancelled) cancels every unfinished sub-request, which frees their slots and pages.
    """

    def __init__(self, gen_id: str, streams: list[RequestStream], prompt_tokens: int,
                 on_done: Callable[[], None] | None = None, prompts: list[list[int]] | None = None) -> None:
        self.id = gen_id
        self.prompt_tokens = prompt_tokens
        self._prompts = prompts or []  # per prompt, its token ids (choices: each prompt's n in turn)
        self.completion_tokens = 0
        self._streams = streams
        self._open = set(range(len(streams)))
        self._cut: set[int] = set()  # choices the front end ended early (cut): their further Deltas are dropped
        self._on_done = on_done  # called once, when the generation ends or is cancelled

    @property
    def num_choices(self) -> int:
        return len(self._streams)

    @property
    def cached_tokens(self) -> int:
        """Of prompt_tokens, how many the prefix cache held (each prompt counted once, as prompt_tokens counts it)."""
        if not self._prompts:
            return 0
        return sum(s.cached_tokens for s in self._streams[::len(self._streams) // len(self._prompts)])

    def cached_in(self, index: int) -> int:
        """The prompt tokens of choice `index` the prefix cache held."""
        return self._streams[index].cached_tokens

    def prompt_ids(self, index: int) -> list[int]:
        """The token ids of choice `index`'s prompt."""
        return self._prompts[index * len(self._prompts) // len(self._streams)]

    def cancel(self) -> None:
        """Cancel the unfinished sub-requests; idempotent."""
        for i in sorted(self._open):
            self._streams[i].cancel()
        self._open.clear()
        done, self._on_done = self._on_done, None
        if done is not None:
            done()

    def cut(self, index: int) -> None:
        """End choice `index` early (a front end's own stop condition): its sub-request is cancelled and `deltas`
        yields nothing more of it. The others go on."""
        if index in self._open:
            self._cut.add(index)
            self._open.discard(index)
            self._streams[index].cancel()

    async def admitted(self, timeout: float) -> None:
        """Wait until the engine took up every choice (launched its first step; or it ended), at most
        `timeout` seconds (RequestStream.admitted)."""
        try:
            await asyncio.wait_for(asyncio.gather(*(s.admitted() for s in self._streams)), timeout)
        except TimeoutError:
            pass  # still queued: the caller goes on (a response's headers need not wait for the queue)

    async def deltas(self) -> AsyncIterator[Delta]:
        """Deltas of all choices in arrival order; raises ServiceError if a choice fails."""
        if len(self._streams) == 1:  # one choice (most requests): no pump task and queue per token
            stream = self._streams[0]
            try:
                while True:
                    try:
                        delta = await stream.__anext__()
                    except StopAsyncIteration:
                        break
                    except Exception as exc:  # noqa: BLE001 - as the pumps hand it on below
                        raise service_error(exc)
                    if self._cut:
                        break
                    yield self._checked(0, delta)
                self._open.discard(0)
            finally:
                self.cancel()
            return
        # Bounded: while the consumer is slow the pumps wait, and each RequestStream merges what
        # arrives meanwhile into one pending Delta instead of this queue growing per token.
        queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue(maxsize=len(self._streams))

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
                elif index in self._cut:
                    continue
                elif isinstance(item, BaseException):
                    raise service_error(item)
                else:
                    yield self._checked(index, item)
        finally:
            for task in tasks:
                task.cancel()
            self.cancel()

    async def collect(self) -> list[Delta]:
        """One Delta per choice holding its whole output."""
        parts: list[list[Delta]] = [[] for _ in self._streams]
        async for delta in self.deltas():
            parts[delta.index].append(delta)
        # Every stream ends with a Delta carrying its finish reason, so no choice is empty.
        return [Delta(index=index, text="".join(d.text for d in deltas),
                      token_ids=[t for d in deltas for t in d.token_ids],
                      logprobs=None if deltas[0].logprobs is None else [lp for d in deltas for lp in d.logprobs or ()],
                      finish_reason=deltas[-1].finish_reason,
                      prompt_logprobs=next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None),
                      embedding=deltas[-1].embedding)
                for index, deltas in enumerate(parts)]

    def _checked(self, index: int, delta: Delta) -> Delta:
        reason = delta.finish_reason
        if reason is not None:
            self._open.discard(index)
        if reason is FinishReason.ERROR:
            # The engine's message stays in the log. 503, not 500: a client or load balancer
            # should retry these on another replica.
            log.error("generation %s choice %d failed: %s", self.id, index, delta.error)
            raise ServiceError(503, f"generation failed on the engine; retry (request {self.id})",
                               code="engine_error")
        if reason is FinishReason.CANCELLED:
            raise ServiceError(503, "the server cancelled this request (shutting down?)", code="cancelled")
        self.completion_tokens += len(delta.token_ids)
        return delta if delta.index == index else dataclasses.replace(delta, index=index)
