"""The output side, on its own thread: detokenization, stop strings, per-request metrics and the
thread -> asyncio bridge; the one place that holds the tokenizer. The scheduler only enqueues one
list of `Emit` records (token ids, by the key it opened the request with) per step.

Backpressure: a slow consumer never blocks the engine or this thread. Deltas a consumer has not
taken yet are merged into one pending Delta (text concatenated, ids appended), so what waits per
request is bounded by its text, not by the number of steps, and at most one wake-up per stream
is queued on its event loop at a time.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from typing import Callable, Sequence

from slipstream.engine.request import FinishReason, Request, TokenLogprob
from slipstream.models.tokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Delta:
    text: str                            # complete UTF-8; never any part of a matched stop string
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None  # one per token when requested
    finish_reason: FinishReason | None   # set on the last Delta
    error: str | None = None             # for the log only: may hold engine internals
    index: int = 0                       # the choice within its API request (set by the server)


@dataclasses.dataclass(frozen=True)
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: FinishReason
    prompt_tokens: int
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class RequestMetrics:
    """Emitted once per finished request to the scheduler's listeners."""

    request_id: str
    input_length: int
    output_length: int
    queue_time_s: float          # first admission - arrival (whole wait if never admitted)
    ttft_s: float | None         # first token delivered - arrival
    tpot_s: list[float]          # per-output-token latencies after the first (step to step)
    finish_reason: FinishReason


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
        self._pending: tuple[list[str], list[int], list[TokenLogprob]] | None = None
        self._ended = False  # the consumer has taken the final Delta
        self._admitted = False  # the engine took it up: its first step is launched (see admitted())
        # The whole completion, for result(); bounded by the text like the pending Delta.
        self._text: list[str] = []
        self._ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []
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
        text, ids, logprobs = self._pending
        self._pending = None
        final = self._done.is_set()
        self._ended = final
        return Delta(text="".join(text), token_ids=ids,
                     logprobs=logprobs if self._want_logprobs else None,
                     finish_reason=self._finish if final else None,
                     error=self._error if final else None)

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
                              error=self._error)

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def _push(self, text: str, ids: list[int], logprobs: list[TokenLogprob],
              finish: FinishReason | None, error: str | None = None, wakes: list | None = None) -> None:
        """Output thread: add one delta, merging it into the one the consumer has not taken. The
        consumer's event loop is woken now, or with the rest of `wakes` (see wake_all)."""
        with self._lock:
            self._text.append(text)
            self._ids.extend(ids)
            self._logprobs.extend(logprobs)
            self._finish, self._error = finish, error
            if self._pending is None:
                self._pending = ([], [], [])
            self._pending[0].append(text)
            self._pending[1].extend(ids)
            self._pending[2].extend(logprobs)
            if finish is not None:
                self._done.set()  # under the lock: _take sees the final state with its text
            # only a waiting consumer needs a wake-up; a busy one takes the delta when it looks next
            loop = self._loop if self._waiter is not None and not self._wake_queued else None
            self._wake_queued = self._wake_queued or loop is not None
        if loop is not None:
            if wakes is not None:
                wakes.append((loop, self._on_wake))
            else:
                wake_all([(loop, self._on_wake)])

    def _mark_admitted(self, wakes: list | None = None) -> None:
        """Output thread: the engine launched the request's first step (wakes a waiting admitted())."""
        with self._lock:
            self._admitted = True
            loop = self._loop if self._waiter is not None and not self._wake_queued else None
            self._wake_queued = self._wake_queued or loop is not None
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


class Tracker:
    """Output-thread state of one request: detokenizer, held-back text, timings."""

    def __init__(self, request: Request, stream: RequestStream, tokenizer) -> None:
        self.request = request
        self.stream = stream
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops = request.params.stop
        self.held = ""          # text that might be the start of a stop string
        self.done = False
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None  # delivered to the stream
        self.last_step_at = 0.0                   # when the engine produced the latest token
        self.tpot: list[float] = []
        self.num_tokens = 0

    def feed(self, piece: str) -> tuple[str, bool]:
        """Text safe to emit after `piece`; True when a stop string matched (text cut before it)."""
        if not self.stops:  # nothing to match or hold back (the usual case, once per token)
            buf, self.held = self.held + piece, ""
            return buf, False
        buf = self.held + piece
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.held = ""
            return buf[:cut], True
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buf)), hold, -1):
                if buf.endswith(stop[:k]):
                    hold = k
                    break
        self.held = buf[len(buf) - hold:]
        return buf[:len(buf) - hold], False

    def timings(self, count: int, produced_at: float, now: float) -> None:
        if count == 0:
            return
        if self.first_token_at is None:
            self.first_token_at = now
            self.tpot.extend([0.0] * (count - 1))
        else:
            # Engine time, so a busy output thread does not distort the decode latency.
            self.tpot.extend([(produced_at - self.last_step_at) / count] * count)
        self.last_step_at = produced_at
        self.num_tokens += count


@dataclasses.dataclass(frozen=True, slots=True)
class Emit:
    """What the engine thread reports for one request in one step."""

    key: int                                   # as given to OutputProcessor.open
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob | None, ...] | None = None
    finish_reason: FinishReason | None = None  # STOP here means the last id is an EOS/stop token
    error: str | None = None
    admitted_at: float | None = None


_CLOSE = object()


class OutputProcessor:
    """Owns the output thread and a Tracker per open request, for one scheduler. `release(request_id)`
    asks the scheduler to drop a request that a stop string finished; `on_finish` receives each
    request's metrics (on this thread)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._release: Callable[[str], None] = lambda request_id: None
        self._on_finish: Callable[[RequestMetrics], None] = lambda metrics: None
        # Added by open (a submitting thread), removed by this thread when the request ends: keys are
        # never reused, so each is touched by one thread at a time.
        self._trackers: dict[int, Tracker] = {}
        # unbounded, and in C: the engine thread must never block here, nor run Python-level locking per step
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._wakes: list | None = None  # while a step's records are handled: the wake-ups they owe
        self._thread = threading.Thread(target=self._run, name="slipstream-output", daemon=True)

    def start(self, release: Callable[[str], None], on_finish: Callable[[RequestMetrics], None]) -> None:
        if self._thread.ident is not None:
            raise RuntimeError("this OutputProcessor is started already: each scheduler needs its own")
        self._release, self._on_finish = release, on_finish
        self._thread.start()

    def open(self, request: Request, key: int, cancel: Callable[[str], None]) -> RequestStream:
        """Track a new request under `key` (unique for this processor's life); returns its stream."""
        tracker = Tracker(request, RequestStream(request, cancel), self._tokenizer)
        self._trackers[key] = tracker
        return tracker.stream

    def put(self, records: list[Emit]) -> None:
        if records:
            self._queue.put((time.monotonic(), records))

    def close(self, timeout: float | None = None) -> None:
        """Deliver everything queued so far, then stop the thread."""
        self._queue.put(_CLOSE)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _CLOSE:
                return
            produced_at, records = item
            now = time.monotonic()
            self._wakes = []  # the streams this step's records woke: one wake-up per event loop
            try:
                self._handle_all(records, produced_at, now)
            finally:
                wakes, self._wakes = self._wakes, None
                wake_all(wakes)

    def _handle_all(self, records: list[Emit], produced_at: float, now: float) -> None:
        for record in records:
            tr = self._trackers.get(record.key)
            if tr is None:
                continue  # finished here by a stop string; the engine had not dropped it yet
            try:
                self._handle(tr, record, produced_at, now)
            except Exception:  # noqa: BLE001 - one bad request must not stop the rest
                # The traceback stays in the log; the client learns only that its request failed.
                log.exception("output processing failed for %s", tr.request.request_id)
                if not tr.done:
                    self._release(tr.request.request_id)
                self._finish(tr, [], [], FinishReason.ERROR, now, error="output processing failed")
            if tr.done:
                del self._trackers[record.key]

    def _handle(self, tr: Tracker, rec: Emit, produced_at: float, now: float) -> None:
        if rec.admitted_at is not None and tr.admitted_at is None:
            tr.admitted_at = rec.admitted_at
            tr.stream._mark_admitted(wakes=self._wakes)
        text: list[str] = []
        ids: list[int] = []
        logprobs: list[TokenLogprob] = []
        finish, stopped = rec.finish_reason, False
        for i, token in enumerate(rec.token_ids):
            ids.append(token)
            if rec.logprobs is not None and rec.logprobs[i] is not None:
                logprobs.append(rec.logprobs[i])
            if finish is FinishReason.STOP and i == len(rec.token_ids) - 1:
                break  # EOS / stop token: counted as generated, never shown as text
            piece, stopped = tr.feed(tr.detok.add(token))
            text.append(piece)
            if stopped:
                finish = FinishReason.STOP
                break
        if finish is not None and not stopped:
            # The stream ends: what the detokenizer or the stop check held back is text now.
            piece, stopped = tr.feed(tr.detok.flush())
            text.append(piece if stopped else piece + tr.held)
            finish = FinishReason.STOP if stopped else finish
            tr.held = ""
        tr.timings(len(ids), produced_at, now)
        if finish is not None:
            if stopped and rec.finish_reason is None:
                # Before the stream ends: whoever sees the end may count on the slot being released.
                self._release(tr.request.request_id)
            self._finish(tr, text, ids, finish, now, logprobs=logprobs, error=rec.error)
        elif ids:
            tr.stream._push("".join(text), ids, logprobs, None, wakes=self._wakes)

    def _finish(self, tr: Tracker, text: list[str], ids: list[int], finish: FinishReason,
                now: float, logprobs: Sequence[TokenLogprob] = (), error: str | None = None
                ) -> None:
        if tr.done:
            return
        tr.done = True
        if finish is FinishReason.ERROR and error is None:
            error = "request failed"
        req = tr.request
        waited_until = tr.admitted_at if tr.admitted_at is not None else now
        metrics = RequestMetrics(
            request_id=req.request_id, input_length=len(req.prompt_ids),
            output_length=tr.num_tokens, queue_time_s=max(0.0, waited_until - req.arrival_time),
            ttft_s=None if tr.first_token_at is None else tr.first_token_at - req.arrival_time,
            tpot_s=list(tr.tpot), finish_reason=finish)
        try:
            # Before the final push, so a client that saw its request end also sees it counted.
            self._on_finish(metrics)
        except Exception:  # noqa: BLE001 - a broken listener must not stop the output thread
            log.exception("metrics listener failed for %s", req.request_id)
        tr.stream._push("".join(text), ids, list(logprobs), finish, error, wakes=self._wakes)
