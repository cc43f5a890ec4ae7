"""Shared by the threaded scheduler tests: a byte tokenizer, what MockEngine generates, and waits
that end in a failure instead of a hang."""
from __future__ import annotations

import contextlib
import random
import time

from slipstream.engine.mock_engine import MockEngine
from slipstream.engine.request import Request, SamplingParams
from slipstream.engine.scheduler import OutputProcessor, Scheduler, SchedulerConfig

WAIT = 10.0  # seconds any result may take before the test fails instead of hanging


class ByteTokenizer:
    """Token i is byte i (vocab 256): ASCII ids read as letters, multi-byte UTF-8 spans tokens."""

    eos_token_ids = frozenset()

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def chain(prompt: list[int], n: int, vocab: int = 256) -> list[int]:
    """What MockEngine generates: each token is the previous one plus one."""
    return [(prompt[-1] + 1 + i) % vocab for i in range(n)]


def text_of(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8")


def req(prompt: list[int], max_tokens: int = 8, priority: int = 0, **params) -> Request:
    return Request(prompt_ids=list(prompt), params=SamplingParams(max_tokens=max_tokens, **params),
                   priority=priority)


def ascii_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(32, 90) for _ in range(length)]


@contextlib.contextmanager
def running(engine: MockEngine, **config):
    sched = Scheduler(engine, OutputProcessor(ByteTokenizer()), SchedulerConfig(**config))
    sched.start()
    try:
        yield sched
    finally:
        sched.shutdown(timeout=5)


def wait_for(predicate, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.002)


def assert_all_released(sched: Scheduler, engine: MockEngine) -> None:
    """Every slot free and unbound; no page held by a request; cached pages held by the cache only."""
    # the engine thread frees slots in its books first, then unbinds them in the engine
    wait_for(lambda: sched.stats().slots_used == 0 and engine.occupied_slots == [])
    stats = sched.stats()
    assert (stats.running, stats.waiting, stats.pages_used) == (0, 0, 0)
    allocator = sched._blocks.allocator
    used = [p for p in range(1, engine.num_pages) if allocator.refcount(p) > 0]
    assert len(used) == stats.pages_cached
    assert all(allocator.refcount(p) == 1 for p in used)
