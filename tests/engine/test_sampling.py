"""Batched sampler: filters never leak, seeds reproduce per request, penalties match HF/OpenAI."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from slipstream.engine.request import MAX_TOP_LOGPROBS, SamplingParams
from slipstream.engine.device.sampling import SamplingArrays, apply_penalties, prompt_mask_row, sample, update_counts
from tests.engine.sampling_helpers import SAMPLE, B, V, run


def probs(logits, temperature=1.0):
    z = np.asarray(logits, np.float64) / temperature
    p = np.exp(z - z.max())
    return p / p.sum()


def top_p_set(p, top_p):
    order = np.argsort(-p)
    before = np.cumsum(p[order]) - p[order]  # mass strictly before each token
    return set(order[before < top_p].tolist())


def many_draws(row_logits, params, n=2048, seed=7):
    """n draws from one distribution: same seed, steps 0..n-1, B rows per call."""
    calls = [run(np.tile(row_logits, (B, 1)), [params] * B, [seed] * B,
                 list(range(start, start + B))) for start in range(0, n, B)]
    return np.concatenate([c.token for c in calls])


def test_top_k_only_samples_the_k_best():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=64) * 2
    tokens = many_draws(logits, SamplingParams(temperature=1.5, top_k=5))
    allowed = set(np.argsort(-logits)[:5].tolist())
    assert set(tokens.tolist()) == allowed  # never outside, and it really samples all five


def test_top_p_only_samples_the_nucleus():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=64) * 2
    tokens = many_draws(logits, SamplingParams(temperature=0.8, top_p=0.7))
    allowed = top_p_set(probs(logits, 0.8), 0.7)
    assert set(tokens.tolist()) <= allowed
    assert len(set(tokens.tolist())) > 1


def test_min_p_drops_tokens_below_fraction_of_the_best():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=64) * 2
    tokens = many_draws(logits, SamplingParams(temperature=1.0, min_p=0.2))
    p = probs(logits)
    allowed = set(np.flatnonzero(p >= 0.2 * p.max()).tolist())
    assert set(tokens.tolist()) <= allowed
    assert len(set(tokens.tolist())) > 1


def test_top_p_renormalises_over_top_k():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=64) * 2
    tokens = many_draws(logits, SamplingParams(temperature=1.0, top_k=8, top_p=0.6))
    order = np.argsort(-logits)[:8]
    masked = np.full(64, -np.inf)
    masked[order] = logits[order]
    allowed = top_p_set(probs(masked), 0.6)
    assert set(tokens.tolist()) <= allowed
    assert len(allowed) < 8  # the renormalised nucleus is a strict subset of top-k here


def test_large_top_k_and_top_p_past_the_candidate_window_stay_exact():
    rng = np.random.default_rng(4)
    # A flat distribution over 300 tokens: the nucleus is far larger than the 128 candidates
    # the fast path looks at, so this goes through the full-vocab bisection.
    logits = rng.normal(size=300) * 0.3
    tokens = many_draws(logits, SamplingParams(temperature=1.0, top_k=200, top_p=0.9))
    order = np.argsort(-logits)
    masked = np.full(300, -np.inf)
    masked[order[:200]] = logits[order[:200]]
    allowed = top_p_set(probs(masked), 0.9)
    assert set(tokens.tolist()) <= allowed
    rank = {int(t): r for r, t in enumerate(order)}
    assert max(rank[int(t)] for t in tokens) >= 128


def test_temperature_zero_is_argmax_of_the_logits():
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(13, 100)) * 3
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5, seed=i) for i in range(10)]
    params += [None] * 3  # empty slots sample greedily too
    out = run(logits, params, seeds=list(range(13)), steps=list(range(13)))
    np.testing.assert_array_equal(out.token, np.argmax(logits, -1))


@pytest.mark.parametrize("vocab", [1024, 3000, 49152])
def test_greedy_takes_the_first_of_tied_maxima_at_large_vocab_sizes(vocab):
    # vocabularies past one block of the two-level argmax, a size that does not fill its last
    # block, and maxima tied across blocks and inside one: the first index wins, as np.argmax
    rng = np.random.default_rng(vocab)
    logits = rng.normal(size=(6, vocab)).astype(np.float32)
    logits[1, [vocab - 1]] = 9.0                      # in the padded last block
    logits[2, [5, vocab - 2]] = 9.0                   # tied across blocks
    logits[3, [vocab // 2, vocab // 2 + 1]] = 9.0     # tied inside one block
    logits[4] = -np.inf                               # nothing allowed: token 0, as np.argmax
    logits[5, :] = 1.0                                # all equal
    arrays = SamplingArrays.from_params([SamplingParams(temperature=0.0)] * 6, [0] * 6, [0] * 6, 6)
    out = SAMPLE(jnp.asarray(logits), arrays, jnp.zeros((6, vocab), jnp.int32), jnp.zeros((6, vocab), bool))
    np.testing.assert_array_equal(np.asarray(out.token), np.argmax(logits, -1))


def test_greedy_with_penalties_takes_argmax_of_penalized_logits():
    rng = np.random.default_rng(6)
    logits = rng.normal(size=(4, 100)) * 3
    counts = rng.integers(0, 3, size=(4, 100)).astype(np.int32)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.7)] * 4
    out = run(logits, params, counts=counts)
    arrays = SamplingArrays.from_params(params, [0] * 4, [0] * 4, 4)
    expected = apply_penalties(jnp.asarray(logits, jnp.float32), arrays, jnp.asarray(counts),
                               jnp.zeros((4, 100), bool))
    np.testing.assert_array_equal(out.token, np.argmax(np.asarray(expected), -1))
    assert not np.array_equal(out.token, np.argmax(logits, -1))


def test_same_seed_and_step_give_same_token_in_any_row_and_any_company():
    rng = np.random.default_rng(7)
    vocab, n = 300, 8
    req_logits = rng.normal(size=(n, vocab)) * 0.5
    req_params = [SamplingParams(temperature=1.0, top_k=[0, 5, 40][i % 3], top_p=[1.0, 0.9][i % 2],
                                 seed=i) for i in range(n)]
    req_seeds, req_steps = [11 * i + 2**40 for i in range(n)], [3 * i for i in range(n)]

    def company(kind):
        # Other rows: greedy in one batch; large top-k/top-p (the bisection branches) in the other.
        params = ([SamplingParams(temperature=0.0)] * n if kind == 0 else
                  [SamplingParams(temperature=0.7, top_k=250, top_p=0.95, min_p=0.01)] * n)
        return rng.normal(size=(n, vocab)) * 0.5, params, list(range(n)), list(range(n))

    lg, pa, se, st = company(0)
    first = run(np.concatenate([req_logits, lg]), req_params + pa, req_seeds + se, req_steps + st)
    lg, pa, se, st = company(1)
    rev = slice(None, None, -1)  # the requests now sit in rows 15..8, in reverse order
    second = run(np.concatenate([lg, req_logits[rev]]), pa + req_params[rev],
                 se + req_seeds[rev], st + req_steps[rev])
    np.testing.assert_array_equal(first.token[:n], second.token[n:][rev])


def test_different_seeds_and_steps_draw_different_tokens():
    logits = np.zeros((64, 64))  # uniform: any two keys agreeing often would be a bug
    params = [SamplingParams(temperature=1.0)] * 64
    by_seed = run(logits, params, seeds=list(range(64))).token
    by_step = run(logits, params, seeds=[5] * 64, steps=list(range(64))).token
    assert len(set(by_seed.tolist())) > 25
    assert len(set(by_step.tolist())) > 25
    # The seed's high word counts too: 2**32 + s is not s.
    high = run(logits, params, seeds=[2**32 + s for s in range(64)]).token
    assert np.mean(high != by_seed) > 0.8


def test_empirical_frequencies_match_softmax():
    logits = np.array([0.0, 1.0, 2.0, -1.0])
    for temperature in (1.0, 0.5):
        tokens = many_draws(logits, SamplingParams(temperature=temperature), seed=3)
        n = len(tokens)
        freq = np.bincount(tokens, minlength=4) / n
        expected = probs(logits, temperature)
        tolerance = 4 * np.sqrt(expected * (1 - expected) / n)  # 4 sigma per token
        assert np.all(np.abs(freq - expected) <= tolerance), (temperature, freq, expected)


def test_logprobs_are_the_raw_model_distribution():
    rng = np.random.default_rng(10)
    logits = rng.normal(size=(6, 100)) * 3
    counts = rng.integers(0, 2, size=(6, 100)).astype(np.int32)
    params = [SamplingParams(temperature=t, repetition_penalty=1.5, presence_penalty=1.0,
                             logprobs=None if i == 5 else MAX_TOP_LOGPROBS)
              for i, t in enumerate((0.0, 0.5, 1.0, 1.0, 2.0, 0.0))]
    out = run(logits, params, seeds=list(range(6)), counts=counts)
    log_softmax = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(out.logprob, log_softmax[np.arange(6), out.token],
                               rtol=1e-5, atol=1e-5)
    top = np.argsort(-log_softmax, -1)[:, :MAX_TOP_LOGPROBS]
    np.testing.assert_array_equal(out.top_ids, top)
    np.testing.assert_allclose(out.top_logprobs,
                               np.take_along_axis(log_softmax, top, -1), rtol=1e-5, atol=1e-5)


def test_presence_and_frequency_penalties_follow_openai_formula():
    rng = np.random.default_rng(11)
    logits = rng.normal(size=(5, 50)).astype(np.float32) * 3
    counts = rng.integers(0, 4, size=(5, 50)).astype(np.int32)
    presence = np.array([0.0, 0.5, -1.0, 2.0, 1.5], np.float32)
    frequency = np.array([0.0, 0.3, 0.0, -2.0, 1.0], np.float32)
    params = [SamplingParams(presence_penalty=float(p), frequency_penalty=float(f))
              for p, f in zip(presence, frequency)]
    arrays = SamplingArrays.from_params(params, [0] * 5, [0] * 5, 5)
    got = apply_penalties(jnp.asarray(logits), arrays, jnp.asarray(counts),
                          jnp.asarray(rng.random((5, 50)) < 0.5))  # the prompt must not matter
    expected = logits - presence[:, None] * (counts > 0) - frequency[:, None] * counts
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got)[0], logits[0])


def test_repetition_penalty_matches_transformers():
    rng = np.random.default_rng(12)
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    vocab, batch = 60, 4
    logits = (rng.normal(size=(batch, vocab)) * 3).astype(np.float32)
    penalties = [1.0, 1.2, 0.8, 2.0]
    prompts = [rng.integers(0, vocab, size=12) for _ in range(batch)]
    outputs = [rng.integers(0, vocab, size=5) for _ in range(batch)]
    counts = np.zeros((batch, vocab), np.int32)
    for row, out in enumerate(outputs):
        np.add.at(counts[row], out, 1)
    prompt_mask = np.stack([prompt_mask_row(p, vocab) for p in prompts])
    params = [SamplingParams(repetition_penalty=p) for p in penalties]
    arrays = SamplingArrays.from_params(params, [0] * batch, [0] * batch, batch)
    got = np.asarray(apply_penalties(jnp.asarray(logits), arrays, jnp.asarray(counts),
                                     jnp.asarray(prompt_mask)))
    for row in range(batch):
        ids = torch.tensor(np.concatenate([prompts[row], outputs[row]])[None])
        processor = RepetitionPenaltyLogitsProcessor(penalties[row])
        hf = processor(ids, torch.tensor(logits[row:row + 1]))
        np.testing.assert_allclose(got[row], hf[0].numpy(), rtol=1e-6, atol=1e-6)
    assert not np.allclose(got[3], logits[3])


def test_update_counts_adds_only_for_active_rows():
    counts = jnp.zeros((4, 10), jnp.int32)
    counts = update_counts(counts, jnp.array([2, 0, 1]), jnp.array([4, 4, 9]), jnp.array([True, False, True]))
    counts = update_counts(counts, jnp.array([2, 0, 1]), jnp.array([4, 1, 9]), jnp.array([True, True, True]))
    expected = np.zeros((4, 10), np.int32)
    expected[2, 4], expected[0, 1], expected[1, 9] = 2, 1, 2
    np.testing.assert_array_equal(np.asarray(counts), expected)


def test_changing_settings_does_not_recompile():
    rng = np.random.default_rng(14)
    logits = rng.normal(size=(8, V)) * 0.3
    run(logits, [SamplingParams()] * 5)
    compiled = SAMPLE._cache_size()
    settings = [
        dict(temperature=0.0),
        dict(temperature=0.7, top_k=40),
        dict(temperature=1.3, top_p=0.5, min_p=0.1, repetition_penalty=1.2),
        dict(temperature=1.0, top_k=250, top_p=0.99, frequency_penalty=0.5),  # bisection branches
    ]
    for i, kwargs in enumerate(settings):
        run(logits, [SamplingParams(**kwargs)] * 5, seeds=[2**62 + i] * 5, steps=[i] * 5)
    assert SAMPLE._cache_size() == compiled


def test_prompt_mask_row_marks_prompt_tokens():
    np.testing.assert_array_equal(np.flatnonzero(prompt_mask_row([3, 1, 3], 6)), [1, 3])
    assert not prompt_mask_row([], 6).any()
    with pytest.raises(ValueError, match="\\[0, 6\\)"):
        prompt_mask_row([6], 6)


def test_full_vocab_smoke_without_a_sort():
    rng = np.random.default_rng(17)
    vocab = 49152
    logits = rng.normal(size=(4, vocab)).astype(np.float32) * 2
    params = [SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
              SamplingParams(temperature=1.0, top_p=0.9),  # nucleus past 128 tokens: bisection
              SamplingParams(temperature=1.0, min_p=0.05)]
    arrays = SamplingArrays.from_params(params, [1, 2, 3, 4], [0, 0, 0, 0], 4)
    args = (jnp.asarray(logits), arrays, jnp.zeros((4, vocab), jnp.int32),
            jnp.zeros((4, vocab), bool))
    compiled = jax.jit(sample).lower(*args).compile()
    if jax.default_backend() == "cpu":
        # A full-vocab sort costs ~300 ms per step on XLA:CPU; XLA can silently turn a top_k
        # into one, so guard the compiled program.
        assert " sort(" not in compiled.as_text()
    out = compiled(*args)
    tokens = np.asarray(out.token)
    assert tokens[0] == np.argmax(logits[0])
    assert tokens[1] in set(np.argsort(-logits[1])[:50].tolist())
    assert tokens[2] in top_p_set(probs(logits[2]), 0.9)
    p = probs(logits[3])
    assert p[tokens[3]] >= 0.05 * p.max()
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    np.testing.assert_allclose(np.asarray(out.logprob), logits[np.arange(4), tokens] - lse,
                               rtol=1e-4, atol=1e-4)


def test_tpu_program_at_a_152k_vocab_sorts_nothing():
    """Lowered for TPU (Qwen's 151936-token vocab), the sampling program (greedy + logprobs, top-k + top-p,
    top-p, min-p) asks for no sort: its cut-offs come from lax.top_k over a fixed 128 candidates (exact
    bisection past them) and the logprobs' top 20; greedy is an argmax."""
    import re

    vocab = 151936
    params = [SamplingParams(temperature=0.0, logprobs=MAX_TOP_LOGPROBS),
              SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
              SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0, min_p=0.05)]
    arrays = SamplingArrays.from_params(params, [1, 2, 3, 4], [0, 0, 0, 0], 4)
    args = (jax.ShapeDtypeStruct((4, vocab), jnp.float32), arrays, jax.ShapeDtypeStruct((4, vocab), jnp.int32),
            jax.ShapeDtypeStruct((4, vocab), bool))
    text = jax.jit(sample).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert not re.search(r"stablehlo\.sort|\bsort\(", text)
    assert sorted(int(k) for k in re.findall(r"top_k\(.*?k = (\d+)", text)) == [MAX_TOP_LOGPROBS, 128]
