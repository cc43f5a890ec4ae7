"""The arrival wait (engine/arrival_wait.py): a request sent when another finishes joins the very next
step, on MockEngine's step log; and its backoff when nobody comes."""
from __future__ import annotations

import threading
import time

import pytest

from slipstream.engine.arrival_wait import MAX_SKIP, ArrivalWait
from slipstream.engine.mock_engine import MockEngine
from slipstream.engine.request import FinishReason
from slipstream.engine.scheduler import SchedulerConfig
from tests.engine.scheduler_helpers import WAIT, assert_all_released, chain, req, running


def test_backoff_skips_1_2_4_finishing_steps_after_misses_and_resets_on_an_arrival():
    w, cv = ArrivalWait(1.0), threading.Condition()
    turns = []
    for _ in range(12):
        turns.append(w.take_turn())
        if turns[-1]:
            assert w.wait(cv, lambda: 0, 1, lambda: False) == 0  # a miss
    assert turns == [True, False, True, False, False, True, False, False, False, False, True, False]
    while not w.take_turn():  # the 8 skips
        pass
    assert w.wait(cv, iter([0, 1, 1]).__next__, 1, lambda: False) == 1  # one arrives: misses reset
    assert w.take_turn()
    w.wait(cv, lambda: 0, 1, lambda: False)  # a miss after that skips one step again
    assert [w.take_turn() for _ in range(2)] == [False, True]
    for _ in range(10):  # never more than MAX_SKIP
        w.wait(cv, lambda: 0, 1, lambda: False)
    assert sum(not w.take_turn() for _ in range(MAX_SKIP + 1)) == MAX_SKIP


def _step_of(engine: MockEngine, match) -> int:
    return next(i for i, step in enumerate(engine.step_log) if any(match(e) for e in step))


@pytest.mark.parametrize("wait_ms", [1000.0, 0.0])
def test_a_request_sent_when_another_finishes_joins_the_next_step(wait_ms):
    # both slots busy and nothing waiting: without the wait, the step after A's last one is launched
    # before A's finish is seen, so C (sent on A's finish, as a closed-loop client does) waits for it
    engine = MockEngine(max_slots=2, step_sleep_s=0.01)
    with running(engine, arrival_wait_ms=wait_ms) as sched:
        a, b = sched.submit(req([40], 6)), sched.submit(req([50, 51], 40))
        assert a.result(timeout=WAIT).token_ids == chain([40], 6)
        c = sched.submit(req([60, 61, 62, 63, 64], 3))
        assert c.result(timeout=WAIT).token_ids == chain([60, 61, 62, 63, 64], 3)
        assert b.result(timeout=WAIT).token_ids == chain([50, 51], 40)
        assert_all_released(sched, engine)
    slot_a = next(slot for slot, start, n, _ in engine.step_log[0] if n == 1)
    last_a = _step_of(engine, lambda e: e[:2] == (slot_a, 5))  # feeds position 5: samples token 6
    gap = _step_of(engine, lambda e: e[1:3] == (0, 5)) - last_a  # to C's prefill
    assert gap == 1 if wait_ms else gap >= 2


def test_finishes_nobody_follows_stop_the_arrival_wait():
    # five requests end at five different steps and no new one comes: the first finish waits the
    # whole arrival_wait_ms, the next is skipped, the third waits again, the last two are skipped
    engine = MockEngine(max_slots=8, step_sleep_s=0.001)
    with running(engine, arrival_wait_ms=400.0) as sched:
        start = time.monotonic()
        streams = [sched.submit(req([40 + 10 * i], 2 * i + 2)) for i in range(5)]
        for i, s in enumerate(streams):
            assert s.result(timeout=WAIT).token_ids == chain([40 + 10 * i], 2 * i + 2)
        elapsed = time.monotonic() - start
        assert_all_released(sched, engine)
    assert 0.8 <= elapsed < 1.9  # two waits, not five (2.0 s)


def test_arrival_wait_is_checked():
    with pytest.raises(ValueError, match="arrival_wait_ms"):
        SchedulerConfig(arrival_wait_ms=-1)


def test_a_request_sent_when_another_stops_on_a_token_joins_the_next_step():
    # a stop token is not known ahead, but with a slot free every step is collected before the next
    # is planned, and the finish it shows starts the wait as well
    engine = MockEngine(max_slots=3, step_sleep_s=0.01, eos_token_ids=frozenset({45}))
    with running(engine, arrival_wait_ms=1000.0) as sched:
        a, b = sched.submit(req([40], 20)), sched.submit(req([50, 51], 30))
        assert a.result(timeout=WAIT).finish_reason is FinishReason.STOP
        c = sched.submit(req([60, 61, 62, 63, 64], 3))
        assert c.result(timeout=WAIT).token_ids == chain([60, 61, 62, 63, 64], 3)
        b.result(timeout=WAIT)
        assert_all_released(sched, engine)
    slot_a = next(slot for slot, start, n, _ in engine.step_log[0] if n == 1)
    last_a = _step_of(engine, lambda e: e[:2] == (slot_a, 4))  # feeds position 4: samples 45
    assert _step_of(engine, lambda e: e[1:3] == (0, 5)) - last_a == 1


def test_the_arrival_wait_comes_back_after_a_miss():
    # a finish nobody follows makes the next finishing step skip the wait; the one after waits again,
    # also when every slot is taken (steps launched ahead)
    engine = MockEngine(max_slots=2, step_sleep_s=0.01)
    with running(engine, arrival_wait_ms=300.0) as sched:
        assert sched.submit(req([30], 3)).result(timeout=WAIT).token_ids == chain([30], 3)
        time.sleep(0.5)  # the wait after it gets nothing
        a, b = sched.submit(req([40], 6)), sched.submit(req([50, 51], 60))
        a.result(timeout=WAIT)
        c = sched.submit(req([60, 61, 62, 63, 64], 3))  # A's finish was the skipped one
        c.result(timeout=WAIT)
        d = sched.submit(req([70, 71, 72, 73, 74, 75], 3))
        assert d.result(timeout=WAIT).token_ids == chain([70, 71, 72, 73, 74, 75], 3)
        b.result(timeout=WAIT)
        assert_all_released(sched, engine)
    slot_c = next(e[0] for step in engine.step_log for e in step if e[1:3] == (0, 5))
    last_c = _step_of(engine, lambda e: e[:3] == (slot_c, 6, 1))  # feeds position 6: samples its 3rd token
    assert _step_of(engine, lambda e: e[1:3] == (0, 6)) - last_c == 1  # D's prefill
