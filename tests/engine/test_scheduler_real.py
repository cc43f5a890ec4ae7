"""The scheduler driving the real JAX engine on the tiny model: a randomized workload with shared
prefixes, cancellations and a page budget small enough to force preemption."""
from __future__ import annotations

import random
import time

import numpy as np

from slipstream.engine.request import FinishReason, Request, SamplingParams
from slipstream.engine.scheduler import OutputProcessor, Scheduler, SchedulerConfig
from tests.engine.test_runner import dense_last_logits


class _Detok:
    """Ids as text; the scheduler only needs decode() and eos ids."""

    eos_token_ids = frozenset()

    def decode(self, ids, *, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


class _SmallBudget:
    """The real engine, with the scheduler shown fewer pages than it has (forces preemption)."""

    def __init__(self, engine, num_pages: int) -> None:
        self._engine = engine
        self.num_pages = num_pages

    def __getattr__(self, name):
        return getattr(self._engine, name)


def _greedy_alone(cfg, params, prompt, n, cache={}):
    key = (tuple(prompt), n)
    if key not in cache:
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(dense_last_logits(cfg, params, ids, width=128).argmax()))
        cache[key] = ids[len(prompt):]
    return cache[key]


def test_randomized_workload_completes_with_alone_outputs(tiny_engine, tiny_model):
    cfg, params = tiny_model
    rnd = random.Random(7)
    engine = _SmallBudget(tiny_engine, num_pages=22)  # 21 usable pages of 8 tokens for 4 slots
    scheduler = Scheduler(engine, OutputProcessor(_Detok()), SchedulerConfig(max_queue=256, max_num_batched_tokens=24))
    scheduler.start()
    shared = [[rnd.randrange(3, 256) for _ in range(rnd.choice([8, 16, 24]))] for _ in range(4)]
    requests, cancel_ids = [], set()
    for i in range(200):
        prefix = rnd.choice(shared) if rnd.random() < 0.6 else []
        prompt = prefix + [rnd.randrange(3, 256) for _ in range(rnd.randint(1, 30))]
        req = Request(prompt, SamplingParams(temperature=0.0, max_tokens=rnd.randint(1, 20), ignore_eos=True))
        requests.append(req)
        if rnd.random() < 0.1:
            cancel_ids.add(req.request_id)
    try:
        streams = [scheduler.submit(r) for r in requests]
        for r in requests:
            if r.request_id in cancel_ids:
                scheduler.cancel(r.request_id)
        results = [s.result(timeout=300) for s in streams]
        for req, res in zip(requests, results):
            assert res.error is None, res.error
            if req.request_id in cancel_ids and res.finish_reason == FinishReason.CANCELLED:
                continue
            assert res.finish_reason == FinishReason.LENGTH
            assert res.token_ids == _greedy_alone(cfg, params, req.prompt_ids, req.params.max_tokens), req
        stats = scheduler.stats()
        assert stats.preemptions > 0
        assert stats.prefix_hits > 0
        assert stats.cancellations > 0
        deadline = time.monotonic() + 2
        while scheduler.stats().slots_used and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = scheduler.stats()
        assert stats.slots_used == 0 and stats.running == 0 and stats.waiting == 0
        blocks = scheduler._blocks
        # every page is free or held only by the prefix cache (refcount 1: the cache's own reference)
        assert stats.pages_used == 0 and stats.pages_cached == blocks.prefix.num_cached
        blocks.prefix.clear()
        assert blocks.allocator.num_free == blocks.allocator.num_total
    finally:
        scheduler.shutdown(timeout=5)
