"""Drives StepPlanner without the scheduler's thread, against MockEngine (which checks every step's tokens
and pages): the plain loop and the loop with one step in flight."""
from __future__ import annotations

import itertools

from slipstream.engine.api import SlotState
from slipstream.engine.block_manager import BlockManager
from slipstream.engine.mock_engine import MockEngine
from slipstream.engine.request import Request, SamplingParams
from slipstream.engine.schedule import StepPlanner
from slipstream.engine.sequence import Sequence, Status
from slipstream.engine.step_plan import Admission, Plan

_order = itertools.count()


def planner(*, budget: int = 16, max_slots: int = 4, page_size: int = 4, num_pages: int = 64,
            prefix: bool = True, roles: bool = False) -> StepPlanner:
    """roles: planned for an engine whose tokens' roles decide their weights (the hybrid's prompt_w16)."""
    return StepPlanner(BlockManager(num_pages, page_size, prefix, roles=roles), max_slots=max_slots,
                       token_budget=budget, roles=roles)


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

    def admit(self) -> Admission:
        admission = self.p.admit()
        for slot in admission.freed_slots:  # preempted for more urgent sequences
            self.engine.free(slot)
        for s in admission.admitted:
            self.engine.insert(s.slot, SlotState(s.request.prompt_ids, tuple(s.output_ids),
                                                 s.request.params))
            s.inserted = True
        return admission

    def step(self) -> Plan:
        self.admit()
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
