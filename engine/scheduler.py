"""Continuous batching on one engine thread: a thin loop (engine/step_loop.py) that takes cancellations,
asks the planner (engine/schedule.py) what the next ragged step runs, binds admitted sequences to their
slots, runs the step and hands the sampled tokens to the output side. This file is the callers' side:
submit, cancel, stats, start and shutdown. Plain Python: no JAX here."""
from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Callable

from slipstream.engine.api import Engine, StepResult
from slipstream.engine.arrival_wait import ArrivalWait
from slipstream.engine.block_manager import BlockManager
from slipstream.engine.output import Emit, OutputProcessor, RequestMetrics
from slipstream.engine.request_stream import Completion, RequestStream
from slipstream.engine.request import Request
from slipstream.engine.schedule import StepPlanner
from slipstream.engine.scheduler_api import (EngineUnavailable, Lifecycle, Overloaded, PromptTooLong, Rejection,
                                             SchedulerConfig, SchedulerStats, StepEvent, Totals, generate_all)
from slipstream.engine.sequence import Sequence
from slipstream.engine.step_loop import StepLoop
from slipstream.engine.step_plan import Plan

__all__ = ["Completion", "EngineUnavailable", "OutputProcessor", "Overloaded", "PromptTooLong", "RequestMetrics",
           "RequestStream", "Scheduler", "SchedulerConfig", "SchedulerStats", "StepEvent", "generate_all"]

log = logging.getLogger(__name__)


def _token_buckets(engine) -> tuple[int, ...]:
    """The token counts the engine pads a step up to (a device engine's bucket ladder), or () where it
    has none: n-gram speculation fills a step's padded rows with drafts (Speculator.fill_bucket)."""
    buckets = getattr(engine, "buckets", None)
    return tuple(getattr(buckets, "token_counts", ()))


class Scheduler(StepLoop):
    """Token ids in and out: the output side (`output`, one per scheduler) turns them into text and
    stop-string finishes, and tells the scheduler through the callbacks it is started with."""

    def __init__(self, engine: Engine, output: OutputProcessor, config: SchedulerConfig = SchedulerConfig()
                 ) -> None:
        largest = engine.max_num_batched_tokens
        budget = config.max_num_batched_tokens or largest
        if budget > largest:
            raise ValueError(f"max_num_batched_tokens={budget} exceeds the engine's largest step "
                             f"of {largest} tokens; lower it or build the engine with a larger one")
        self._engine = engine
        self._config = config
        # the hybrid weights (a token's role decides its weights): planned and cached by the roles
        roles = bool(getattr(engine, "prompt_w16", False))
        self._blocks = BlockManager(engine.num_pages, engine.page_size, config.enable_prefix_cache, roles=roles)
        self._output = output
        self._thread = threading.Thread(target=self._loop, name="slipstream-engine", daemon=True)
        self._listeners: list[Callable[[RequestMetrics], None]] = []
        self._step_listeners: list[Callable[[StepEvent], None]] = []
        # Guarded by _cv: shared with submitters, cancel(), stats() and the output thread. The
        # engine thread holds it for host bookkeeping only, never across an engine call.
        self._cv = threading.Condition()
        self._planner = StepPlanner(self._blocks, max_slots=engine.max_slots, token_budget=budget,
                                    speculative=config.speculative, max_seq_len=engine.max_seq_len,
                                    proposer=config.proposer, max_loras=getattr(engine, "max_loras", 0),
                                    token_buckets=_token_buckets(engine), roles=roles)
        self._state = Lifecycle.NEW
        self._failed: str | None = None
        self._force_stop = False
        self._live: dict[str, Sequence] = {}
        self._drops: dict[str, bool] = {}   # request id -> counts as a cancellation
        self._order = itertools.count()
        # Engine thread only.
        self._records: list[Emit] = []      # this iteration's output, sent once at its end
        self._unbind: list[int] = []        # slots of sequences that left, for engine.free
        self._in_flight: tuple[Plan, StepResult] | None = None  # launched, samples not collected
        self._arrivals = 0  # requests submitted so far (under _cv)
        self._arrival_wait = ArrivalWait(config.arrival_wait_ms)  # engine thread
        # Counters, from the engine, submit and output threads.
        self._totals = Totals()

    # ---- public API --------------------------------------------------------------------------

    def start(self) -> None:
        with self._cv:
            if self._state is not Lifecycle.NEW:
                raise RuntimeError(f"scheduler already {self._state.value}; create a new one")
            self._state = Lifecycle.RUNNING
        self._output.start(self._release, self._on_finish)
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self._state is Lifecycle.RUNNING and self._failed is None and self._thread.is_alive()

    @property
    def max_num_batched_tokens(self) -> int:
        """Tokens per step: the config's budget, or the engine's largest step."""
        return self._planner.token_budget

    @property
    def max_queue(self) -> int:
        """Requests that may wait at once; more are refused (Overloaded)."""
        return self._config.max_queue

    def submit(self, request: Request) -> RequestStream:
        if not request.prompt_ids:
            raise ValueError("prompt must contain at least one token")
        max_tokens = self._check_length(request)
        with self._cv:
            if self._failed is not None:
                raise EngineUnavailable(f"engine stopped after a failure: {self._failed}")
            if self._state is not Lifecycle.RUNNING:
                raise EngineUnavailable(f"scheduler is {self._state.value}, not accepting requests")
            if request.request_id in self._live:
                raise ValueError(f"request id {request.request_id!r} is already in flight")
            waiting = len(self._planner.waiting)
            if waiting >= self._config.max_queue:
                self._totals.add(rejected=Rejection.OVERLOADED)
                raise Overloaded(f"{waiting} requests are waiting (max_queue="
                                 f"{self._config.max_queue}); retry later")
            seq = Sequence(request, next(self._order), max_tokens)
            stream = self._output.open(request, seq.order, self.cancel)
            self._live[request.request_id] = seq
            self._planner.enqueue(seq)
            self._arrivals += 1
            self._totals.add(prompt_tokens=len(request.prompt_ids))
            self._cv.notify_all()
        return stream

    def cancel(self, request_id: str) -> None:
        self._drop_later(request_id, counted=True)

    def cached_prefix_tokens(self, prompt_ids: list[int]) -> int:
        """Prompt tokens admission would take from the prefix cache now: a routing hint that changes
        nothing (dict lookups, safe beside the engine thread)."""
        return self._blocks.cached_prefix_tokens(prompt_ids)

    def stats(self) -> SchedulerStats:
        with self._cv:
            planned = self._planner.stats()
        t = self._totals.snapshot()
        return SchedulerStats(
            **planned, max_slots=self._engine.max_slots, preemptions=t.preemptions,
            rejections={reason.value: n for reason, n in t.rejections.items()}, cancellations=t.cancellations,
            prompt_tokens=t.prompt_tokens, generated_tokens=t.generated_tokens, prefilled_tokens=t.prefilled_tokens,
            finished={reason.value: n for reason, n in t.finished.items()})

    def abort(self, message: str) -> None:
        """Fail every live request with `message` and stop serving (ready turns false), from any
        thread: for when the engine cannot go on and the engine thread may be stuck inside it
        (a multi-host peer died in the middle of a collective)."""
        log.error("scheduler aborted: %s", message)
        self._fail_all(message, failed=True)

    def add_listener(self, fn: Callable[[RequestMetrics], None]) -> None:
        self._listeners = [*self._listeners, fn]  # copy: the output thread iterates it unlocked

    def add_step_listener(self, fn: Callable[[StepEvent], None]) -> None:
        """Call fn with every planned step, on the engine thread before the step launches (tracing,
        benchmarks): it must return quickly, and what it raises fails the engine."""
        self._step_listeners = [*self._step_listeners, fn]

    def shutdown(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        with self._cv:
            if self._state is Lifecycle.NEW or not self._thread.is_alive() and self._state is Lifecycle.STOPPED:
                self._state = Lifecycle.STOPPED  # never started, or already shut down: nothing to join
                return
            if self._state is Lifecycle.RUNNING:
                self._state = Lifecycle.CLOSING
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
            self._state = Lifecycle.STOPPED

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Blocking: submit all (waiting for room when the queue is full), return all results."""
        return generate_all(self.submit, requests)

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
        self._totals.add(finished=metrics.finish_reason)
        for fn in self._listeners:
            try:
                fn(metrics)
            except Exception:  # noqa: BLE001 - a listener's bug must not lose other listeners
                log.exception("request metrics listener %r failed", fn)

    def _check_length(self, request: Request) -> int:
        """Its output limit (max_tokens=None: the rest of the context), checked against the context and
        the KV cache."""
        prompt, max_tokens = len(request.prompt_ids), request.params.max_tokens
        if max_tokens is None:
            max_tokens = max(1, self._engine.max_seq_len - prompt)
        too_long = self._planner.too_long(prompt, max_tokens)
        if too_long is not None:
            self._totals.add(rejected=Rejection.TOO_LONG)
            raise PromptTooLong(too_long[0], limit=too_long[1], actual=too_long[2])
        return max_tokens
