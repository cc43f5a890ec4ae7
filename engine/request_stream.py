"""The thread -> asyncio bridge of one request's output: `RequestStream`, the async iterator of Deltas the
output thread (engine/output.py) pushes to and a consumer on an event loop takes from, plus a blocking
`result()` for sync callers. No JAX, no tokenizer here.
"""
from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Any, Callable

from slipstream.engine.request import FinishReason, Request, TokenLogprob


@dataclasses.dataclass(frozen=True)
class Delta:
    text: str                            # complete UTF-8; never any part of a matched stop string
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None  # one per token when requested
    finish_reason: FinishReason | None   # set on the last Delta
    error: str | None = None             # for the log only: may hold engine internals
    index: int = 0                       # the choice within its API request (set by the server)
    # SamplingParams.prompt_logprobs: in the first Delta, one per prompt token (None for the first)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    embedding: Any = None  # SamplingParams.pooling: in the last Delta, the prompt's embedding (numpy f32[D])


@dataclasses.dataclass(frozen=True)
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: FinishReason
    prompt_tokens: int
    error: str | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None  # as Delta's
    embedding: Any = None  # as Delta's


class RequestStream:
    """Async iterator of Deltas for one request, plus a blocking `result()` for sync callers."""

    def __init__(self, request: Request, cancel: Callable[[str], None]) -> None:
        self.request_id = request.request_id
        self.prompt_tokens = len(request.prompt_ids)
        self._cancel = cancel
        self._want_logprobs = request.params.logprobs is not None
        self._lock = threading.Lock()
        self._done = threading.Event()
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None  # bound on the first __anext__
        # The consumer's future while it waits for a delta (a bare future: one per wait, no Event),
        # and whether a wake-up for it is queued on its loop already.
        self._waiter: asyncio.Future | None = None
        self._wake_queued = False
        # Not yet taken by the consumer: merged, built into one Delta when taken.
        self._pending: list | None = None  # [texts, ids, logprobs, prompt logprobs]
        self._ended = False  # the consumer has taken the final Delta
        self._admitted = False  # the engine took it up: its first step is launched (see admitted())
        self.cached_tokens = 0  # of the prompt, how many tokens the prefix cache held when it was admitted
        # The whole completion, for result(); bounded by the text like the pending Delta.
        self._text: list[str] = []
        self._ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []
        self._prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
        self._embedding: Any = None
        self._finish: FinishReason | None = None
        self._error: str | None = None

    def cancel(self) -> None:
        self._cancel(self.request_id)

    def __aiter__(self) -> "RequestStream":
        return self

    def _bind(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            with self._lock:
                if self._loop is not loop:
                    if self._loop is not None and not self._loop.is_closed():
                        raise RuntimeError(f"stream {self.request_id} is bound to another event loop")
                    self._loop, self._waiter, self._wake_queued = loop, None, False
        return loop

    async def admitted(self) -> None:
        """Return once the engine took the request up (the step with its first chunk is launched), or
        something of it is ready to take, or it ended. A streaming response that waits for this before
        its headers leaves the engine thread the host to itself (the GIL) while it admits the request and
        launches that step; the headers then go out while the device runs it."""
        loop = self._bind()
        while True:
            with self._lock:
                if self._admitted or self._pending is not None or self._ended:
                    return
                waiter = self._waiter = loop.create_future()
            await waiter

    async def __anext__(self) -> Delta:
        loop = self._bind()
        while True:
            with self._lock:
                delta = self._take()
                if delta is None:
                    if self._ended:
                        raise StopAsyncIteration
                    # set with the look, under the lock: a delta pushed after it wakes this waiter
                    waiter = self._waiter = loop.create_future()
            if delta is not None:
                return delta
            await waiter

    def _take(self) -> Delta | None:
        if self._pending is None:
            return None
        text, ids, logprobs, prompt_logprobs = self._pending
        self._pending = None
        final = self._done.is_set()
        self._ended = final
        return Delta(text="".join(text), token_ids=ids,
                     logprobs=logprobs if self._want_logprobs else None,
                     finish_reason=self._finish if final else None,
                     error=self._error if final else None, prompt_logprobs=prompt_logprobs,
                     embedding=self._embedding if final else None)

    def result(self, timeout: float | None = None) -> Completion:
        """Block until the request finishes; not from the event loop (it would stall it)."""
        if not self._done.is_set() and _in_event_loop():
            raise RuntimeError("RequestStream.result() blocks; iterate the stream with "
                               "`async for` inside an event loop")
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        with self._lock:
            return Completion(request_id=self.request_id, text="".join(self._text),
                              token_ids=list(self._ids),
                              logprobs=list(self._logprobs) if self._want_logprobs else None,
                              finish_reason=self._finish, prompt_tokens=self.prompt_tokens,
                              error=self._error, prompt_logprobs=self._prompt_logprobs, embedding=self._embedding)

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def _push(self, text: str, ids: list[int], logprobs: list[TokenLogprob],
              finish: FinishReason | None, error: str | None = None, wakes: list | None = None,
              prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None, embedding: Any = None) -> None:
        """Output thread: add one delta, merging it into the one the consumer has not taken. The
        consumer's event loop is woken now, or with the rest of `wakes` (see wake_all)."""
        with self._lock:
            self._text.append(text)
            self._ids.extend(ids)
            self._logprobs.extend(logprobs)
            self._finish, self._error = finish, error
            if self._pending is None:
                self._pending = [[], [], [], None]
            self._pending[0].append(text)
            self._pending[1].extend(ids)
            self._pending[2].extend(logprobs)
            if prompt_logprobs is not None:
                self._prompt_logprobs = self._pending[3] = prompt_logprobs
            if embedding is not None:
                self._embedding = embedding
            if finish is not None:
                self._done.set()  # under the lock: _take sees the final state with its text
            loop = self._claim_wake()
        self._wake(loop, wakes)

    def _mark_admitted(self, wakes: list | None = None) -> None:
        """Output thread: the engine launched the request's first step (wakes a waiting admitted())."""
        with self._lock:
            self._admitted = True
            loop = self._claim_wake()
        self._wake(loop, wakes)

    def _claim_wake(self) -> asyncio.AbstractEventLoop | None:
        """Under the lock: the loop to wake, if its consumer waits and no wake-up for it is queued yet (only a
        waiting consumer needs one; a busy one looks when it is next free)."""
        loop = self._loop if self._waiter is not None and not self._wake_queued else None
        self._wake_queued = self._wake_queued or loop is not None
        return loop

    def _wake(self, loop: asyncio.AbstractEventLoop | None, wakes: list | None) -> None:
        """Wake `loop`'s consumer now, or with the rest of `wakes` (see wake_all)."""
        if loop is not None:
            if wakes is not None:
                wakes.append((loop, self._on_wake))
            else:
                wake_all([(loop, self._on_wake)])

    def _on_wake(self) -> None:
        # Without the lock (the output thread may hold it, waiting for the GIL, while this runs for many
        # streams): only the loop's thread sets a waiter, a push that sees none here or the flag still set
        # queues nothing, and the woken consumer looks under the lock, after that push, either way.
        waiter, self._waiter = self._waiter, None
        self._wake_queued = False
        if waiter is not None and not waiter.done():  # done: its task was cancelled while it waited
            waiter.set_result(None)


def wake_all(wakes: list) -> None:
    """Run each (loop, callback) on its loop: one call_soon_threadsafe per loop, not per stream (a
    step's tokens for many streams on one event loop would otherwise wake it once per stream)."""
    by_loop: dict = {}
    for loop, callback in wakes:
        by_loop.setdefault(loop, []).append(callback)
    for loop, callbacks in by_loop.items():
        try:
            loop.call_soon_threadsafe(_call_each, callbacks)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


def _call_each(callbacks: list) -> None:
    for callback in callbacks:
        callback()


def _in_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
