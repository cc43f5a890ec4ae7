"""The scheduling decision without threads: what each ragged step runs (decodes first, then prefill
chunks in the token budget), admission, page growth and preemption, driven against MockEngine,
which checks every step's tokens and pages."""
from __future__ import annotations

import itertools

from hypothesis import given, settings, strategies as st

from slipstream.engine.api import PREVIOUS_SAMPLE, SlotState
from slipstream.engine.block_manager import BlockManager
from slipstream.engine.mock_engine import MockEngine
from slipstream.engine.request import Request, SamplingParams
from slipstream.engine.schedule import Plan, StepPlanner
from slipstream.engine.sequence import Sequence, Status

_order = itertools.count()


def planner(*, budget: int = 16, max_slots: int = 4, page_size: int = 4, num_pages: int = 64,
            prefix: bool = True) -> StepPlanner:
    return StepPlanner(BlockManager(num_pages, page_size, prefix), max_slots=max_slots,
                       token_budget=budget)


def seq(prompt, max_tokens: int = 8, priority: int = 0, **params) -> Sequence:
    request = Request(prompt_ids=list(prompt), params=SamplingParams(max_tokens=max_tokens, **params),
                      priority=priority)
    return Sequence(request, order=next(_order))


def shape(plan: Plan) -> list[tuple[int, int, int, bool]]:
    """(sequence order, start, length, sample) per chunk: what the step runs, in batch order."""
    return [(c.seq.order, c.start, c.length, c.sample) for c in plan.chunks]


class Driver:
    """The scheduler loop without its thread: admit, insert, plan, step, advance, append."""

    def __init__(self, p: StepPlanner, engine: MockEngine) -> None:
        self.p, self.engine = p, engine

    def submit(self, *seqs: Sequence) -> None:
        for s in seqs:
            self.p.enqueue(s)

    def step(self) -> Plan:
        admission = self.p.admit()
        for s in admission.admitted:
            self.engine.insert(s.slot, SlotState(s.request.prompt_ids, tuple(s.output_ids),
                                                 s.request.params))
            s.inserted = True
        plan = self.p.plan()
        for slot in plan.freed_slots:
            self.engine.free(slot)
        if plan.chunks:
            self.p.advance(plan)
            sampled = self.engine.step(plan.batch())
            for s, out in zip(plan.sampled, sampled):
                s.add_sample(out.token_id)
                if len(s.output_ids) >= s.request.params.max_tokens:
                    self.engine.free(self.p.finish(s))
        return plan

    def run(self, max_steps: int = 1000) -> int:
        for n in range(max_steps):
            if not (self.p.waiting or self.p.running):
                return n
            self.step()
        raise AssertionError("did not drain")


class PipelinedDriver(Driver):
    """The scheduler loop's overlap: while the planner allows it, step N+1 is planned and launched
    before step N's samples are applied (its decodes feed them as PREVIOUS_SAMPLE)."""

    def __init__(self, p: StepPlanner, engine: MockEngine, stop_at: int | None = None) -> None:
        super().__init__(p, engine)
        self.in_flight = None
        self.stop_at = stop_at  # a sampled token that ends its sequence (an EOS)
        self.batches = []

    def admit(self) -> None:
        for s in self.p.admit().admitted:
            self.engine.insert(s.slot, SlotState(s.request.prompt_ids, tuple(s.output_ids),
                                                 s.request.params))
            s.inserted = True

    def step(self) -> Plan:
        self.admit()
        if self.in_flight is not None and not self.p.can_overlap():
            self.collect()
            self.admit()
        plan = self.p.plan()
        for slot in plan.freed_slots:
            self.engine.free(slot)
        self.p.advance(plan)
        launched = None
        if plan.chunks:
            self.batches.append(plan.batch())
            launched = (plan, self.engine.launch(self.batches[-1]))
        if self.in_flight is not None:
            self.collect()
        self.in_flight = launched
        return plan

    def collect(self) -> None:
        (plan, result), self.in_flight = self.in_flight, None
        for s, out in zip(plan.sampled, result.result()):
            if s.status is Status.FINISHED:
                continue  # it left while the step was in flight
            s.add_sample(out.token_id)
            if len(s.output_ids) >= s.request.params.max_tokens or out.token_id == self.stop_at:
                slot = self.p.finish(s)
                if slot is not None:
                    self.engine.free(slot)

    def run(self, max_steps: int = 1000) -> int:
        for n in range(max_steps):
            if not (self.p.waiting or self.p.running or self.in_flight):
                return n
            self.step()
        raise AssertionError("did not drain")


def chain(prompt, n: int) -> list[int]:
    return [(prompt[-1] + 1 + i) % 256 for i in range(n)]


def test_with_a_step_in_flight_decodes_feed_its_samples_and_stop_at_max_tokens():
    p = planner(budget=8, max_slots=2)  # every slot taken: steps overlap
    engine = MockEngine(max_slots=2, max_num_batched_tokens=8)
    d = PipelinedDriver(p, engine)
    a, b = seq([40, 41], max_tokens=4), seq([50, 51, 52], max_tokens=2)
    d.submit(a, b)
    assert d.run() == 5  # the last iteration only collects
    assert a.output_ids == chain([41], 4) and b.output_ids == chain([52], 2)
    # each step after the first is launched before the previous one's samples are collected
    assert engine.events[:4] == [("launch", 0), ("launch", 1), ("collect", 0), ("launch", 2)]
    # the same steps as without overlap: no decode past max_tokens
    assert engine.steps == [((0, 0, 2, True), (1, 0, 3, True)), ((0, 2, 1, True), (1, 3, 1, True)),
                            ((0, 3, 1, True),), ((0, 4, 1, True),)]
    assert [[s.token_ids for s in batch.seqs] for batch in d.batches[1:]] == \
        [[(PREVIOUS_SAMPLE,), (PREVIOUS_SAMPLE,)], [(PREVIOUS_SAMPLE,)], [(PREVIOUS_SAMPLE,)]]
    assert engine.occupied_slots == [] and p.pages_used == 0


def test_a_stop_token_with_a_step_in_flight_drops_the_step_after_it():
    p = planner(budget=8)
    engine = MockEngine(max_num_batched_tokens=8)
    d = PipelinedDriver(p, engine, stop_at=43)
    a = seq([40, 41], max_tokens=10)
    d.submit(a)
    d.run()
    assert a.output_ids == [42, 43]  # the decode launched after 43 was dropped, not appended
    assert len(engine.steps) == 3 and engine.occupied_slots == []


def test_overlap_only_when_no_arrival_could_start_sooner_and_no_grammar_needs_its_token():
    p = planner(max_slots=3)
    seqs = [seq([40 + i]) for i in range(4)]
    p.enqueue(seqs[0])
    p.admit()
    assert p.can_overlap()  # one sequence alone
    p.enqueue(seqs[1])
    p.admit()
    assert not p.can_overlap()  # a free slot: an arrival would start one step later
    p.enqueue(seqs[2])
    p.admit()
    assert p.can_overlap()  # every slot taken
    p.enqueue(seqs[3])
    assert not p.can_overlap()  # it waits for the slot a finishing sequence frees
    constrained = planner(max_slots=1)
    constrained.enqueue(seq([40], constraint=_AnyGrammar()))
    constrained.admit()
    assert not constrained.can_overlap()


class _AnyGrammar:
    """Stands for a compiled grammar: the planner only asks whether a request has one."""

    def matcher(self):
        raise AssertionError("the planner never builds matchers")


def test_decodes_first_then_prefill_chunks_in_the_rest_of_the_budget():
    p = planner(budget=10)
    d = Driver(p, MockEngine(max_num_batched_tokens=10))
    a, b = seq([40, 41]), seq([50])
    d.submit(a, b)
    assert shape(d.step()) == [(b.order, 0, 1, True), (a.order, 0, 2, True)]
    prompt = seq(range(60, 80))  # 20 tokens
    d.submit(prompt)
    # a and b decode (1 token each), then the new prompt gets exactly the 8 tokens that are left
    assert shape(d.step()) == [(a.order, 2, 1, True), (b.order, 1, 1, True),
                               (prompt.order, 0, 8, False)]
    assert shape(d.step()) == [(a.order, 3, 1, True), (b.order, 2, 1, True),
                               (prompt.order, 8, 8, False)]
    # its last chunk (4 tokens) samples its first output token in the same step
    assert shape(d.step()) == [(a.order, 4, 1, True), (b.order, 3, 1, True),
                               (prompt.order, 16, 4, True)]
    assert prompt.output_ids == [80]
    assert shape(d.step())[-1] == (prompt.order, 20, 1, True)  # now it is a decode


def test_the_budget_is_filled_exactly_and_chunks_are_cut_anywhere():
    p = planner(budget=7, num_pages=128)
    d = Driver(p, MockEngine(max_num_batched_tokens=7))
    seqs = [seq(range(k, k + n), max_tokens=3) for k, n in ((40, 11), (60, 5), (80, 9))]
    d.submit(*seqs)
    totals = []
    while p.waiting or p.running:
        plan = d.step()
        assert plan.num_tokens <= 7
        totals.append(plan.num_tokens)
    assert totals[:3] == [7, 7, 7]  # 25 prompt tokens: no step runs short while work is left
    assert [s.output_ids for s in seqs] == [chain(s.request.prompt_ids, 3) for s in seqs]


def test_oldest_prompt_always_advances_then_shortest_remaining():
    p = planner(budget=36, num_pages=128)
    d = Driver(p, MockEngine(max_num_batched_tokens=36))
    old, mid, short = seq(range(100, 130)), seq(range(60, 72)), seq(range(80, 83))
    d.submit(old, mid, short)
    # old first although it is the longest, then short (3), then mid gets the 3 tokens left
    assert shape(d.step()) == [(old.order, 0, 30, True), (short.order, 0, 3, True),
                               (mid.order, 0, 3, False)]


def test_shorter_prompts_never_starve_the_oldest_one():
    p = planner(budget=8, num_pages=128)
    d = Driver(p, MockEngine(max_num_batched_tokens=8))
    old = seq(range(100, 130), max_tokens=1)
    d.submit(old)
    d.step()
    for k in range(3):  # a short prompt arrives every step; the oldest keeps its share
        d.submit(seq(range(40 + 10 * k, 43 + 10 * k), max_tokens=1))
        assert shape(d.step())[0] == (old.order, 8 * (k + 1), min(8, 30 - 8 * (k + 1)), k == 2)
    assert old.output_ids == [130]


def test_a_mixed_step_carries_decodes_and_chunks_of_several_prompts():
    p = planner(budget=16)
    engine = MockEngine(max_num_batched_tokens=16)
    d = Driver(p, engine)
    d.submit(seq([10]), seq([20]))
    d.step()
    x, y = seq(range(40, 46)), seq(range(50, 60))
    d.submit(x, y)
    plan = d.step()
    batch = plan.batch()
    assert [(s.start_pos, list(s.token_ids), s.sample) for s in batch.seqs] == [
        (1, [11], True), (1, [21], True), (0, list(range(40, 46)), True),
        (0, list(range(50, 58)), False)]
    assert batch.num_tokens == 16
    for s, c in zip(batch.seqs, plan.chunks):
        assert s.slot == c.seq.slot and list(s.page_ids) == c.seq.pages
        assert len(s.page_ids) * 4 >= s.end_pos  # pages cover the chunk
    assert engine.steps[-1] == tuple((s.slot, s.start_pos, len(s.token_ids), s.sample)
                                     for s in batch.seqs)
    assert plan.prefill_tokens == 14  # the two decodes are not prefill


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


def test_decodes_beyond_the_budget_wait_oldest_first():
    p = planner(budget=2)
    d = Driver(p, MockEngine(max_num_batched_tokens=2))
    seqs = [seq([40 + i], max_tokens=4) for i in range(3)]
    d.submit(*seqs)
    d.step()  # the first two one-token prompts
    assert [c.seq for c in d.step().chunks] == seqs[:2]
    d.run()
    assert all(s.output_ids == chain(s.request.prompt_ids, 4) for s in seqs)


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
       max_slots=st.integers(1, 4), overlap=st.booleans())
def test_random_workloads_finish_exactly_and_leak_nothing(prompts, budget, num_pages, prefix,
                                                          max_slots, overlap):
    p = planner(budget=budget, max_slots=max_slots, num_pages=num_pages, prefix=prefix)
    engine = MockEngine(max_slots=max_slots, num_pages=num_pages, max_num_batched_tokens=budget)
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


def test_one_long_prefill_ends_per_step_short_ones_are_not_held():
    p = planner(budget=16, num_pages=128)
    d = Driver(p, MockEngine(max_num_batched_tokens=16))
    x, y = seq(range(40, 46)), seq(range(60, 66))  # 6 tokens each: under half the budget
    d.submit(x, y)
    assert shape(d.step()) == [(x.order, 0, 6, True), (y.order, 0, 6, True)]  # both end
    p = planner(budget=16, num_pages=128)
    d = Driver(p, MockEngine(max_num_batched_tokens=16))
    a, b = seq(range(70, 78)), seq(range(80, 88))  # 8 tokens each: half the budget
    d.submit(a, b)
    # both fit, but b keeps its last token for the next step, where it ends beside a's decode
    assert shape(d.step()) == [(a.order, 0, 8, True), (b.order, 0, 7, False)]
    assert shape(d.step()) == [(a.order, 8, 1, True), (b.order, 7, 1, True)]
    assert b.output_ids == [88]
