"""The output side, on its own thread: detokenization, stop strings and per-request metrics, pushed to
each request's RequestStream (engine/request_stream.py: the thread -> asyncio bridge); the one place
that holds the tokenizer. The scheduler only enqueues one list of `Emit` records (token ids, by the key
it opened the request with) per step.

Backpressure: a slow consumer never blocks the engine or this thread. Deltas a consumer has not
taken yet are merged into one pending Delta (text concatenated, ids appended), so what waits per
request is bounded by its text, not by the number of steps, and at most one wake-up per stream
is queued on its event loop at a time.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Callable, Sequence

from slipstream.engine.request import FinishReason, Request, TokenLogprob
from slipstream.engine.request_stream import RequestStream, wake_all
from slipstream.models.tokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)


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


class Tracker:
    """Output-thread state of one request: detokenizer, held-back text, timings."""

    def __init__(self, request: Request, stream: RequestStream, tokenizer) -> None:
        self.request = request
        self.stream = stream
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=request.params.skip_special_tokens,
                                            context=request.prompt_ids)
        self.stops = request.params.stop
        self.keep_stop = request.params.include_stop_str_in_output
        self.held = ""          # text that might be the start of a stop string
        self.done = False
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None  # delivered to the stream
        self.last_step_at = 0.0                   # when the engine produced the latest token
        self.tpot: list[float] = []
        self.num_tokens = 0
        # the prompt's scores (prompt_logprobs), until a push hands them on; a one-token prompt has nothing to score
        asked = request.params.prompt_logprobs is not None
        self.prompt_logprobs: tuple[TokenLogprob | None, ...] | None = (
            (None,) if asked and len(request.prompt_ids) == 1 else None)

    def take_prompt_logprobs(self) -> tuple[TokenLogprob | None, ...] | None:
        out, self.prompt_logprobs = self.prompt_logprobs, None
        return out

    def feed(self, piece: str, match: bool = True) -> tuple[str, bool]:
        """Text safe to emit after `piece`; True when a stop string matched (text cut before it, or after it with
        include_stop_str_in_output). match=False (short of min_tokens): no stop string applies yet."""
        if not self.stops or not match:  # nothing to match or hold back (the usual case, once per token)
            buf, self.held = self.held + piece, ""
            return buf, False
        buf = self.held + piece
        found = min(((i, -len(s)) for s in self.stops if (i := buf.find(s)) >= 0), default=None)
        if found is not None:  # the earliest match (the longest of those starting there)
            self.held = ""
            cut, longest = found
            return buf[:cut - longest if self.keep_stop else cut], True
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
    cached_tokens: int = 0                     # with admitted_at: the prompt tokens the prefix cache held
    # SamplingParams.prompt_logprobs, once all are known: one per prompt token (None for the first)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    embedding: Any = None  # SamplingParams.pooling: the prompt's embedding (numpy f32[D]), with the finish


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
            tr.stream.cached_tokens = rec.cached_tokens
            tr.stream._mark_admitted(wakes=self._wakes)
        if rec.prompt_logprobs is not None:
            tr.prompt_logprobs = rec.prompt_logprobs  # handed on with the first token (or the end)
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
            piece, stopped = tr.feed(tr.detok.add(token), match=tr.num_tokens + i + 1 >= tr.request.params.min_tokens)
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
            self._finish(tr, text, ids, finish, now, logprobs=logprobs, error=rec.error, embedding=rec.embedding)
        elif ids:
            tr.stream._push("".join(text), ids, logprobs, None, wakes=self._wakes,
                            prompt_logprobs=tr.take_prompt_logprobs())

    def _finish(self, tr: Tracker, text: list[str], ids: list[int], finish: FinishReason,
                now: float, logprobs: Sequence[TokenLogprob] = (), error: str | None = None,
                embedding: Any = None) -> None:
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
        tr.stream._push("".join(text), ids, list(logprobs), finish, error, wakes=self._wakes,
                        prompt_logprobs=None if finish is FinishReason.ERROR else tr.take_prompt_logprobs(),
                        embedding=embedding)
