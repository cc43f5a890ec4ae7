"""Scheduler on MockEngine (next token = fed token + 1): hand-computable outputs under concurrency,
ordering, the per-step token budget, prefix caching, preemption, cancellation and page stats."""
from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from slipstream.engine.mock_engine import MockEngine
from slipstream.engine.request import FinishReason
from slipstream.engine.scheduler import OutputProcessor, RequestMetrics, Scheduler, SchedulerConfig, StepEvent
from tests.engine.scheduler_helpers import (WAIT, ByteTokenizer, ascii_prompt, assert_all_released,
                                            chain, req, running, text_of, wait_for)


def test_many_concurrent_requests_get_their_own_tokens():
    rng = random.Random(0)
    engine = MockEngine(max_slots=4, page_size=4, num_pages=64, max_num_batched_tokens=16)
    with running(engine) as sched:
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
        wait_for(lambda: sched.stats().finished == {"length": 40})  # counted after delivery
        stats = sched.stats()
        assert stats.generated_tokens == sum(r.params.max_tokens for r in requests)
        assert stats.prompt_tokens == sum(len(r.prompt_ids) for r in requests)
        assert max(engine.decode_batches) == 4  # the step really was shared
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
        wait_for(lambda: len(order) == 6)  # listeners run after the streams are told
    ids = [r.request_id for r in reqs]
    assert order == [blocker.request_id, ids[1], ids[3], ids[0], ids[2], ids[4]]


def test_an_urgent_request_preempts_a_running_batch_job_which_resumes_with_its_tokens():
    """Both slots held by long low-priority requests: a priority 0 one arriving runs at once, through the threaded
    loop (the victim's slot unbound before the urgent one is inserted; MockEngine checks every step's history)."""
    engine = MockEngine(max_slots=2, max_seq_len=1024, num_pages=300, step_sleep_s=0.002)
    with running(engine) as sched:
        batch = [sched.submit(req([40 + i], 200, priority=5)) for i in range(2)]
        wait_for(lambda: sched.stats().running == 2)
        urgent = sched.submit(req([90], 5, priority=0))
        assert urgent.result(timeout=WAIT).token_ids == chain([90], 5)
        assert not any(b.finished for b in batch)  # it did not wait for a batch job to end
        assert sched.stats().preemptions >= 1
        for i, b in enumerate(batch):
            assert b.result(timeout=WAIT).token_ids == chain([40 + i], 200)


def test_each_step_stays_within_the_configured_budget_and_mixes_decodes_with_chunks():
    engine = MockEngine(max_slots=3, page_size=4, max_num_batched_tokens=16, max_seq_len=1024,
                        num_pages=300, step_sleep_s=0.001)
    with running(engine, max_num_batched_tokens=6, enable_prefix_cache=False) as sched:
        assert sched.max_num_batched_tokens == 6
        decoding = sched.submit(req([1], 1000))
        wait_for(lambda: len(engine.steps) > 0)
        prompts = [list(range(40, 70)), list(range(70, 100))]  # 30 tokens each
        streams = [sched.submit(req(p, 5)) for p in prompts]
        for p, s in zip(prompts, streams):
            assert s.result(timeout=WAIT).token_ids == chain(p, 5)
        decoding.cancel()
        decoding.result(timeout=WAIT)
        assert sched.stats().prefilled_tokens == 1 + 60  # every prompt token, the last included
    steps = engine.steps
    assert max(sum(n for _, _, n, _ in step) for step in steps) == 6
    # the decoding request never stalled while the prompts were computed: it leads every step
    chunky = [step for step in steps if any(n > 1 for _, _, n, _ in step)]
    assert len(chunky) >= 60 // 5
    assert all(step[0][2:] == (1, True) for step in chunky)


def test_a_budget_above_the_engine_largest_step_is_refused():
    with pytest.raises(ValueError, match="exceeds the engine's largest step of 16 tokens"):
        Scheduler(MockEngine(max_num_batched_tokens=16), OutputProcessor(ByteTokenizer()),
                  SchedulerConfig(max_num_batched_tokens=17))
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 1"):
        SchedulerConfig(max_num_batched_tokens=0)


def test_the_engine_largest_step_is_the_default_budget():
    engine = MockEngine(max_num_batched_tokens=32, step_sleep_s=0.001)
    with running(engine) as sched:
        assert sched.max_num_batched_tokens == 32
        done = sched.submit(req(list(range(40, 70)), 3)).result(timeout=WAIT)
        assert done.token_ids == [70, 71, 72]
    # the whole prompt in one step, which also samples the first token
    assert [step[0][1:] for step in engine.steps] == [(0, 30, True), (30, 1, True), (31, 1, True)]


def test_one_token_prompt_samples_in_its_first_step():
    engine = MockEngine()
    with running(engine) as sched:
        assert sched.submit(req([70], 3)).result(timeout=WAIT).text == "GHI"
    assert [step[0][1:] for step in engine.steps] == [(0, 1, True), (1, 1, True), (2, 1, True)]


def test_prefix_cache_second_request_computes_only_new_tokens():
    engine = MockEngine(page_size=4)
    prefix = list(range(40, 52))  # three full pages
    with running(engine) as sched:
        first = sched.submit(req(prefix + [60, 61], 4)).result(timeout=WAIT)
        assert sched.stats().prefilled_tokens == 14
        second_prompt = prefix + [70, 71, 72]
        second = sched.submit(req(second_prompt, 4)).result(timeout=WAIT)
        assert sched.stats().prefilled_tokens == 14 + 3  # [70, 71, 72] after 3 cached pages
        assert second.token_ids == chain(second_prompt, 4)
        again = sched.submit(req(prefix + [60, 61], 4)).result(timeout=WAIT)
        assert again.token_ids == first.token_ids
        stats = sched.stats()
        assert stats.prefilled_tokens == 14 + 3 + 2
        assert (stats.prefix_queries, stats.prefix_hits) == (3, 2)
        assert stats.prefix_hit_tokens == 24
        assert_all_released(sched, engine)


def test_identical_prompts_submitted_together_share_pages():
    engine = MockEngine(max_slots=4, page_size=4)
    prompt = list(range(40, 53))  # 13 tokens: 12 cacheable
    with running(engine, max_num_batched_tokens=4) as sched:
        streams = [sched.submit(req(prompt, 5)) for _ in range(4)]  # what n=4 expands to
        results = [s.result(timeout=WAIT) for s in streams]
        assert sched.stats().prefilled_tokens == 13 + 3 * 1  # siblings compute their last token
    assert all(r.token_ids == chain(prompt, 5) for r in results)
    assert max(engine.decode_batches) == 4  # siblings still decode together


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_preemption_under_a_small_page_budget_keeps_outputs_exact(prefix_cache):
    rng = random.Random(1)
    # 12 usable pages of 4 tokens; 4 slots of 26-token sequences would need 28.
    engine = MockEngine(max_slots=4, page_size=4, num_pages=13, max_num_batched_tokens=8)
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


def test_pages_used_counts_running_requests_and_returns_to_zero_when_idle():
    engine = MockEngine(page_size=4, step_sleep_s=0.005)
    with running(engine) as sched:
        stream = sched.submit(req(list(range(40, 50)), 30))  # 10 tokens: 2 full pages cacheable
        wait_for(lambda: sched.stats().generated_tokens >= 2)
        busy = sched.stats()
        assert busy.pages_used >= 3 and busy.pages_cached == 0  # its cached pages are in use
        stream.result(timeout=WAIT)
        wait_for(lambda: sched.stats().slots_used == 0)
        idle = sched.stats()
        assert (idle.pages_used, idle.pages_cached, idle.pages_total) == (0, 2, 63)


def test_random_load_with_cancels_and_shared_prefixes_never_leaks():
    rng = random.Random(7)
    engine = MockEngine(max_slots=3, page_size=4, num_pages=17, max_num_batched_tokens=10)
    system = ascii_prompt(rng, 9)
    with running(engine, max_queue=64) as sched:
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
        stats = sched.stats()
        assert stats.prefix_hits > 0 and stats.preemptions > 0
        assert_all_released(sched, engine)


def test_short_prompt_is_prefilled_before_long_ones_admitted_earlier():
    engine = MockEngine(max_slots=4, page_size=4, num_pages=128, max_num_batched_tokens=8,
                        step_sleep_s=0.002)
    finished: list[str] = []
    with running(engine) as sched:
        sched.add_listener(lambda m: finished.append(m.request_id))
        # 60 tokens: the oldest's last chunk (4) leaves 4 tokens of its step to the others
        longs = [req([65 + i] * 60, max_tokens=1) for i in range(3)]
        short = req([70, 71, 72], max_tokens=1)
        streams = [sched.submit(r) for r in longs + [short]]
        for s in streams:
            s.result(timeout=WAIT)
        wait_for(lambda: len(finished) == 4)  # listeners run after the streams are told
    # the oldest prompt keeps advancing, but the short one no longer waits for all of them
    assert finished == [longs[0].request_id, short.request_id, longs[1].request_id,
                        longs[2].request_id]


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
        wait_for(lambda: sched.stats().finished == {"stop": 1})
        stats = sched.stats()
        assert stats.cancellations == 0 and stats.generated_tokens < 200
        held = sched.submit(req([96], 6, stop=("cx",))).result(timeout=WAIT)
        assert held.text == "abcdef" and held.finish_reason is FinishReason.LENGTH


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


def test_step_listener_sees_every_step_the_engine_runs():
    engine = MockEngine(max_slots=1, page_size=4, max_num_batched_tokens=8, step_sleep_s=0.002)
    got: list[StepEvent] = []
    with running(engine, enable_prefix_cache=False) as sched:
        sched.add_step_listener(got.append)
        first = sched.submit(req(list(range(40, 52)), 3))   # 12 tokens: chunks of 8 and 4
        second = sched.submit(req([60, 61], 2))            # waits for the only slot
        assert first.result(timeout=WAIT).token_ids == chain(list(range(40, 52)), 3)
        assert second.result(timeout=WAIT).token_ids == chain([60, 61], 2)
    ran = [e for e in got if e.plan.chunks]
    # each step the engine ran, in order, as the listener saw its plan
    assert [[(c.start, c.length) for c in e.plan.chunks] for e in ran] == \
        [[(s, n) for _, s, n, _ in step] for step in engine.steps]
    assert [(c.start, c.length) for c in ran[0].plan.chunks] == [(0, 8)]
    assert any(e.running == 1 and len(e.waiting) == 1 for e in ran)  # the second one waited for the slot
    assert ran[-1].waiting == () and all(e.plan_seconds >= 0 for e in got)
    assert all(a.planned_at <= b.planned_at for a, b in zip(got, got[1:]))


# ---- one step in flight while the next is planned -------------------------------------------------

def _overlapped(engine: MockEngine) -> int:
    """Steps launched before the previous step's samples were collected."""
    events = engine.events
    return sum(1 for i, (kind, k) in enumerate(events)
               if kind == "launch" and k > 0 and ("collect", k - 1) in events[i + 1:])


def test_decode_steps_launch_before_the_previous_samples_come_back():
    engine = MockEngine(max_slots=3, step_sleep_s=0.002)
    with running(engine) as sched:
        prompts = [[40], [50, 51], [60, 61, 62]]
        streams = [sched.submit(req(p, 30)) for p in prompts]
        for p, s in zip(prompts, streams):
            assert s.result(timeout=WAIT).token_ids == chain(p, 30)
        assert sched.stats().generated_tokens == 90
        assert_all_released(sched, engine)
    assert _overlapped(engine) >= 25  # steady decoding: (nearly) every step overlaps its successor


def test_a_stop_token_ends_the_output_though_the_next_step_was_in_flight():
    engine = MockEngine(eos_token_ids=frozenset({45}), step_sleep_s=0.002)
    with running(engine) as sched:
        done = sched.submit(req([40], 20)).result(timeout=WAIT)
        assert done.token_ids == [41, 42, 43, 44, 45] and done.finish_reason is FinishReason.STOP
        # the decode launched after 45 (before 45 was seen) is computed and dropped
        wait_for(lambda: ("collect", 5) in engine.events)
        assert sum(len(step) for step in engine.steps) == 6
        assert sched.stats().generated_tokens == 5
        assert_all_released(sched, engine)


def test_cancel_with_its_decode_in_flight_leaves_the_others_exact():
    engine = MockEngine(max_slots=2, step_sleep_s=0.005)
    with running(engine) as sched:
        doomed, other = sched.submit(req([40], 60)), sched.submit(req([50], 60))
        wait_for(lambda: len(engine.steps) >= 5)
        doomed.cancel()
        done = doomed.result(timeout=WAIT)
        assert done.finish_reason is FinishReason.CANCELLED
        assert done.token_ids == chain([40], len(done.token_ids))  # nothing after the cancel
        assert other.result(timeout=WAIT).token_ids == chain([50], 60)
        assert_all_released(sched, engine)
    assert _overlapped(engine) > 0

