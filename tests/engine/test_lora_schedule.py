"""Admission with LoRA slots, without threads or devices: a request waits while every slot serves
other adapters, base-model requests pass it, later adapter requests do not (no starvation)."""
from __future__ import annotations

import itertools

from slipstream.engine.block_manager import BlockManager
from slipstream.engine.request import Request, SamplingParams
from slipstream.engine.schedule import StepPlanner
from slipstream.engine.sequence import Sequence
from slipstream.models.lora import LoraAdapter

_order = itertools.count()


def adapter(name: str) -> LoraAdapter:
    return LoraAdapter(name=name, path=name, rank=1, scale=1.0, weights={}, digest=name.encode())


def seq(lora: LoraAdapter | None) -> Sequence:
    return Sequence(Request([1, 2, 3], SamplingParams(max_tokens=4), lora=lora), order=next(_order))


def test_a_request_waiting_for_a_lora_slot_is_not_starved():
    p = StepPlanner(BlockManager(64, 4, True), max_slots=8, token_budget=64, max_loras=1)
    a, b = adapter("a"), adapter("b")
    first, waits, base, later_a = seq(a), seq(b), seq(None), seq(a)
    for s in (first, waits, base, later_a):
        p.enqueue(s)
    admitted = p.admit().admitted
    assert admitted == [first, base] and first.lora_slot == 1 and base.lora_slot == 0
    assert p.waiting == [waits, later_a]  # "a" is resident, but the older "b" request goes first
    p.finish(first)
    assert p.admit().admitted == [waits] and waits.lora_slot == 1
    assert p.lora.swaps == 1
    p.finish(waits)
    assert p.admit().admitted == [later_a]


def test_only_requests_under_the_same_adapter_wait_for_a_shared_first_page():
    """A prompt's first page in prefill holds back a sibling that would reuse it, not a request under
    another adapter (whose KV differs) with the same tokens."""
    p = StepPlanner(BlockManager(64, 4, True), max_slots=8, token_budget=64, max_loras=1)
    prompt = list(range(3, 15))

    def same_prompt(lora):
        return Sequence(Request(prompt, SamplingParams(max_tokens=4), lora=lora), order=next(_order))

    first, sibling, other = same_prompt(None), same_prompt(None), same_prompt(adapter("a"))
    for s in (first, sibling, other):
        p.enqueue(s)
    assert p.admit().admitted == [first, other]
    assert p.waiting == [sibling]


def test_an_adapter_request_to_an_engine_without_lora_slots_fails_alone():
    p = StepPlanner(BlockManager(64, 4, True), max_slots=8, token_budget=64)
    lora, base = seq(adapter("a")), seq(None)
    p.enqueue(lora)
    p.enqueue(base)
    admission = p.admit()
    assert admission.admitted == [base]
    assert [(s, "without LoRA slots" in why) for s, why in admission.rejected] == [(lora, True)]
