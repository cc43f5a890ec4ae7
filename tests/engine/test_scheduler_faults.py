"""Scheduler on MockEngine when things go wrong or stop: overload, limits, a request the engine
cannot set up, engine failures, shutdown, idle CPU, and streaming to slow or misusing callers."""
from __future__ import annotations

import asyncio
import time

import pytest

from slipstream.engine.mock_engine import MockEngine
from slipstream.engine.request import FinishReason
from slipstream.engine.scheduler import (EngineUnavailable, OutputProcessor, Overloaded, PromptTooLong, Scheduler,
                                        SchedulerConfig)
from tests.engine.scheduler_helpers import (WAIT, ByteTokenizer, assert_all_released, chain, req,
                                            running, text_of, wait_for)


def test_overloaded_rejects_immediately_and_running_requests_finish():
    engine = MockEngine(max_slots=1, step_sleep_s=0.005)
    with running(engine, max_queue=2) as sched:
        first = sched.submit(req([40], 60))
        wait_for(lambda: sched.stats().running == 1)
        queued = [sched.submit(req([50], 3)), sched.submit(req([60], 3))]
        start = time.monotonic()
        with pytest.raises(Overloaded) as info:
            sched.submit(req([70], 3))
        assert time.monotonic() - start < 0.1
        assert info.value.retry_after_s > 0
        assert first.result(timeout=WAIT).token_ids == chain([40], 60)
        assert [s.result(timeout=WAIT).token_ids for s in queued] == [[51, 52, 53], [61, 62, 63]]
        assert sched.stats().rejections == {"overloaded": 1}


def test_prompt_too_long_names_both_numbers():
    engine = MockEngine(max_seq_len=32, page_size=4, num_pages=6)  # KV holds 20 tokens
    with running(engine) as sched:
        with pytest.raises(PromptTooLong) as info:
            sched.submit(req(list(range(30)), 5))
        assert str(info.value).startswith(
            "prompt (30 tokens) + max_tokens (5) = 35 exceeds the model's context of 32 tokens")
        assert (info.value.limit, info.value.actual) == (32, 35)
        with pytest.raises(PromptTooLong, match="KV cache's capacity of 20 tokens"):
            sched.submit(req(list(range(10)), 11))
        with pytest.raises(ValueError, match="at least one token"):
            sched.submit(req([], 5))
        assert sched.stats().rejections == {"too_long": 2}
        assert sched.submit(req(list(range(40, 50)), 10)).result(timeout=WAIT).token_ids == \
            chain([49], 10)  # exactly at the KV limit still runs


class RefusesSeed(MockEngine):
    """insert raises for one request's settings, as building its sampling state might."""

    def insert(self, slot, state):
        if state.params.seed == 13:
            raise OverflowError("Python int too large to convert to C int")
        super().insert(slot, state)


def test_a_request_the_engine_cannot_set_up_fails_alone():
    engine = RefusesSeed(max_slots=2, step_sleep_s=0.002)
    with running(engine) as sched:
        others = [sched.submit(req([40 + i], 20)) for i in range(3)]
        bad = sched.submit(req([60], 20, seed=13))

        async def deltas():
            return [d async for d in bad]

        last = asyncio.run(asyncio.wait_for(deltas(), WAIT))[-1]
        assert last.finish_reason is FinishReason.ERROR
        assert "could not apply this request's sampling settings" in last.error
        assert "OverflowError" not in last.error  # the cause goes to the log, not the client
        for i, s in enumerate(others):
            assert s.result(timeout=WAIT).token_ids == chain([40 + i], 20)
        assert sched.ready
        assert sched.submit(req([70], 2)).result(timeout=WAIT).token_ids == [71, 72]
        assert_all_released(sched, engine)
        wait_for(lambda: sched.stats().finished == {"length": 4, "error": 1})


def test_idle_threads_use_no_cpu():
    with running(MockEngine()) as sched:
        sched.submit(req([40], 5)).result(timeout=WAIT)
        clocks = [time.pthread_getcpuclockid(t.ident)
                  for t in (sched._thread, sched._output._thread)]
        before = [time.clock_gettime(c) for c in clocks]
        time.sleep(0.5)
        used = [time.clock_gettime(c) - b for c, b in zip(clocks, before)]
        assert max(used) < 0.01, used
        assert sched.submit(req([40], 2)).result(timeout=WAIT).token_ids == [41, 42]  # wakes up


def test_engine_failure_fails_every_request_fast_and_flips_ready():
    engine = MockEngine(max_slots=2, fail_after_steps=5, step_sleep_s=0.001)
    with running(engine) as sched:
        assert sched.ready
        streams = [sched.submit(req([40 + i], 50)) for i in range(6)]

        async def first_error():
            return [d async for d in streams[0]][-1]

        start = time.monotonic()
        last = asyncio.run(asyncio.wait_for(first_error(), 1.0))
        assert last.finish_reason is FinishReason.ERROR and "injected failure" in last.error
        for s in streams[1:]:
            done = s.result(timeout=1.0)
            assert done.finish_reason is FinishReason.ERROR and "injected failure" in done.error
        assert time.monotonic() - start < 1.0
        assert not sched.ready
        with pytest.raises(EngineUnavailable, match="injected failure"):
            sched.submit(req([40], 2))
        wait_for(lambda: sched.stats().finished == {"error": 6})  # counted after delivery


class FailsAfterFree(MockEngine):
    """Fails the step of the iteration that freed a slot."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.freed = False

    def free(self, slot):
        super().free(slot)
        self.freed = True

    def launch(self, batch):
        if self.freed:
            raise RuntimeError("device lost")
        return super().launch(batch)


def test_failure_in_the_step_that_cancelled_still_ends_every_stream():
    engine = FailsAfterFree(max_slots=2, step_sleep_s=0.002)
    with running(engine) as sched:
        doomed, other = sched.submit(req([40], 100)), sched.submit(req([50], 100))
        wait_for(lambda: len(engine.steps) >= 2)
        doomed.cancel()
        assert doomed.result(timeout=1).finish_reason is FinishReason.CANCELLED
        done = other.result(timeout=1)
        assert done.finish_reason is FinishReason.ERROR and "device lost" in done.error
        assert not sched.ready


def test_async_streaming_sync_result_and_slow_consumer_coalescing():
    engine = MockEngine(step_sleep_s=0.001)
    with running(engine) as sched:
        async def fast():
            stream = sched.submit(req([64], 6))
            return [d async for d in stream]

        deltas = asyncio.run(fast())
        assert [t for d in deltas for t in d.token_ids] == chain([64], 6)
        assert deltas[-1].finish_reason is FinishReason.LENGTH
        assert all(d.finish_reason is None for d in deltas[:-1])

        async def slow():  # the stream is bound to this loop, whose consumer is busy elsewhere
            stream = sched.submit(req([64], 30))
            await asyncio.to_thread(stream.result, WAIT)
            return [d async for d in stream]

        deltas = asyncio.run(slow())
        assert len(deltas) == 1  # merged while nobody was reading
        assert deltas[0].text == text_of(chain([64], 30))
        assert deltas[0].finish_reason is FinishReason.LENGTH

        stream = sched.submit(req([64], 3))  # made off the loop: binds on first __anext__
        assert "".join(d.text for d in asyncio.run(collect(stream))) == "ABC"
        assert stream.result(timeout=WAIT).text == "ABC"


async def collect(stream):
    return [d async for d in stream]


def test_result_refuses_to_block_the_event_loop():
    engine = MockEngine(step_sleep_s=0.01)
    with running(engine) as sched:
        async def misuse():
            stream = sched.submit(req([64], 50))
            with pytest.raises(RuntimeError, match="async for"):
                stream.result()
            stream.cancel()
        asyncio.run(misuse())


def test_shutdown_drains_in_flight_requests_then_refuses():
    engine = MockEngine(max_slots=2, step_sleep_s=0.002)
    sched = Scheduler(engine, OutputProcessor(ByteTokenizer()), SchedulerConfig())
    with pytest.raises(EngineUnavailable):
        sched.submit(req([40], 2))  # not started
    sched.start()
    streams = [sched.submit(req([40 + i], 10)) for i in range(5)]
    sched.shutdown(timeout=10)
    got = [s.result(timeout=0).token_ids for s in streams]
    assert got == [chain([40 + i], 10) for i in range(5)]
    assert not sched.ready
    with pytest.raises(EngineUnavailable):
        sched.submit(req([40], 2))


def test_shutdown_timeout_fails_what_is_left():
    engine = MockEngine(step_sleep_s=0.01)
    sched = Scheduler(engine, OutputProcessor(ByteTokenizer()), SchedulerConfig())
    sched.start()
    stream = sched.submit(req([40], 100))
    start = time.monotonic()
    sched.shutdown(timeout=0.1)
    assert time.monotonic() - start < 2
    done = stream.result(timeout=0)
    assert done.finish_reason is FinishReason.ERROR and "shut down" in done.error


def test_shutdown_is_idempotent_started_or_not():
    never_started = Scheduler(MockEngine(), OutputProcessor(ByteTokenizer()))
    never_started.shutdown(timeout=1)
    never_started.shutdown(timeout=1)
    started = Scheduler(MockEngine(), OutputProcessor(ByteTokenizer()))
    started.start()
    started.shutdown(timeout=1)
    started.shutdown(timeout=1)
    with pytest.raises(EngineUnavailable):
        started.submit(req([1, 2, 3]))
