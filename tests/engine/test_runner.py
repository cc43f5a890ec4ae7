"""The JAX engine: paged attention equals the dense reference, chunked prefill equals one-shot,
buckets never recompile, and sampling settings behave per request."""
from __future__ import annotations

import functools
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.api import DecodeRow, PrefillChunk, SlotState
from engine.request import SamplingParams
from models.llama import forward_dense, forward_paged, init_kv_cache

PS = 4  # small pages so short sequences cross many page boundaries


@functools.lru_cache(maxsize=None)
def _dense_fn(cfg):
    return jax.jit(lambda params, tokens, valid: forward_dense(params, cfg, tokens, valid))


def dense_last_logits(cfg, params, seq, width=64):
    """Reference logits of the last token, from a fixed-width padded batch (one compile)."""
    tokens = np.zeros((1, width), np.int32)
    tokens[0, :len(seq)] = seq
    valid = np.arange(width)[None] < len(seq)
    return np.asarray(_dense_fn(cfg)(params, tokens, valid))[0, len(seq) - 1]


def _slots(pages, positions):
    return np.asarray([pages[p // PS] * PS + p % PS for p in positions], np.int32)


@functools.lru_cache(maxsize=None)
def _paged_fn(cfg):
    return jax.jit(functools.partial(forward_paged, cfg=cfg, page_size=PS), donate_argnames=("cache",))


def _run_paged(cfg, params, cache, tokens, positions, slots, tables, last):
    return _paged_fn(cfg)(params, cache=cache, tokens=jnp.asarray(tokens), positions=jnp.asarray(positions),
                          write_slots=jnp.asarray(slots), block_tables=jnp.asarray(tables),
                          last_index=jnp.asarray(last))


def test_paged_decode_matches_dense_at_every_step(tiny_model):
    cfg, params = tiny_model
    rng = np.random.default_rng(1)
    lengths = [5, 13, 22]                      # cross page boundaries at different offsets
    steps, max_pages = 7, 8
    free = list(rng.permutation(np.arange(1, 40)))  # scattered, non-contiguous pages
    pages = [[int(free.pop()) for _ in range(max_pages)] for _ in lengths]
    seqs = [list(rng.integers(3, 256, n)) for n in lengths]
    cache = init_kv_cache(cfg, 40, PS, jnp.float32)
    for i, seq in enumerate(seqs):  # prefill all but the last token, one sequence at a time
        n = len(seq) - 1
        cache = _run_paged(cfg, params, cache, [seq[:n]], [list(range(n))], [_slots(pages[i], range(n))],
                           [pages[i]], [n - 1])[1]
    for _ in range(steps):
        tokens = [[s[-1]] for s in seqs]
        pos = [[len(s) - 1] for s in seqs]
        slots = [_slots(pages[i], pos[i]) for i in range(3)]
        logits, cache = _run_paged(cfg, params, cache, tokens, pos, slots, pages, [0, 0, 0])
        for i, seq in enumerate(seqs):
            ref = dense_last_logits(cfg, params, seq)
            np.testing.assert_allclose(np.asarray(logits[i]), ref, atol=1e-4, rtol=0)
            seq.append(int(ref.argmax()))


@pytest.mark.parametrize("chunk", [1, 3, 8, 17])
def test_chunked_prefill_equals_one_shot(tiny_model, chunk):
    cfg, params = tiny_model
    seq = list(np.random.default_rng(2).integers(3, 256, 30))
    pages = [7, 3, 11, 2, 9, 5, 14, 1]
    cache = init_kv_cache(cfg, 16, PS, jnp.float32)
    logits = None
    for start in range(0, len(seq), chunk):
        part = seq[start:start + chunk]
        pos = list(range(start, start + len(part)))
        logits, cache = _run_paged(cfg, params, cache, [part], [pos], [_slots(pages, pos)], [pages],
                                   [len(part) - 1])
    ref = dense_last_logits(cfg, params, seq)
    np.testing.assert_allclose(np.asarray(logits[0]), ref, atol=1e-4, rtol=0)


def _generate(engine, prompts, params_list, pages_list, new_tokens):
    """Drive the engine directly: prefill all, insert, then decode all slots together."""
    for slot, (prompt, params, pages) in enumerate(zip(prompts, params_list, pages_list)):
        for start in range(0, len(prompt) - 1, engine.max_prefill_chunk):
            part = prompt[start:min(start + engine.max_prefill_chunk, len(prompt) - 1)]
            engine.prefill(PrefillChunk(part, start, pages))
        engine.insert(slot, SlotState(prompt, [], params))
    outs = [[] for _ in prompts]
    last = [p[-1] for p in prompts]
    for step in range(new_tokens):
        rows = [DecodeRow(s, last[s], len(prompts[s]) - 1 + step, pages_list[s]) for s in range(len(prompts))]
        for s, sampled in enumerate(engine.generate(rows)):
            outs[s].append(sampled.token_id)
            last[s] = sampled.token_id
    for slot in range(len(prompts)):
        engine.free(slot)
    return outs


def _dense_greedy(cfg, params, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(dense_last_logits(cfg, params, ids).argmax()))
    return ids[len(prompt):]


def test_engine_greedy_batch_equals_reference(tiny_engine, tiny_model):
    cfg, params = tiny_model
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(3, 256, n)) for n in (3, 11, 40)]   # 40 > one prefill chunk
    pages = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [17, 18, 19, 20, 21, 22, 23, 24]]
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    outs = _generate(tiny_engine, prompts, [greedy] * 3, pages, 12)
    for prompt, out in zip(prompts, outs):
        assert out == _dense_greedy(cfg, params, prompt, 12)


def test_penalties_count_the_generated_tokens_across_steps(tiny_engine, tiny_model):
    """A greedy row with a frequency/presence penalty follows the host-side OpenAI formula over
    its own earlier tokens, step after step, whether it shares the batch with a penalty-free row
    or runs alone (batches without penalties skip the count bookkeeping)."""
    cfg, params = tiny_model
    rng = np.random.default_rng(12)
    prompt = list(rng.integers(3, 256, 7))
    penalized = SamplingParams(temperature=0.0, frequency_penalty=1.5, presence_penalty=0.5, max_tokens=10)
    ids, expected = list(prompt), []
    for _ in range(10):
        logits = dense_last_logits(cfg, params, ids).astype(np.float64)
        counts = np.bincount(expected, minlength=logits.shape[0])[:logits.shape[0]]
        ids.append(int(np.argmax(logits - 1.5 * counts - 0.5 * (counts > 0))))
        expected.append(ids[-1])
    assert expected != _dense_greedy(cfg, params, prompt, 10)  # the penalty matters here
    other = list(rng.integers(3, 256, 5))
    plain = SamplingParams(temperature=0.0, max_tokens=10)
    mixed = _generate(tiny_engine, [other, prompt], [plain, penalized], [[1, 2, 3, 4], [5, 6, 7, 8]], 10)
    assert mixed[1] == expected
    assert mixed[0] == _dense_greedy(cfg, params, other, 10)
    assert _generate(tiny_engine, [prompt], [penalized], [[9, 10, 11, 12]], 10)[0] == expected


def test_seeded_sampling_is_independent_of_batch(tiny_engine):
    rng = np.random.default_rng(4)
    prompt = list(rng.integers(3, 256, 9))
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10)
    alone = _generate(tiny_engine, [prompt], [seeded], [[1, 2, 3]], 10)[0]
    others = [list(rng.integers(3, 256, 6)) for _ in range(2)]
    mixed = _generate(tiny_engine, [others[0], prompt, others[1]],
                      [SamplingParams(temperature=0.7, seed=9), seeded, SamplingParams(temperature=0.0)],
                      [[4, 5, 6], [7, 8, 9], [10, 11, 12]], 10)[1]
    assert mixed == alone
    other_seed = _generate(tiny_engine, [prompt], [SamplingParams(temperature=1.0, top_p=0.9, seed=99)],
                           [[1, 2, 3]], 10)[0]
    assert other_seed != alone


def test_logprobs_are_returned_when_asked(tiny_engine):
    prompt = [5, 6, 7, 8]
    tiny_engine.insert(0, SlotState(prompt, [], SamplingParams(temperature=0.0, logprobs=3)))
    tiny_engine.insert(1, SlotState(prompt, [], SamplingParams(temperature=0.0)))
    tiny_engine.prefill(PrefillChunk(prompt[:-1], 0, [1]))
    a, b = tiny_engine.generate([DecodeRow(0, 8, 3, [1]), DecodeRow(1, 8, 3, [1])])
    tiny_engine.free(0)
    tiny_engine.free(1)
    assert b.logprob is None
    assert a.logprob is not None and len(a.logprob.top) == 3
    assert a.logprob.top[0][0] == a.token_id  # greedy picks the best token
    assert a.logprob.logprob == pytest.approx(a.logprob.top[0][1])
    assert a.logprob.top[0][1] >= a.logprob.top[1][1] >= a.logprob.top[2][1]


def test_no_recompiles_across_randomized_workload(tiny_engine):
    engine = tiny_engine
    rnd = random.Random(5)
    before = engine.compile_count
    max_pages = engine.max_pages_per_seq
    for step in range(120):
        occupancy = rnd.randint(1, engine.max_slots)
        rows = []
        for slot in range(occupancy):
            params = SamplingParams(temperature=rnd.choice([0.0, 0.5, 1.3]), top_k=rnd.choice([0, 5, 50]),
                                    top_p=rnd.choice([1.0, 0.8]), min_p=rnd.choice([0.0, 0.1]),
                                    presence_penalty=rnd.choice([0.0, 1.0]),
                                    repetition_penalty=rnd.choice([1.0, 1.2]), seed=rnd.randint(0, 99),
                                    logprobs=rnd.choice([None, 2]))
            engine.insert(slot, SlotState([3, 4, 5], [6] * rnd.randint(0, 3), params))
            length = rnd.randint(1, engine.max_seq_len - 1)
            pages = list(range(1, max_pages + 1))
            rows.append(DecodeRow(slot, rnd.randint(0, 255), length, pages))
        engine.generate(rows)
        if step % 10 == 0:
            n = rnd.randint(1, 32)
            start = rnd.randint(0, engine.max_seq_len - n)
            engine.prefill(PrefillChunk([7] * n, start, list(range(1, max_pages + 1))))
    for slot in range(engine.max_slots):
        engine.free(slot)
    assert engine.compile_count == before
