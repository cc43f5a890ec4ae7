"""Embeddings (SamplingParams.pooling): a prompt run with no output whose last hidden states are pooled, the mean of
its tokens' or its last token's, across chunked prefills, prefix-cache hits and preemption. The mock engine's
hidden state of a row is (token, position, 1); the real engine's equals transformers' last_hidden_state."""
from __future__ import annotations

import random

import numpy as np
import pytest

from slipstream.engine.errors import InvalidParam
from slipstream.engine.mock_engine import MockEngine
from slipstream.engine.request import FinishReason, Request, SamplingParams
from slipstream.engine.scheduler import OutputProcessor, Scheduler, SchedulerConfig
from tests.engine.test_scheduler_real import _Detok, _greedy_alone, _SmallBudget


def embed(pooling: str) -> SamplingParams:
    return SamplingParams(max_tokens=0, temperature=0.0, pooling=pooling)


def mock_embedding(prompt: list[int], pooling: str) -> np.ndarray:
    rows = np.array([[t, p, 1.0] for p, t in enumerate(prompt)])
    return rows.mean(axis=0) if pooling == "mean" else rows[-1]


def mixed(prompts: list[list[int]], max_tokens) -> list[Request]:
    """A generation request (greedy, max_tokens() tokens), a mean and a last-token embedding in turn."""
    return [Request(prompt, SamplingParams(max_tokens=max_tokens(), temperature=0.0, ignore_eos=True) if i % 3 == 0
                    else embed("mean" if i % 3 == 1 else "last")) for i, prompt in enumerate(prompts)]


def test_pooling_needs_max_tokens_zero_and_a_known_mode():
    with pytest.raises(InvalidParam) as err:
        SamplingParams(max_tokens=5, pooling="mean")
    assert err.value.field == "max_tokens"
    with pytest.raises(InvalidParam) as err:
        SamplingParams(max_tokens=0, pooling="cls")
    assert err.value.field == "pooling"


def test_mock_embeddings_across_chunks_with_generation_beside_them():
    """Prompts of several step budgets, mean and last, beside generation requests in the same steps: each
    embedding is the hand-computed one, each generation is unchanged, and an embedding request outputs nothing."""
    engine = MockEngine(max_slots=4, page_size=4, num_pages=64, max_seq_len=128, max_num_batched_tokens=8)
    scheduler = Scheduler(engine, OutputProcessor(_Detok()), SchedulerConfig(max_queue=64))
    scheduler.start()
    rnd = random.Random(5)
    try:
        requests = mixed([[rnd.randrange(0, 200) for _ in range(rnd.randint(1, 30))] for _ in range(12)],
                         lambda: 6)
        results = [s.result(timeout=30) for s in [scheduler.submit(r) for r in requests]]
        for request, result in zip(requests, results):
            assert result.error is None, result.error
            if request.params.pooling is None:
                assert result.embedding is None
                assert result.token_ids == [(request.prompt_ids[-1] + 1 + i) % 256 for i in range(6)]
            else:
                assert result.token_ids == [] and result.finish_reason is FinishReason.LENGTH
                np.testing.assert_allclose(result.embedding, mock_embedding(request.prompt_ids,
                                                                            request.params.pooling), rtol=1e-6)
    finally:
        scheduler.shutdown(timeout=5)


def test_mock_last_token_pooling_uses_the_prefix_cache_and_a_mean_computes_the_whole_prompt():
    engine = MockEngine(max_slots=2, page_size=4, num_pages=64, max_seq_len=128, max_num_batched_tokens=64)
    scheduler = Scheduler(engine, OutputProcessor(_Detok()), SchedulerConfig(max_queue=8))
    scheduler.start()
    prompt = list(range(10, 31))  # 21 tokens: 5 full pages
    try:
        first = scheduler.submit(Request(prompt, embed("last"))).result(timeout=30)
        steps = len(engine.steps)
        again = scheduler.submit(Request(prompt, embed("last"))).result(timeout=30)
        (hit,) = [seq for step in engine.steps[steps:] for seq in step]
        assert hit[1] == 20 and hit[2] == 1  # only the last token computed: the rest from the prefix cache
        np.testing.assert_array_equal(again.embedding, first.embedding)
        steps = len(engine.steps)
        mean = scheduler.submit(Request(prompt, embed("mean"))).result(timeout=30)
        assert [seq[1:3] for step in engine.steps[steps:] for seq in step] == [(0, 21)]  # whole, no cache hit
        np.testing.assert_allclose(mean.embedding, mock_embedding(prompt, "mean"), rtol=1e-6)
        assert scheduler.stats().prefix_hits > 0
    finally:
        scheduler.shutdown(timeout=5)


def _hf_hidden(hf_model, prompt: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf_model(torch.tensor([prompt])).last_hidden_state[0].float().numpy()


def test_embeddings_equal_transformers_across_chunks_cache_hits_and_preemption(tiny_engine, tiny_model,
                                                                                tiny_llama_dir):
    """The real engine, prompts of several chunks sharing a prefix that plain requests put in the prefix cache
    first, under a page budget that preempts, generation requests beside them: each mean and last-token
    embedding equals transformers' last_hidden_state pooled the same way, and each generation equals its greedy
    output alone."""
    transformers = pytest.importorskip("transformers")
    hf_model = transformers.AutoModel.from_pretrained(tiny_llama_dir, torch_dtype="float32").eval()
    cfg, model = tiny_model
    rnd = random.Random(11)
    engine = _SmallBudget(tiny_engine, num_pages=14)  # 13 usable pages of 8 tokens for 4 slots
    scheduler = Scheduler(engine, OutputProcessor(_Detok()), SchedulerConfig(max_queue=64, max_num_batched_tokens=24))
    scheduler.start()
    shared = [rnd.randrange(3, 256) for _ in range(24)]
    try:
        warm = scheduler.submit(Request(shared + [5, 6], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)))
        assert warm.result(timeout=300).error is None
        prompts = [(shared if i % 2 else []) + [rnd.randrange(3, 256) for _ in range(rnd.randint(1, 40))]
                   for i in range(12)]
        requests = mixed(prompts, lambda: rnd.randint(20, 40))
        results = [s.result(timeout=300) for s in [scheduler.submit(r) for r in requests]]
        for request, result in zip(requests, results):
            assert result.error is None, result.error
            if request.params.pooling is None:
                assert result.token_ids == _greedy_alone(cfg, model, request.prompt_ids, request.params.max_tokens)
                continue
            hidden = _hf_hidden(hf_model, request.prompt_ids)
            want = hidden.mean(axis=0) if request.params.pooling == "mean" else hidden[-1]
            assert result.embedding.shape == (cfg.hidden_size,)
            np.testing.assert_allclose(result.embedding, want, atol=2e-4, rtol=1e-4)
        stats = scheduler.stats()
        assert stats.prefix_hits > 0 and stats.preemptions > 0
    finally:
        scheduler.shutdown(timeout=5)
