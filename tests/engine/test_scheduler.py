"""Scheduler on MockEngine (next token = fed token + 1): hand-computable outputs under concurrency,
ordering, chunked prefill, prefix caching, preemption, cancellation, overload and failures."""
from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time

import pytest

from engine.api import DecodeRow, PrefillChunk, SlotState
from engine.mock_engine import MockEngine, MockEngineError
from engine.request import FinishReason, Request, SamplingParams
from engine.scheduler import (EngineUnavailable, Overloaded, PromptTooLong, RequestMetrics,
                              Scheduler, SchedulerConfig)

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


@contextlib.contextmanager
def running(engine: MockEngine, **config):
    sched = Scheduler(engine, ByteTokenizer(), SchedulerConfig(**config))
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
    """Every slot free; every page free or held only by the prefix cache."""
    wait_for(lambda: sched.stats().slots_used == 0)
    assert engine.occupied_slots == []
    allocator, cache = sched._blocks.allocator, sched._blocks.prefix
    cached = cache.num_cached if cache else 0
    assert sched.stats().pages_used == cached
    used = [p for p in range(1, engine.num_pages) if allocator.refcount(p) > 0]
    assert all(allocator.refcount(p) == 1 for p in used)


def ascii_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(32, 90) for _ in range(length)]


def test_many_concurrent_requests_get_their_own_tokens():
    rng = random.Random(0)
    engine = MockEngine(max_slots=4, page_size=4, num_pages=64, max_prefill_chunk=8)
    with running(engine, prefill_token_budget=16) as sched:
        requests = [req(ascii_prompt(rng, rng.randrange(1, 30)), rng.randrange(1, 20))
                    for _ in range(40)]
        streams: list = [None] * len(requests)

        def submit(indices):
            for i in indices:
                streams[i] = sched.submit(requests[i])

        threads = [threading.Thread(target=submit, args=(range(k, 40, 4),)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for r, stream in zip(requests, streams):
            done = stream.result(timeout=WAIT)
            want = chain(r.prompt_ids, r.params.max_tokens)
            assert (done.token_ids, done.text) == (want, text_of(want))
            assert done.finish_reason is FinishReason.LENGTH and done.error is None
            assert done.prompt_tokens == len(r.prompt_ids)
        stats = sched.stats()
        assert stats.finished == {"length": 40}
        assert stats.generated_tokens == sum(r.params.max_tokens for r in requests)
        assert stats.prompt_tokens == sum(len(r.prompt_ids) for r in requests)
        assert max(engine.decode_batches) == 4  # the batch really was shared
        assert_all_released(sched, engine)


def test_eos_stop_token_ids_and_ignore_eos():
    engine = MockEngine(eos_token_ids=frozenset({100}))
    with running(engine) as sched:
        eos = sched.submit(req([95], 20)).result(timeout=WAIT)
        assert eos.token_ids == [96, 97, 98, 99, 100]
        assert eos.text == "`abc" and eos.finish_reason is FinishReason.STOP  # EOS not in text
        ignored = sched.submit(req([95], 8, ignore_eos=True)).result(timeout=WAIT)
        assert ignored.token_ids == chain([95], 8) and ignored.finish_reason is FinishReason.LENGTH
        stopped = sched.submit(req([95], 20, stop_token_ids=(98,))).result(timeout=WAIT)
        assert stopped.token_ids == [96, 97, 98] and stopped.text == "`a"


def test_logprobs_are_returned_per_token_when_asked():
    with running(MockEngine()) as sched:
        done = sched.submit(req([65], 3, logprobs=2)).result(timeout=WAIT)
        assert [lp.token_id for lp in done.logprobs] == [66, 67, 68]
        assert all(len(lp.top) == 2 and lp.top[0][0] == lp.token_id for lp in done.logprobs)
        assert sched.submit(req([65], 3)).result(timeout=WAIT).logprobs is None


def test_priority_then_fcfs_order():
    engine = MockEngine(max_slots=1, max_seq_len=1024, num_pages=300, step_sleep_s=0.002)
    order: list[str] = []
    with running(engine) as sched:
        sched.add_listener(lambda m: order.append(m.request_id))
        blocker = sched.submit(req([40], 1000))
        wait_for(lambda: sched.stats().running == 1)
        reqs = [req([50 + i], 2, priority=p) for i, p in enumerate([1, 0, 1, 0, 2])]
        streams = [sched.submit(r) for r in reqs]
        blocker.cancel()  # everything is queued now: let it go
        for s in [blocker, *streams]:
            s.result(timeout=WAIT)
        wait_for(lambda: len(order) == 6)
    ids = [r.request_id for r in reqs]
    assert order == [blocker.request_id, ids[1], ids[3], ids[0], ids[2], ids[4]]


def test_chunked_prefill_respects_budget_and_chunk_size():
    engine = MockEngine(max_slots=3, page_size=4, max_prefill_chunk=4, max_seq_len=1024,
                        num_pages=300, step_sleep_s=0.001)
    with running(engine, prefill_token_budget=6, enable_prefix_cache=False) as sched:
        # A decoding request makes every iteration run one decode step, which numbers them.
        decoding = sched.submit(req([1], 1000))
        wait_for(lambda: len(engine.decode_batches) > 0)
        prompts = [list(range(40, 70)), list(range(70, 100))]  # 30 tokens each
        streams = [sched.submit(req(p, 5)) for p in prompts]
        for p, s in zip(prompts, streams):
            assert s.result(timeout=WAIT).token_ids == chain(p, 5)
        decoding.cancel()
    per_step: dict[int, int] = {}
    for step, _, n in engine.prefill_log:
        assert 1 <= n <= 4
        per_step[step] = per_step.get(step, 0) + n
    assert max(per_step.values()) <= 6
    assert len(per_step) >= 58 // 6  # the prompts really were spread over iterations
    assert engine.prefilled_tokens == 2 * 29  # the last prompt token goes to decode
    assert sched.stats().prefilled_tokens == 58


def test_whole_prompts_when_budget_is_off():
    engine = MockEngine(max_prefill_chunk=8, step_sleep_s=0.001)
    with running(engine, prefill_token_budget=None) as sched:
        done = sched.submit(req(list(range(40, 70)), 3)).result(timeout=WAIT)
        assert done.token_ids == [70, 71, 72]
    assert {step for step, _, _ in engine.prefill_log} == {0}  # one iteration, chunks of <= 8
    assert [n for _, _, n in engine.prefill_log] == [8, 8, 8, 5]


def test_one_token_prompt_needs_no_prefill():
    engine = MockEngine()
    with running(engine) as sched:
        assert sched.submit(req([70], 3)).result(timeout=WAIT).text == "GHI"
    assert engine.prefill_log == []


def test_prefix_cache_second_request_prefills_only_new_tokens():
    engine = MockEngine(page_size=4, max_prefill_chunk=16)
    prefix = list(range(40, 52))  # three full pages
    with running(engine) as sched:
        first = sched.submit(req(prefix + [60, 61], 4)).result(timeout=WAIT)
        assert engine.prefilled_tokens == 13
        second_prompt = prefix + [70, 71, 72]
        second = sched.submit(req(second_prompt, 4)).result(timeout=WAIT)
        assert engine.prefilled_tokens == 13 + 2  # [70, 71]; 72 is fed to the first decode
        assert second.token_ids == chain(second_prompt, 4)
        again = sched.submit(req(prefix + [60, 61], 4)).result(timeout=WAIT)
        assert again.token_ids == first.token_ids
        stats = sched.stats()
        assert (stats.prefix_queries, stats.prefix_hits) == (3, 2)
        assert stats.prefix_hit_tokens == 24
        assert_all_released(sched, engine)


def test_identical_prompts_submitted_together_share_pages():
    engine = MockEngine(max_slots=4, page_size=4, max_prefill_chunk=4)
    prompt = list(range(40, 53))  # 13 tokens: 12 cacheable
    with running(engine, prefill_token_budget=4) as sched:
        streams = [sched.submit(req(prompt, 5)) for _ in range(4)]  # what n=4 expands to
        results = [s.result(timeout=WAIT) for s in streams]
    assert all(r.token_ids == chain(prompt, 5) for r in results)
    assert engine.prefilled_tokens == 12
    assert max(engine.decode_batches) == 4  # siblings still decode together


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_preemption_under_a_small_page_budget_keeps_outputs_exact(prefix_cache):
    rng = random.Random(1)
    # 12 usable pages of 4 tokens; 4 slots of 26-token sequences would need 28.
    engine = MockEngine(max_slots=4, page_size=4, num_pages=13, max_prefill_chunk=8)
    with running(engine, enable_prefix_cache=prefix_cache) as sched:
        requests = [req(ascii_prompt(rng, 6), 20, logprobs=0) for _ in range(8)]
        streams = [sched.submit(r) for r in requests]
        for r, s in zip(requests, streams):
            done = s.result(timeout=WAIT)
            assert done.finish_reason is FinishReason.LENGTH, done.error
            assert done.token_ids == chain(r.prompt_ids, 20)
            assert [lp.token_id for lp in done.logprobs] == done.token_ids
        assert sched.stats().preemptions > 0
        assert_all_released(sched, engine)


def test_cancel_frees_slot_and_pages_and_ends_stream():
    engine = MockEngine(max_slots=1, step_sleep_s=0.005)
    with running(engine, enable_prefix_cache=False) as sched:
        prompt = list(range(40, 50))
        live = sched.submit(req(prompt, 100))
        queued = sched.submit(req([30], 5))
        wait_for(lambda: sched.stats().generated_tokens >= 3)
        queued.cancel()
        live.cancel()
        live.cancel()  # idempotent
        done = live.result(timeout=2)
        assert done.finish_reason is FinishReason.CANCELLED
        assert 3 <= len(done.token_ids) < 100
        assert done.token_ids == chain(prompt, len(done.token_ids))
        assert queued.result(timeout=2).token_ids == []
        stats = sched.stats()
        assert (stats.cancellations, stats.slots_used, stats.pages_used) == (2, 0, 0)
        assert engine.occupied_slots == []
        sched.cancel("no-such-request")  # unknown ids are ignored
        assert sched.submit(req([40], 3)).result(timeout=WAIT).token_ids == [41, 42, 43]


def test_cancelling_a_head_that_waits_for_pages_lets_the_next_one_in():
    engine = MockEngine(max_slots=3, page_size=16, num_pages=5, step_sleep_s=0.03)  # 4 pages
    with running(engine, enable_prefix_cache=False) as sched:
        long = sched.submit(req(list(range(40, 57)), 15))  # 2 pages for its whole life
        wait_for(lambda: sched.stats().running == 1)
        head = sched.submit(req(list(range(40, 80)), 5))   # needs 3 pages (+1 headroom)
        small = sched.submit(req([40, 41, 42], 2))
        time.sleep(0.05)
        assert sched.stats().waiting == 2  # FCFS: the small one does not jump the head
        head.cancel()
        assert small.result(timeout=WAIT).token_ids == [43, 44]
        assert not long.finished  # admitted right away, not after the long one ended
        assert long.result(timeout=WAIT).token_ids == chain(list(range(40, 57)), 15)


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
        assert sched.stats().finished == {"error": 6}


class FailsAfterFree(MockEngine):
    """Fails the decode step of the iteration that freed a slot."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.freed = False

    def free(self, slot):
        super().free(slot)
        self.freed = True

    def generate(self, rows):
        if self.freed:
            raise RuntimeError("device lost")
        return super().generate(rows)


def test_failure_in_the_step_that_cancelled_still_ends_every_stream():
    engine = FailsAfterFree(max_slots=2, step_sleep_s=0.002)
    with running(engine) as sched:
        doomed, other = sched.submit(req([40], 100)), sched.submit(req([50], 100))
        wait_for(lambda: len(engine.decode_batches) >= 2)
        doomed.cancel()
        assert doomed.result(timeout=1).finish_reason is FinishReason.CANCELLED
        done = other.result(timeout=1)
        assert done.finish_reason is FinishReason.ERROR and "device lost" in done.error
        assert not sched.ready


def test_stop_string_across_tokens_finishes_and_releases():
    engine = MockEngine(max_slots=1, max_seq_len=256, step_sleep_s=0.002)
    with running(engine) as sched:
        async def consume():
            stream = sched.submit(req([96], 200, stop=("cde", "xyz")))
            return [d async for d in stream]

        deltas = asyncio.run(consume())
        assert "".join(d.text for d in deltas) == "ab"
        assert all("c" not in d.text for d in deltas)
        assert deltas[-1].finish_reason is FinishReason.STOP
        assert sum(len(d.token_ids) for d in deltas) == 5  # through the token completing "cde"
        assert_all_released(sched, engine)  # released by the output side, not left to run
        stats = sched.stats()
        assert stats.cancellations == 0 and stats.finished == {"stop": 1}
        assert stats.generated_tokens < 200
        held = sched.submit(req([96], 6, stop=("cx",))).result(timeout=WAIT)
        assert held.text == "abcdef" and held.finish_reason is FinishReason.LENGTH


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


def test_metrics_listener_gets_queue_time_ttft_and_token_latencies():
    engine = MockEngine(max_slots=1, step_sleep_s=0.005)
    got: list[RequestMetrics] = []
    with running(engine) as sched:
        sched.add_listener(got.append)
        first = sched.submit(req([40] * 3, 10))
        second = sched.submit(req([50] * 5, 4))
        second.result(timeout=WAIT)
        first.result(timeout=WAIT)
        wait_for(lambda: len(got) == 2)
    m1, m2 = got
    assert (m1.input_length, m1.output_length, m2.input_length, m2.output_length) == (3, 10, 5, 4)
    assert m2.queue_time_s >= 9 * 0.005  # waited for the first one's decode steps
    assert m1.queue_time_s < m2.queue_time_s
    assert m2.ttft_s >= m2.queue_time_s
    assert len(m1.tpot_s) == 9 and all(t >= 0.004 for t in m1.tpot_s)
    assert m1.finish_reason is FinishReason.LENGTH


def test_shutdown_drains_in_flight_requests_then_refuses():
    engine = MockEngine(max_slots=2, step_sleep_s=0.002)
    sched = Scheduler(engine, ByteTokenizer(), SchedulerConfig())
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
    sched = Scheduler(engine, ByteTokenizer(), SchedulerConfig())
    sched.start()
    stream = sched.submit(req([40], 100))
    start = time.monotonic()
    sched.shutdown(timeout=0.1)
    assert time.monotonic() - start < 2
    done = stream.result(timeout=0)
    assert done.finish_reason is FinishReason.ERROR and "shut down" in done.error


def test_random_load_with_cancels_and_shared_prefixes_never_leaks():
    rng = random.Random(7)
    engine = MockEngine(max_slots=3, page_size=4, num_pages=17, max_prefill_chunk=8)
    system = ascii_prompt(rng, 9)
    with running(engine, prefill_token_budget=10, max_queue=64) as sched:
        requests = [req((system if rng.random() < 0.6 else [])
                        + ascii_prompt(rng, rng.randrange(1, 12)),
                        rng.randrange(1, 25), priority=rng.randrange(2)) for _ in range(40)]
        streams = [sched.submit(r) for r in requests]
        doomed = set(rng.sample(range(40), 8))
        for i in doomed:
            streams[i].cancel()
        for i, (r, s) in enumerate(zip(requests, streams)):
            done = s.result(timeout=WAIT)
            want = chain(r.prompt_ids, r.params.max_tokens)
            if i in doomed:
                assert done.finish_reason in (FinishReason.CANCELLED, FinishReason.LENGTH)
                assert done.token_ids == want[:len(done.token_ids)]
            else:
                assert (done.finish_reason, done.token_ids) == (FinishReason.LENGTH, want)
        assert sched.stats().prefix_hits > 0
        assert_all_released(sched, engine)


def test_mock_engine_rejects_decode_over_wrong_pages():
    engine = MockEngine(page_size=4)
    engine.prefill(PrefillChunk(token_ids=[1, 2, 3, 4, 5], start_pos=0, page_ids=[1, 2]))
    assert engine.tokens_in([1, 2], 5) == [1, 2, 3, 4, 5]
    engine.insert(0, SlotState(prompt_ids=[1, 2, 3, 4, 5, 6], output_ids=[],
                               params=SamplingParams()))
    with pytest.raises(MockEngineError, match="wrong pages"):
        engine.generate([DecodeRow(slot=0, token_id=6, position=5, page_ids=[2, 1])])
    right = engine.generate([DecodeRow(slot=0, token_id=6, position=5, page_ids=[1, 2])])
    assert right[0].token_id == 7


def test_shutdown_is_idempotent_started_or_not():
    never_started = Scheduler(MockEngine(), ByteTokenizer())
    never_started.shutdown(timeout=1)
    never_started.shutdown(timeout=1)
    started = Scheduler(MockEngine(), ByteTokenizer())
    started.start()
    started.shutdown(timeout=1)
    started.shutdown(timeout=1)
    with pytest.raises(EngineUnavailable):
        started.submit(req([1, 2, 3]))


def test_short_prompt_is_prefilled_before_long_ones_admitted_earlier():
    engine = MockEngine(max_slots=4, page_size=4, num_pages=128, max_prefill_chunk=8)
    sched = Scheduler(engine, ByteTokenizer(), SchedulerConfig(prefill_token_budget=8))
    finished: list[str] = []
    sched.add_listener(lambda m: finished.append(m.request_id))
    longs = [req([65 + i] * 64, max_tokens=1) for i in range(3)]
    short = req([70, 71, 72], max_tokens=1)
    sched.start()
    try:
        for r in longs + [short]:
            sched.submit(r)
        wait_for(lambda: len(finished) == 4)
        # the oldest prompt keeps advancing, but the short one no longer waits for all of them
        assert finished.index(short.request_id) < finished.index(longs[2].request_id)
    finally:
        sched.shutdown(timeout=5)
