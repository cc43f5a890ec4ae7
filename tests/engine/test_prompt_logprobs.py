"""Prompt scoring (SamplingParams.prompt_logprobs, the API's `echo` with `logprobs`): each prompt token's
log-probability given the ones before it, across chunked prefills, prefix-cache hits and preemption, on the
real engine against the dense reference and through the scheduler on the mock engine."""
from __future__ import annotations

import random

import numpy as np
import pytest
from flax import nnx

from slipstream.engine.mock_engine import MockEngine
from slipstream.engine.request import FinishReason, Request, SamplingParams
from slipstream.engine.scheduler import OutputProcessor, Scheduler, SchedulerConfig
from slipstream.models.base import dense_logits
from tests.engine.scheduler_helpers import WAIT, ascii_prompt, chain, req, running
from tests.engine.test_scheduler_real import _Detok, _greedy_alone, _SmallBudget

_dense = nnx.jit(dense_logits)


def dense_logprobs(model, prompt: list[int], width: int = 128) -> np.ndarray:
    """log_softmax of the dense reference's logits at every prompt position [len(prompt), V]."""
    tokens = np.zeros((1, width), np.int32)
    tokens[0, :len(prompt)] = prompt
    logits = np.asarray(_dense(model, tokens, np.arange(width)[None] < len(prompt)))[0, :len(prompt)]
    logits = logits.astype(np.float64)
    return logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)


def check_scores(model, prompt: list[int], scores, k: int) -> None:
    """scores: (None, TokenLogprob per prompt token after the first): each the reference's log-probability of
    that token where it stands, with the reference's top k."""
    assert len(scores) == len(prompt) and scores[0] is None
    ref = dense_logprobs(model, prompt)
    for pos, lp in enumerate(scores[1:]):
        assert lp.token_id == prompt[pos + 1]
        np.testing.assert_allclose(lp.logprob, ref[pos, prompt[pos + 1]], atol=1e-4, err_msg=f"position {pos}")
        assert len(lp.top) == k
        top_ids = [i for i, _ in lp.top]
        np.testing.assert_allclose([v for _, v in lp.top], ref[pos, top_ids], atol=1e-4)
        # best first, and none better left out (ties within rounding may swap)
        assert all(a >= b for (_, a), (_, b) in zip(lp.top, lp.top[1:]))
        if k:
            assert np.sort(ref[pos])[-k] <= lp.top[-1][1] + 1e-4


def test_prompt_scores_equal_the_dense_reference_across_chunks_cache_hits_and_preemption(tiny_engine, tiny_model):
    """Prompts longer than a step's budget (several chunks, each a step with other requests' decodes and
    chunks), some sharing a prefix that plain requests put in the prefix cache first, under a page budget that
    preempts: every scored prompt token's log-probability and top 3 equal the dense reference's, and every
    request's greedy output equals the one it gets alone."""
    cfg, model = tiny_model
    rnd = random.Random(3)
    engine = _SmallBudget(tiny_engine, num_pages=17)  # 16 usable pages of 8 tokens for 4 slots
    scheduler = Scheduler(engine, OutputProcessor(_Detok()), SchedulerConfig(max_queue=64, max_num_batched_tokens=24))
    scheduler.start()
    shared = [rnd.randrange(3, 256) for _ in range(24)]
    try:
        warm = [Request(shared + [5, 6], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))]
        for stream in [scheduler.submit(r) for r in warm]:
            assert stream.result(timeout=300).error is None
        requests = []
        for i in range(12):
            prompt = (shared if i % 2 else []) + [rnd.randrange(3, 256) for _ in range(rnd.randint(1, 40))]
            scored = i % 3 != 2
            requests.append(Request(prompt, SamplingParams(temperature=0.0, max_tokens=rnd.randint(4, 30),
                                                           ignore_eos=True, prompt_logprobs=3 if scored else None)))
        results = [s.result(timeout=300) for s in [scheduler.submit(r) for r in requests]]
        for request, result in zip(requests, results):
            assert result.error is None, result.error
            assert result.token_ids == _greedy_alone(cfg, model, request.prompt_ids, request.params.max_tokens)
            if request.params.prompt_logprobs is None:
                assert result.prompt_logprobs is None
            else:
                check_scores(model, request.prompt_ids, result.prompt_logprobs, 3)
        stats = scheduler.stats()
        assert stats.prefix_hits > 0 and stats.preemptions > 0
    finally:
        scheduler.shutdown(timeout=5)


def test_max_tokens_zero_scores_the_prompt_and_outputs_nothing(tiny_engine, tiny_model):
    cfg, model = tiny_model
    scheduler = Scheduler(tiny_engine, OutputProcessor(_Detok()), SchedulerConfig(max_num_batched_tokens=24))
    scheduler.start()
    try:
        prompt = list(range(40, 90))
        # (at most one alternative: the scoring program's best-only branch)
        both = [scheduler.submit(Request(prompt, SamplingParams(max_tokens=0, prompt_logprobs=1))),
                scheduler.submit(Request([7], SamplingParams(max_tokens=0, prompt_logprobs=2)))]
        scored, single = [s.result(timeout=120) for s in both]
        assert scored.finish_reason is FinishReason.LENGTH and scored.token_ids == [] and scored.text == ""
        check_scores(model, prompt, scored.prompt_logprobs, 1)
        assert single.token_ids == [] and single.prompt_logprobs == (None,)  # nothing before its one token
    finally:
        scheduler.shutdown(timeout=5)


@pytest.mark.parametrize("budget", [4, 8, 64])
def test_mock_scores_cover_each_prompt_position_once_whatever_the_chunks(budget):
    """Chunks of every size, pages scarce enough to preempt mid-prompt, siblings sharing cached prefixes: each
    scoring request gets one score per prompt token after the first (the mock engine checks every target is
    the token after its position), and its output is unchanged."""
    rng = random.Random(budget)
    engine = MockEngine(max_slots=4, page_size=4, num_pages=12, max_num_batched_tokens=budget)
    with running(engine, enable_prefix_cache=True) as sched:
        prefix = ascii_prompt(rng, 12)
        requests = [req(prefix + ascii_prompt(rng, rng.randint(1, 9)), rng.randint(1, 10),
                        prompt_logprobs=rng.choice([None, 0, 2])) for _ in range(10)]
        streams = [sched.submit(r) for r in requests]
        for r, s in zip(requests, streams):
            done = s.result(timeout=WAIT)
            assert done.error is None and done.token_ids == chain(r.prompt_ids, r.params.max_tokens)
            k = r.params.prompt_logprobs
            if k is None:
                assert done.prompt_logprobs is None
                continue
            prompt = r.prompt_ids
            assert done.prompt_logprobs[0] is None and len(done.prompt_logprobs) == len(prompt)
            for x, t, lp in zip(prompt, prompt[1:], done.prompt_logprobs[1:]):
                assert lp.token_id == t and lp.logprob == -float((t - x - 1) % 256)
                assert [i for i, _ in lp.top] == [(x + 1 + i) % 256 for i in range(k)]
        assert sched.stats().preemptions > 0
    assert any(len(step) > 1 for step in engine.steps)  # scoring chunks shared steps with others


def test_streamed_prompt_scores_come_with_the_first_delta():
    """A streaming consumer gets the prompt's scores once, on its first Delta, even when the chunk that
    completes them is not the one that samples."""
    import asyncio

    engine = MockEngine(max_slots=2, page_size=4, num_pages=32, max_num_batched_tokens=4)
    with running(engine, enable_prefix_cache=False) as sched:
        prompt = list(range(50, 59))  # 9 tokens: chunks 4 + 4 + 1, the 8 scores complete before the sample

        async def deltas():
            return [d async for d in sched.submit(req(prompt, 3, prompt_logprobs=1))]

        got = asyncio.run(deltas())
    firsts = [d.prompt_logprobs for d in got]
    assert firsts[0] is not None and all(p is None for p in firsts[1:])
    assert [lp.token_id for lp in firsts[0][1:]] == prompt[1:]
    assert [t for d in got for t in d.token_ids] == chain(prompt, 3)


def test_extended_programs_compiled_in_the_background_leave_scoring_and_pooling_steps_nothing_to_compile(tiny_model):
    """As on accelerators (JaxEngine starts compile_extended() once it is up, and scoring and pooling steps run at
    least extended_min_tokens rows, 128 there): a step that scores before the thread reached its bucket compiles
    that program itself (the thread's queued one is dropped); once the thread is done, steps that score or pool
    compile nothing, and no program of a bucket under the minimum exists; every step's scores equal the dense
    reference's."""
    from slipstream.engine.api import SlotState, StepBatch, StepSeq
    from slipstream.engine.device.runner import EngineConfig, JaxEngine
    from tests.conftest import TINY_ENGINE

    cfg, model = tiny_model
    engine = JaxEngine(cfg, model, EngineConfig(**TINY_ENGINE), precompile=False)

    def score(n: int) -> None:
        prompt = list(range(30, 30 + n))
        engine.insert(0, SlotState(prompt, [], SamplingParams(max_tokens=1, prompt_logprobs=2)))
        step = engine.launch(StepBatch([StepSeq(0, prompt, 0, [1, 2, 3], False, targets=prompt[1:])]))
        step.result()
        (scores,) = step.scores()
        engine.free(0)
        check_scores(model, prompt, (None, *scores), 2)

    def pool(n: int) -> None:
        prompt = list(range(30, 30 + n))
        engine.insert(0, SlotState(prompt, [], SamplingParams(max_tokens=0, pooling="last")))
        step = engine.launch(StepBatch([StepSeq(0, prompt, 0, [1, 2, 3], False, pool=1)]))
        step.result()
        (pooled,) = step.pooled()
        engine.free(0)
        assert pooled.shape == (cfg.hidden_size,) and np.isfinite(pooled).all()

    engine.extended_min_tokens = 8
    assert engine.extended_buckets == (8, 16, 32)
    engine.compile_extended()  # largest first: bucket 8 is queued behind 32 and 16
    score(3)
    engine.wait_extended(timeout=300)
    compiles = engine.compile_count
    for n in (3, 20, 9):  # buckets 4 (run at 8), 32, 16
        score(n)
        pool(n)
    assert engine.compile_count == compiles
    assert sorted(engine._extended_exe) == [(t, score, not score, False) for t in (8, 16, 32) for score in (False, True)]


def test_a_process_exits_without_running_the_rest_of_the_compile_queue():
    """The background compiles (engine/device/programs.CompileQueue): a process that ends while they are queued (a
    drained server) stops after the one in progress instead of running the whole ladder (minutes on an
    accelerator), and exits cleanly."""
    import subprocess
    import sys

    script = """
import sys, time
from slipstream.engine.device.programs import CompileQueue
def job(i):
    print("ran", i, file=sys.stderr, flush=True)
    time.sleep(0.5)
queue = CompileQueue()
futures = [queue.submit(job, i) for i in range(10)]
time.sleep(0.1)  # the first is running
print("queued", len(futures), flush=True)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["queued", "10"]
    assert out.stderr.count("ran ") == 1, out.stderr  # the one in progress finished; the other nine were dropped
