"""Continuous batching on one engine thread: admission (priority, then FCFS) with prefix-cache
matching, chunked prefill under a token budget, one decode step over every ready slot, and
preemption by recompute when KV pages run out. Plain Python: no JAX here."""
from __future__ import annotations

import bisect
import collections
import dataclasses
import heapq
import itertools
import logging
import math
import threading
import time
from typing import Callable

from engine.api import DecodeRow, Engine, PrefillChunk, SlotState
from engine.block_manager import BlockManager
from engine.kv_cache import pages_needed
from engine.output import Completion, Emit, OutputProcessor, RequestMetrics, RequestStream
from engine.request import FinishReason, Request
from engine.sequence import Sequence, Status

__all__ = ["Completion", "EngineUnavailable", "Overloaded", "PromptTooLong", "RequestMetrics",
           "RequestStream", "Scheduler", "SchedulerConfig", "SchedulerStats"]

log = logging.getLogger(__name__)


class Overloaded(Exception):
    """The waiting queue is full; the caller should retry later (HTTP 429)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class PromptTooLong(ValueError):
    """prompt + max_tokens exceed the context or the whole KV budget (HTTP 400)."""

    def __init__(self, message: str, *, limit: int, actual: int) -> None:
        super().__init__(message)
        self.limit = limit
        self.actual = actual


class EngineUnavailable(RuntimeError):
    """Not started, shutting down, or the engine thread died (HTTP 503)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_queue: int = 256                    # waiting requests beyond this -> Overloaded
    prefill_token_budget: int | None = 256  # prompt tokens per iteration; None/0 = whole prompts
    enable_prefix_cache: bool = True

    def __post_init__(self) -> None:
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")
        if self.prefill_token_budget is not None and self.prefill_token_budget < 0:
            raise ValueError("prefill_token_budget must be >= 1, or 0/None for whole prompts; "
                             f"got {self.prefill_token_budget}")


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    waiting: int
    running: int
    slots_used: int
    max_slots: int
    pages_used: int
    pages_total: int
    prefix_queries: int
    prefix_hits: int
    prefix_hit_tokens: int
    preemptions: int
    rejections: dict[str, int]   # reason -> count ("overloaded", "too_long")
    cancellations: int
    prompt_tokens: int
    generated_tokens: int
    prefilled_tokens: int
    finished: dict[str, int]     # finish reason value -> count


class Scheduler:
    def __init__(self, engine: Engine, tokenizer, config: SchedulerConfig = SchedulerConfig()
                 ) -> None:
        self._engine = engine
        self._config = config
        self._page_size = engine.page_size
        self._blocks = BlockManager(engine.num_pages, engine.page_size, config.enable_prefix_cache)
        self._output = OutputProcessor(tokenizer, self._release, self._on_finish)
        self._thread = threading.Thread(target=self._loop, name="slipstream-engine", daemon=True)
        self._listeners: list[Callable[[RequestMetrics], None]] = []
        # Guarded by _cv: shared with submitters, cancel() and the output thread.
        self._cv = threading.Condition()
        self._state = "new"  # -> running -> closing -> stopped
        self._failed: str | None = None
        self._force_stop = False
        self._live: dict[str, Sequence] = {}
        self._waiting: list[Sequence] = []  # sorted by Sequence.queue_key
        self._drops: dict[str, bool] = {}   # request id -> counts as a cancellation
        self._order = itertools.count()
        # Engine thread only.
        self._running: list[Sequence] = []  # in admission order
        self._free_slots = list(range(engine.max_slots))
        self._admits = itertools.count()
        self._epoch = 0                     # bumped whenever admission might newly succeed
        self._blocked_epoch = -1
        self._records: list[Emit] = []      # this iteration's output, sent once at its end
        # Counters, from the engine, submit and output threads.
        self._stats_lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()
        self._rejections: collections.Counter[str] = collections.Counter()
        self._finished: collections.Counter[str] = collections.Counter()

    # ---- public API --------------------------------------------------------------------------

    def start(self) -> None:
        with self._cv:
            if self._state != "new":
                raise RuntimeError(f"scheduler already {self._state}; create a new one")
            self._state = "running"
        self._output.start()
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self._state == "running" and self._failed is None and self._thread.is_alive()

    def submit(self, request: Request) -> RequestStream:
        if not request.prompt_ids:
            raise ValueError("prompt must contain at least one token")
        self._check_length(request)
        with self._cv:
            if self._failed is not None:
                raise EngineUnavailable(f"engine stopped after a failure: {self._failed}")
            if self._state != "running":
                raise EngineUnavailable(f"scheduler is {self._state}, not accepting requests")
            if request.request_id in self._live:
                raise ValueError(f"request id {request.request_id!r} is already in flight")
            if len(self._waiting) >= self._config.max_queue:
                self._count(self._rejections, "overloaded")
                raise Overloaded(f"{len(self._waiting)} requests are waiting (max_queue="
                                 f"{self._config.max_queue}); retry later")
            tracker = self._output.open(request, self.cancel)
            seq = Sequence(request, tracker, next(self._order))
            self._live[request.request_id] = seq
            self._enqueue(seq)
            self._count(self._counts, "prompt_tokens", len(request.prompt_ids))
            self._cv.notify_all()
        return tracker.stream

    def cancel(self, request_id: str) -> None:
        self._drop_later(request_id, counted=True)

    def stats(self) -> SchedulerStats:
        with self._cv:
            waiting = len(self._waiting)
        with self._stats_lock:
            counts = dict(self._counts)
            rejections, finished = dict(self._rejections), dict(self._finished)
        prefix, allocator = self._blocks.prefix, self._blocks.allocator
        return SchedulerStats(
            waiting=waiting, running=len(self._running),
            slots_used=self._engine.max_slots - len(self._free_slots),
            max_slots=self._engine.max_slots, pages_used=allocator.num_used,
            pages_total=allocator.num_total,
            prefix_queries=prefix.queries if prefix else 0,
            prefix_hits=prefix.hits if prefix else 0,
            prefix_hit_tokens=prefix.hit_tokens if prefix else 0,
            preemptions=counts.get("preemptions", 0), rejections=rejections,
            cancellations=counts.get("cancellations", 0),
            prompt_tokens=counts.get("prompt_tokens", 0),
            generated_tokens=counts.get("generated_tokens", 0),
            prefilled_tokens=counts.get("prefilled_tokens", 0), finished=finished)

    def add_listener(self, fn: Callable[[RequestMetrics], None]) -> None:
        self._listeners = [*self._listeners, fn]  # copy: the output thread iterates it unlocked

    def shutdown(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        with self._cv:
            if self._state == "new" or not self._thread.is_alive() and self._state == "stopped":
                self._state = "stopped"  # never started, or already shut down: nothing to join
                return
            if self._state == "running":
                self._state = "closing"
            self._cv.notify_all()
            while self._live and self._failed is None and not self._force_stop:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._force_stop = True  # the engine thread fails what is left
                    self._cv.notify_all()
                    break
                self._cv.wait(left)
        self._thread.join(max(1.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            log.warning("engine thread did not stop within %.1f s (stuck in the engine?)", timeout)
        self._output.close(max(1.0, deadline - time.monotonic()))
        with self._cv:
            self._state = "stopped"

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Blocking: submit all (waiting for room when the queue is full), return all results."""
        streams: list[RequestStream] = []
        for request in requests:
            while True:
                try:
                    streams.append(self.submit(request))
                    break
                except Overloaded:
                    pending = [s for s in streams if not s.finished]
                    if not pending:
                        raise
                    pending[0].result()
        return [s.result() for s in streams]

    # ---- called from other threads -------------------------------------------------------------

    def _release(self, request_id: str) -> None:
        """The output side finished it (stop string): free it without counting a cancellation."""
        self._drop_later(request_id, counted=False)

    def _drop_later(self, request_id: str, counted: bool) -> None:
        with self._cv:
            if request_id in self._live:
                self._drops.setdefault(request_id, counted)
                self._cv.notify_all()

    def _on_finish(self, metrics: RequestMetrics) -> None:
        self._count(self._finished, metrics.finish_reason.value)
        for fn in self._listeners:
            try:
                fn(metrics)
            except Exception:  # noqa: BLE001 - a listener's bug must not lose other listeners
                log.exception("request metrics listener %r failed", fn)

    def _count(self, counter: collections.Counter, key: str, n: int = 1) -> None:
        with self._stats_lock:
            counter[key] += n

    def _check_length(self, request: Request) -> None:
        prompt, max_tokens = len(request.prompt_ids), request.params.max_tokens
        total = prompt + max_tokens
        kv_tokens = self._blocks.allocator.num_total * self._page_size
        for limit, what in ((self._engine.max_seq_len, "the model's context"),
                            (kv_tokens, "the KV cache's capacity")):
            if total > limit:
                self._count(self._rejections, "too_long")
                raise PromptTooLong(f"prompt ({prompt} tokens) + max_tokens ({max_tokens}) = "
                                    f"{total} exceeds {what} of {limit} tokens; shorten the "
                                    "prompt or lower max_tokens", limit=limit, actual=total)

    # ---- engine thread -------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while self._step():
                pass
        except Exception as exc:  # noqa: BLE001 - any engine error must reach every waiter
            log.exception("engine thread failed")
            self._output.put(self._records)  # e.g. cancellations already taken off the books
            self._fail_all(f"engine failed: {exc!r}", failed=True)

    def _step(self) -> bool:
        records = self._records = []  # kept on self: a failure mid-step still delivers them
        with self._cv:
            while not (self._waiting or self._running or self._drops or self._force_stop
                       or (self._state != "running" and not self._live)):
                self._cv.wait()  # idle: no spinning, woken by submit/cancel/shutdown
            if self._force_stop:
                self._fail_all("scheduler shut down before the request finished", failed=False)
                return False
            if self._state != "running" and not self._live:
                return False  # closing and drained
            drops, self._drops = self._drops, {}
        for request_id, counted in drops.items():
            self._drop(request_id, counted, records)
        with self._cv:
            self._admit(records)
        self._prefill()
        self._decode(records)
        self._output.put(records)
        return True

    def _drop(self, request_id: str, counted: bool, records: list[Emit]) -> None:
        seq = self._live.get(request_id)
        if seq is None:
            return
        self._retire(seq)
        records.append(Emit(seq.tracker, finish_reason=FinishReason.CANCELLED))
        if counted:
            self._count(self._counts, "cancellations")

    def _admit(self, records: list[Emit]) -> None:
        if self._running and self._blocked_epoch == self._epoch:
            return  # nothing changed since the queue head last failed to get pages
        # First pages of prompts whose new pages are still being prefilled: n > 1 siblings (or
        # requests sharing a system prompt) wait for them to reach the prefix cache instead of
        # computing them again.
        prefilling = {self._new_head(r) for r in self._running if not r.inserted}
        i = 0
        while i < len(self._waiting) and self._free_slots:
            seq = self._waiting[i]
            head = seq.first_page(self._page_size) if self._blocks.prefix is not None else ()
            if head and head in prefilling:
                i += 1
                continue
            # One page of headroom per running sequence, so admitting does not immediately
            # force a preemption (and a wasted prefill) at the next page boundary.
            if not self._blocks.admit(seq, reserve=len(self._running)):
                if self._running:
                    self._blocked_epoch = self._epoch
                    return  # FCFS: later requests do not jump a head that waits for pages
                need = pages_needed(seq.num_tokens, self._page_size)
                self._retire(seq)
                records.append(Emit(seq.tracker, finish_reason=FinishReason.ERROR, error=(
                    f"request needs {need} KV pages but only {self._blocks.allocator.num_total} "
                    "exist; raise the KV cache budget")))
                continue
            del self._waiting[i]
            seq.status = Status.RUNNING
            seq.slot = heapq.heappop(self._free_slots)
            seq.admit_seq = next(self._admits)
            self._running.append(seq)
            prefilling.add(self._new_head(seq))
            if not seq.admitted_once:
                seq.admitted_once = True
                records.append(Emit(seq.tracker, admitted_at=time.monotonic()))

    def _new_head(self, seq: Sequence) -> tuple[int, ...]:
        """Its first page if its prefill will add full pages to the prefix cache, else ()."""
        full_pages = seq.prefill_target // self._page_size
        if self._blocks.prefix is None or full_pages <= seq.matched_pages:
            return ()
        return seq.first_page(self._page_size)

    def _prefill(self) -> None:
        budget = self._config.prefill_token_budget or math.inf
        pending = [seq for seq in self._running if not seq.inserted]
        # The oldest prompt always advances (no starvation); the rest go shortest-remaining first,
        # so a short request does not wait behind every long prompt admitted before it.
        order = pending[:1] + sorted(pending[1:], key=lambda s: s.prefill_target - s.num_computed)
        for seq in order:
            tokens = seq.tokens
            while seq.num_computed < seq.prefill_target and budget > 0:
                start = seq.num_computed
                n = int(min(seq.prefill_target - start, budget, self._engine.max_prefill_chunk))
                self._engine.prefill(PrefillChunk(tuple(tokens[start:start + n]), start,
                                                  tuple(seq.pages)))
                seq.num_computed += n
                budget -= n
                self._count(self._counts, "prefilled_tokens", n)
            if seq.num_computed < seq.prefill_target:
                continue
            if self._blocks.register(seq):
                with self._cv:
                    self._epoch += 1  # siblings waiting for these pages may go now
            self._engine.insert(seq.slot, SlotState(prompt_ids=tuple(seq.request.prompt_ids),
                                                    output_ids=tuple(seq.output_ids),
                                                    params=seq.request.params))
            seq.inserted = True

    def _decode(self, records: list[Emit]) -> None:
        batch = [seq for seq in list(self._running)  # oldest first: they get pages first
                 if seq.inserted and seq.status is Status.RUNNING and self._grow(seq)]
        if not batch:
            return
        rows = [DecodeRow(seq.slot, seq.last_token, seq.num_tokens - 1, tuple(seq.pages))
                for seq in batch]
        sampled = self._engine.generate(rows)
        if len(sampled) != len(rows):
            raise RuntimeError(f"engine returned {len(sampled)} samples for {len(rows)} rows")
        self._count(self._counts, "generated_tokens", len(rows))
        for seq, s in zip(batch, sampled):
            seq.output_ids.append(s.token_id)
            finish = seq.check_finish(s.token_id, self._engine.eos_token_ids,
                                      self._engine.max_seq_len)
            want_logprobs = seq.request.params.logprobs is not None
            records.append(Emit(seq.tracker, (s.token_id,), (s.logprob,) if want_logprobs else None,
                                finish_reason=finish))
            if finish is not None:
                self._retire(seq)

    def _grow(self, seq: Sequence) -> bool:
        """Give `seq` pages for its next position, preempting the newest sequences if needed;
        False when `seq` itself had to go."""
        while not self._blocks.grow(seq):
            victim = max(self._running, key=lambda s: s.admit_seq)
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: drop slot and pages, keep the output, requeue at the front."""
        self._free(seq)
        seq.preempted = True
        self._count(self._counts, "preemptions")
        with self._cv:
            self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        bisect.insort(self._waiting, seq, key=Sequence.queue_key)
        self._epoch += 1

    def _free(self, seq: Sequence) -> None:
        """Give back the slot and the page references of a running sequence."""
        if seq.status is not Status.RUNNING:
            return
        if seq.inserted:
            self._engine.free(seq.slot)
        self._blocks.release(seq)
        heapq.heappush(self._free_slots, seq.slot)
        self._running.remove(seq)
        seq.slot, seq.inserted, seq.num_computed = None, False, 0
        with self._cv:  # submit bumps it too
            self._epoch += 1

    def _retire(self, seq: Sequence) -> None:
        self._free(seq)
        with self._cv:
            if seq.status is Status.WAITING:
                self._waiting.remove(seq)
                self._epoch += 1  # it may have been the head that could not get pages
            seq.status = Status.FINISHED
            del self._live[seq.request_id]
            if not self._live:
                self._cv.notify_all()  # shutdown() waits for the drain

    def _fail_all(self, message: str, *, failed: bool) -> None:
        with self._cv:
            if failed:
                self._failed = message
            seqs = list(self._live.values())
            self._live.clear()
            self._waiting.clear()
            self._drops.clear()
            self._cv.notify_all()
        self._running.clear()
        self._output.put([Emit(s.tracker, finish_reason=FinishReason.ERROR, error=message)
                          for s in seqs])
