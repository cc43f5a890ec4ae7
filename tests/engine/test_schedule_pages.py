"""Pages in the scheduling decision: prefix-cache reuse, admission, growth and preemption when pages run
out, and random workloads (with cancels, with and without a step in flight) that must finish exactly and
leak no slot or page."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from slipstream.engine.mock_engine import MockEngine
from slipstream.engine.sequence import Status
from tests.engine.planner_helpers import Driver, PipelinedDriver, planner, seq, shape
from tests.engine.scheduler_helpers import chain


def test_a_fully_cached_prompt_still_computes_its_last_token():
    p = planner()
    d = Driver(p, MockEngine())
    first = seq(range(40, 48), max_tokens=1)  # two full pages
    d.submit(first)
    d.run()
    again = seq(range(40, 48), max_tokens=2)
    d.submit(again)
    plan = d.step()
    # one page reused; the second is computed again, its last token gives the logits to sample
    assert shape(plan) == [(again.order, 4, 4, True)] and again.matched_pages == 1
    longer = seq(range(40, 49), max_tokens=1)  # both pages cached: only the ninth token is fed
    d.submit(longer)
    assert (longer.order, 8, 1, True) in shape(d.step())
    assert longer.output_ids == [49] and again.output_ids == [48, 49]


def test_siblings_wait_for_the_shared_first_page_instead_of_computing_it():
    p = planner(budget=8)
    d = Driver(p, MockEngine(max_num_batched_tokens=8))
    prompt = list(range(40, 53))  # 13 tokens: 3 full pages
    siblings = [seq(prompt, max_tokens=2) for _ in range(3)]
    d.submit(*siblings)
    assert [c.seq for c in d.step().chunks] == [siblings[0]]  # the others wait
    assert p.waiting == siblings[1:]
    d.step()  # the first one finishes its prompt: 3 pages reach the cache
    third = d.step()
    assert shape(third)[1:] == [(siblings[1].order, 12, 1, True), (siblings[2].order, 12, 1, True)]
    d.run()
    assert all(s.output_ids == chain(prompt, 2) for s in siblings)


def test_out_of_pages_preempts_the_newest_and_it_resumes_exactly():
    # 6 usable pages of 4 tokens; two sequences that grow to 12 tokens need 6 + headroom.
    p = planner(num_pages=7, prefix=False)
    engine = MockEngine(num_pages=7)
    d = Driver(p, engine)
    a, b = seq(range(40, 47), max_tokens=8), seq(range(60, 67), max_tokens=8)
    d.submit(a, b)
    preempted = []
    for _ in range(100):
        if not (p.waiting or p.running):
            break
        plan = d.step()
        preempted += plan.preempted
        assert len(plan.freed_slots) == len(plan.preempted)
        assert p.blocks.allocator.num_used <= 6
    assert preempted and all(s is b for s in preempted)  # always the newest admitted
    assert a.output_ids == chain(a.request.prompt_ids, 8)
    assert b.output_ids == chain(b.request.prompt_ids, 8)
    assert engine.occupied_slots == [] and p.blocks.allocator.num_used == 0


def test_a_request_that_can_never_fit_is_rejected_not_waited_for():
    p = planner(num_pages=3)  # 2 usable pages: 8 tokens
    huge, ok = seq(range(40, 52)), seq([40, 41])
    p.enqueue(huge)
    p.enqueue(ok)
    admission = p.admit()
    assert [s for s, _ in admission.rejected] == [huge] and huge.status is Status.FINISHED
    assert "needs 3 KV pages but only 2 exist" in admission.rejected[0][1]
    assert admission.admitted == [ok] and p.waiting == []


def test_pages_used_counts_running_requests_and_cached_pages_apart():
    p = planner()
    d = Driver(p, MockEngine())
    s = seq(range(40, 50), max_tokens=3)  # 10 tokens: 2 full pages get cached
    d.submit(s)
    d.step()
    assert (p.pages_used, p.pages_cached) == (3, 0)
    d.run()
    assert (p.pages_used, p.pages_cached) == (0, 2)


@settings(max_examples=60, deadline=None)
@given(prompts=st.lists(st.tuples(st.integers(1, 24), st.integers(1, 12), st.booleans(),
                                  st.none() | st.integers(0, 30)), min_size=1, max_size=10),
       budget=st.integers(1, 20), num_pages=st.integers(8, 24), prefix=st.booleans(),
       max_slots=st.integers(1, 4), overlap=st.booleans(), roles=st.booleans())
def test_random_workloads_finish_exactly_and_leak_nothing(prompts, budget, num_pages, prefix,
                                                          max_slots, overlap, roles):
    # roles: planned for the hybrid weights, every step checked against them (MockEngine.prompt_w16)
    p = planner(budget=budget, max_slots=max_slots, num_pages=num_pages, prefix=prefix, roles=roles)
    engine = MockEngine(max_slots=max_slots, num_pages=num_pages, max_num_batched_tokens=budget, prompt_w16=roles)
    d = PipelinedDriver(p, engine) if overlap else Driver(p, engine)
    shared = list(range(40, 52))
    seqs, cancel_at = [], {}
    for length, max_tokens, share, cancel in prompts:
        prompt = (shared if share else []) + [60 + i for i in range(length)]
        if len(prompt) + max_tokens <= (num_pages - 1) * 4:  # what submit's length check allows
            seqs.append(seq(prompt, max_tokens=max_tokens))
            if cancel is not None:
                cancel_at[seqs[-1]] = cancel
    d.submit(*seqs)
    for n in range(5000):
        for s in [s for s, at in cancel_at.items() if at == n and s.status is not Status.FINISHED]:
            slot = p.finish(s)  # cancelled while waiting or running
            if slot is not None:
                engine.free(slot)
        if not (p.waiting or p.running or getattr(d, "in_flight", None)):
            break
        d.step()
    for s in seqs:
        want = chain(s.request.prompt_ids, s.request.params.max_tokens)
        if s in cancel_at:
            assert s.output_ids == want[:len(s.output_ids)]
        else:
            assert s.output_ids == want
    assert engine.occupied_slots == [] and sorted(p.free_slots) == list(range(max_slots))
    assert p.pages_used == 0
    allocator = p.blocks.allocator
    assert allocator.num_used == p.pages_cached
    for step in engine.steps:
        assert sum(n for _, _, n, _ in step) <= budget
