"""Requests with images through the scheduler and the real engine (a tiny random LLaVA): greedy outputs equal
transformers' generate, also when the pages run short and sequences are preempted and recomputed; the prefix cache
keys pages on the image, so another image reuses none of them and the same image reuses them (its tower not run
again)."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from slipstream.engine.request import FinishReason, ImageInput, Request, SamplingParams
from slipstream.engine.scheduler import OutputProcessor, Scheduler, SchedulerConfig
from tests.engine.test_scheduler_real import _Detok, _SmallBudget
from tests.models.llava_helpers import IMAGE_ROWS, build_tiny_llava, hf_greedy, hf_model, prompt_with_image

PAGE = 8


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    from slipstream.engine.device.runner import EngineConfig, JaxEngine
    from slipstream.models.loader import load_hf_dir

    path = build_tiny_llava(str(tmp_path_factory.mktemp("llava")))
    cfg, model = load_hf_dir(path)
    engine = JaxEngine(cfg, model, EngineConfig(max_slots=4, page_size=PAGE, max_seq_len=64, num_pages=40,
                                                max_num_batched_tokens=16, quantize="none"))
    return path, engine


def _pixels(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((3, 32, 32)).astype(np.float32)


def _request(ids: list[int], offset: int, pixels: np.ndarray, max_tokens: int) -> Request:
    image = ImageInput(pixels, offset, IMAGE_ROWS, hashlib.blake2b(pixels.tobytes()).digest())
    return Request(list(ids), SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                   images=(image,))


def _run(engine, requests, **config):
    scheduler = Scheduler(engine, OutputProcessor(_Detok()), SchedulerConfig(arrival_wait_ms=0, **config))
    scheduler.start()
    try:
        streams = [scheduler.submit(r) for r in requests]
        results = [s.result(timeout=120) for s in streams]
        return results, [s.cached_tokens for s in streams], scheduler.stats()
    finally:
        scheduler.shutdown(timeout=10)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_greedy_outputs_equal_transformers_and_survive_preemption(llava, prefix_cache):
    path, engine = llava
    hf = hf_model(path)
    prompts = [prompt_with_image([2, 3, 17], [40, 99, 7, 8, 9, 4]), prompt_with_image([2, 3], [50, 51, 4]),
               prompt_with_image([2, 3, 17], [40, 99, 7, 8, 9, 4]), prompt_with_image([2, 3, 5, 6, 7], [4])]
    seeds = [1, 2, 2, 3]  # the first and third: the same text, other images
    want = [hf_greedy(hf, ids, _pixels(s)[None], 20) for (ids, _), s in zip(prompts, seeds)]
    assert want[0] != want[2]  # the image decides the reply
    requests = [_request(ids, offset, _pixels(s), 20) for (ids, offset), s in zip(prompts, seeds)]
    # 10 usable pages for 4 sequences of up to 45 tokens (6 pages each): some are preempted and recomputed
    results, _, stats = _run(_SmallBudget(engine, num_pages=11), requests, enable_prefix_cache=prefix_cache)
    for res, tokens in zip(results, want):
        assert res.error is None and res.finish_reason == FinishReason.LENGTH
        assert res.token_ids == tokens
    assert stats.preemptions > 0


def test_prefix_cache_reuses_pages_of_the_same_image_only(llava):
    """25 prompt tokens, the image at positions 3..18: its three full pages all hold image rows."""
    path, engine = llava
    ids, offset = prompt_with_image([2, 3, 17], [40, 99, 7, 8, 9, 4])
    scheduler = Scheduler(engine, OutputProcessor(_Detok()), SchedulerConfig(arrival_wait_ms=0))
    scheduler.start()
    try:
        def run(seed):
            stream = scheduler.submit(_request(ids, offset, _pixels(seed), 4))
            return stream.result(timeout=120).token_ids, stream.cached_tokens

        encoded = engine.images.encoded
        first, cached = run(1)
        assert cached == 0 and engine.images.encoded == encoded + 1
        compiles = engine.compile_count  # the image programs of the steps' buckets compiled by now
        other, cached = run(2)  # the same text, another image: no page of it is reused
        assert cached == 0 and engine.images.encoded == encoded + 2
        assert engine.compile_count == compiles
        again, cached = run(1)  # the first image again: its three pages are, and its tower does not run
        assert cached == 3 * PAGE and engine.images.encoded == encoded + 2
        assert again == first and other != first
    finally:
        scheduler.shutdown(timeout=10)
