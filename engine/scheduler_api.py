"""The scheduler's public types: the errors a submit can raise (the server maps them to HTTP 429, 400
and 503), its config, the counters it reports, and generate_all over any submit. Plain Python: no
JAX here."""
from __future__ import annotations

import collections
import dataclasses
import enum
import threading
from typing import TYPE_CHECKING, Callable

from slipstream.engine.request import FinishReason
from slipstream.engine.speculative import Proposer, SpeculativeConfig

if TYPE_CHECKING:
    from slipstream.engine.request_stream import Completion, RequestStream
    from slipstream.engine.request import Request
    from slipstream.engine.step_plan import Plan


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
    max_queue: int = 256                        # waiting requests beyond this -> Overloaded
    max_num_batched_tokens: int | None = None   # tokens per step; None = the engine's largest step
    enable_prefix_cache: bool = True
    # After a step that ends requests, with nothing waiting: hand their last tokens out first and
    # wait up to this long for new requests (a client's next one, sent on the finish), so they join
    # the next step instead of the one after. 0 turns it off. (engine/arrival_wait.py)
    arrival_wait_ms: float = 20.0
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding (engine/speculative.py)
    proposer: Proposer | None = None  # speculative's drafts from this (a draft model); None: n-gram

    def __post_init__(self) -> None:
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")
        if not 0 <= self.arrival_wait_ms <= 1000:
            raise ValueError(f"arrival_wait_ms must be within [0, 1000], got {self.arrival_wait_ms}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1, or None for the engine's "
                             f"largest step; got {self.max_num_batched_tokens}")


class Lifecycle(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    CLOSING = "closing"  # shutdown(): no new requests, the live ones drain
    STOPPED = "stopped"


class Rejection(enum.Enum):
    """Why submit refused a request (the label of slipstream_rejections)."""
    OVERLOADED = "overloaded"
    TOO_LONG = "too_long"


@dataclasses.dataclass
class Totals:
    """The scheduler's running counts, added to from the engine, submit and output threads."""
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefilled_tokens: int = 0
    preemptions: int = 0
    cancellations: int = 0
    rejections: collections.Counter[Rejection] = dataclasses.field(default_factory=collections.Counter)
    finished: collections.Counter[FinishReason] = dataclasses.field(default_factory=collections.Counter)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, *, prompt_tokens: int = 0, generated_tokens: int = 0, prefilled_tokens: int = 0,
            preemptions: int = 0, cancellations: int = 0, rejected: Rejection | None = None,
            finished: FinishReason | None = None) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.generated_tokens += generated_tokens
            self.prefilled_tokens += prefilled_tokens
            self.preemptions += preemptions
            self.cancellations += cancellations
            if rejected is not None:
                self.rejections[rejected] += 1
            if finished is not None:
                self.finished[finished] += 1

    def snapshot(self) -> Totals:
        with self._lock:
            return dataclasses.replace(self, rejections=self.rejections.copy(), finished=self.finished.copy())


@dataclasses.dataclass(frozen=True)
class StepEvent:
    """One planned step, as step listeners see it (Scheduler.add_step_listener)."""
    planned_at: float             # time.perf_counter() when the planner was asked
    plan_seconds: float           # how long planning took
    plan: Plan                    # what the step runs: its chunks, preemptions, freed slots
    running: int                  # sequences running after planning
    waiting: tuple[str, ...]      # request ids still waiting


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    waiting: int
    running: int
    slots_used: int
    max_slots: int
    pages_used: int              # held by running requests (0 when idle)
    pages_cached: int            # prefix-cache pages no running request holds (evictable)
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
    # speculative decoding (vLLM's meanings): drafts verified, drafts accepted, and accepted drafts by
    # their position in the draft ("0".."K-1")
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: dict[str, int] = dataclasses.field(default_factory=dict)


def generate_all(submit: Callable[[Request], RequestStream], requests: list[Request]) -> list[Completion]:
    """Submit every request through `submit` (a Scheduler's or a ReplicaSet's), waiting for the oldest
    unfinished one whenever the queue is full, and return all results in order."""
    streams: list[RequestStream] = []
    for request in requests:
        while True:
            try:
                streams.append(submit(request))
                break
            except Overloaded:
                pending = [s for s in streams if not s.finished]
                if not pending:
                    raise
                pending[0].result()
    return [s.result() for s in streams]
