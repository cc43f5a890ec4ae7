"""One step in flight: step N+1 is planned and launched before step N's samples are applied (its decodes
feed them as PREVIOUS_SAMPLE), and only when no arrival or grammar needs step N's tokens first."""
from __future__ import annotations

from slipstream.engine.api import PREVIOUS_SAMPLE
from slipstream.engine.mock_engine import MockEngine
from tests.engine.planner_helpers import PipelinedDriver, planner, seq
from tests.engine.scheduler_helpers import chain


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
