"""MockEngine enforces the Engine contract, so scheduler tests fail loudly on a wrong step: tokens
that are not the slot's history, pages that do not hold it, a wrong sample flag, an oversize step."""
from __future__ import annotations

import pytest

from slipstream.engine.api import SlotState, StepBatch, StepSeq
from slipstream.engine.mock_engine import MockEngine, MockEngineError
from slipstream.engine.request import SamplingParams


def inserted(prompt, slot: int = 0, **kw) -> MockEngine:
    engine = MockEngine(page_size=4, **kw)
    engine.insert(slot, SlotState(prompt_ids=prompt, output_ids=[], params=SamplingParams()))
    return engine


def one(slot, tokens, start, pages, sample) -> StepBatch:
    return StepBatch([StepSeq(slot, tokens, start, pages, sample)])


def test_a_chunk_then_a_decode_over_the_right_pages():
    engine = inserted([1, 2, 3, 4, 5, 6])
    assert engine.step(one(0, [1, 2, 3, 4], 0, [1, 2], False)) == []
    out = engine.step(one(0, [5, 6], 4, [1, 2], True))
    assert [s.token_id for s in out] == [7]
    assert engine.tokens_in([1, 2], 6) == [1, 2, 3, 4, 5, 6]
    assert engine.step(one(0, [7], 6, [1, 2], True))[0].token_id == 8
    assert engine.steps == [((0, 0, 4, False),), ((0, 4, 2, True),), ((0, 6, 1, True),)]
    assert engine.decode_batches == [1]


def test_reading_over_wrong_pages_fails():
    engine = inserted([1, 2, 3, 4, 5, 6])
    engine.step(one(0, [1, 2, 3, 4, 5], 0, [1, 2], False))
    with pytest.raises(MockEngineError, match="wrong pages"):
        engine.step(one(0, [6], 5, [2, 1], True))


@pytest.mark.parametrize("batch, message", [
    (one(0, [1, 9], 0, [1], True), "history there is"),      # tokens that are not the prompt
    (one(0, [1, 2], 0, [1], True), "sample=True"),           # the chunk stops short of the end
    (one(0, [1, 2, 3], 0, [1], False), "sample=False"),      # it reaches the end: must sample
    (one(1, [1], 0, [1], False), "never inserted"),
    (one(0, [1, 2, 3], 0, [0], True), "page id 0"),          # the padding page
    (StepBatch([]), "step of 0 tokens"),
])
def test_contract_violations_fail(batch, message):
    engine = inserted([1, 2, 3])
    with pytest.raises(MockEngineError, match=message):
        engine.step(batch)


def test_a_step_over_the_budget_or_a_slot_twice_fails():
    engine = inserted(list(range(1, 10)), max_num_batched_tokens=8)
    with pytest.raises(MockEngineError, match="allowed: 1..8"):
        engine.step(one(0, list(range(1, 10)), 0, [1, 2, 3], True))
    with pytest.raises(MockEngineError, match="twice"):
        engine.step(StepBatch([StepSeq(0, [1], 0, [1], False), StepSeq(0, [2], 1, [1], False)]))


def test_injected_failure_after_n_steps():
    engine = inserted([1, 2, 3], fail_after_steps=1)
    engine.step(one(0, [1, 2, 3], 0, [1], True))
    with pytest.raises(MockEngineError, match="injected failure after 1 steps"):
        engine.step(one(0, [4], 3, [1], True))
