"""Priority scheduling in StepPlanner: a more urgent request (a lower `priority`) that finds no slot or no pages
preempts the least urgent running one, which resumes after it with its output intact; equal or less urgent
arrivals wait their turn. MockEngine checks every step's tokens and pages, so a wrong resume fails loudly."""
from __future__ import annotations

from slipstream.engine.mock_engine import MockEngine
from slipstream.engine.sequence import Sequence, Status

from tests.engine.planner_helpers import Driver, PipelinedDriver, planner, seq


def continuation(s: Sequence) -> list[int]:
    """MockEngine's output for a prompt: each token the last one + 1."""
    last = s.request.prompt_ids[-1]
    return [last + 1 + i for i in range(s.request.params.max_tokens)]


def finish_order(d: Driver, seqs: list[Sequence], max_steps: int = 500) -> list[int]:
    order: list[int] = []
    for _ in range(max_steps):
        if not (d.p.waiting or d.p.running or getattr(d, "in_flight", None)):
            break
        d.step()
        order += [s.order for s in seqs if s.status is Status.FINISHED and s.order not in order]
    return order


def test_a_more_urgent_request_takes_the_least_urgent_ones_slot_and_the_victim_resumes_intact():
    for driver in (Driver, PipelinedDriver):
        p = planner(max_slots=2, budget=16)
        d = driver(p, MockEngine(max_slots=2, page_size=4, num_pages=64, max_num_batched_tokens=16))
        low_old, low_new = seq([10, 11, 12], 12, priority=1), seq([20, 21, 22], 12, priority=1)
        d.submit(low_old, low_new)
        for _ in range(3):
            d.step()
        urgent = seq([30, 31], 4, priority=0)
        d.submit(urgent)
        d.step()
        assert urgent.status is Status.RUNNING and low_new.status is Status.WAITING and low_new.preempted
        assert low_old.status is Status.RUNNING  # the newest of the least urgent went
        order = finish_order(d, [low_old, low_new, urgent])
        assert order.index(urgent.order) < order.index(low_new.order), driver
        for s in (low_old, low_new, urgent):
            assert s.output_ids == continuation(s), (driver, s.order)


def test_equal_or_lower_urgency_waits_for_a_free_slot():
    p = planner(max_slots=2)
    d = Driver(p, MockEngine(max_slots=2, page_size=4, num_pages=64, max_num_batched_tokens=16))
    running = [seq([10, 11], 6, priority=0), seq([20, 21], 6, priority=0)]
    d.submit(*running)
    d.step()
    same, lower = seq([30, 31], 3, priority=0), seq([40, 41], 3, priority=5)
    d.submit(same, lower)
    admission = p.admit()
    assert admission.admitted == [] and admission.preempted == []
    assert all(s.status is Status.RUNNING for s in running) and p.waiting == [same, lower]
    order = finish_order(d, [*running, same, lower])
    assert order.index(same.order) < order.index(lower.order)


def test_a_more_urgent_request_short_of_pages_preempts_until_it_fits():
    # 13 pages of 4 tokens (page 0 is padding): two running sequences of 20 tokens hold 10 of them
    p = planner(max_slots=4, page_size=4, num_pages=13, prefix=False)
    d = Driver(p, MockEngine(max_slots=4, page_size=4, num_pages=13, max_num_batched_tokens=16))
    low = [seq(list(range(10 + 20 * i, 30 + 20 * i)), 4, priority=2) for i in range(2)]
    d.submit(*low)
    while any(s.num_computed < 20 for s in low):
        d.step()
    urgent = seq(list(range(100, 116)), 4, priority=-1)  # 4 pages + 1 of headroom per running sequence
    d.submit(urgent)
    victim_slot = low[1].slot
    admission = d.admit()
    assert admission.admitted == [urgent] and admission.preempted == [low[1]]
    assert admission.freed_slots == [victim_slot] and low[0].status is Status.RUNNING
    finish_order(d, [*low, urgent])
    for s in (*low, urgent):
        assert s.output_ids == continuation(s)


def test_running_out_of_pages_preempts_the_least_urgent_before_the_newest():
    p = planner(max_slots=2, page_size=4, num_pages=9, prefix=False, budget=8)
    d = Driver(p, MockEngine(max_slots=2, page_size=4, num_pages=9, max_num_batched_tokens=8))
    batch_job, chat = seq([10, 11, 12, 13], 16, priority=3), seq([50, 51, 52, 53], 16, priority=0)
    d.submit(batch_job)
    d.step()
    d.submit(chat)  # admitted after it, so the newest
    preempted = []
    for _ in range(40):
        if not (p.waiting or p.running):
            break
        preempted += d.step().preempted
    assert preempted and all(s is batch_job for s in preempted)
    for s in (batch_job, chat):
        assert s.output_ids == continuation(s)
