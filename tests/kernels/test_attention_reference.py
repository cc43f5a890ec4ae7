"""The pure-JAX ragged paged attention equals a loop-per-sequence oracle on mixed batches."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from slipstream.kernels.attention import ragged_paged_attention_reference
from tests.kernels.attention_cases import make_case, oracle


def _run(case, **kw):
    fn = jax.jit(ragged_paged_attention_reference, static_argnames=("sm_scale", "sliding_window", "soft_cap"))
    cache = {k: jnp.asarray(v) for k, v in case.cache.items()}
    return fn(jnp.asarray(case.q), jnp.asarray(case.k_new), jnp.asarray(case.v_new), cache,
              jnp.int32(case.layer), jnp.asarray(case.kv_lens), jnp.asarray(case.page_indices),
              jnp.asarray(case.cu_q_lens), jnp.asarray(case.num_seqs), **kw)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("window", [None, 7])
def test_mixed_batch_matches_oracle(int8, window):
    rng = np.random.default_rng(0)
    # decodes first (one token each, long contexts), then prefill chunks: fresh, after cached pages
    case = make_case(rng, q_lens=[1, 1, 1, 9, 17], cached=[30, 5, 0, 0, 12], kv_heads=2, group=3,
                     head_dim=16, page_size=4, int8=int8)
    scale = 16 ** -0.5
    out, cache = _run(case, sm_scale=scale, sliding_window=window)
    want, want_cache = oracle(case, sm_scale=scale, sliding_window=window)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5 if not int8 else 1e-4, rtol=1e-4)
    assert not np.asarray(out)[sum(case.q_lens):].any(), "padding tokens must get zeros"
    for name, arr in want_cache.items():
        np.testing.assert_allclose(np.asarray(cache[name]), arr, atol=1e-6)


def test_int8_k_pages_are_word_major():
    """int8 K (head_dim % 4 == 0) is stored word-major inside each page: word w (columns 4w..4w+3) of key j
    of a page sits at bytes [(w * page_size + j) * 4, + 4) of the page; V stays in row order."""
    from slipstream.kernels.attention import k_page_from_cache, k_page_to_cache, quantize_kv, write_kv

    layers, kvh, pages, ps, hd = 2, 1, 3, 8, 12
    shape = (layers, kvh, pages, ps, hd)
    cache = {"k": jnp.zeros(shape, jnp.int8), "v": jnp.zeros(shape, jnp.int8),
             "k_scale": jnp.zeros(shape[:4]), "v_scale": jnp.zeros(shape[:4])}
    k_new = jnp.arange(1, hd + 1, dtype=jnp.float32).reshape(1, 1, hd)
    page, off = 2, 5
    out = write_kv(cache, jnp.int32(1), k_new, k_new, jnp.asarray([page * ps + off], jnp.int32))
    want = np.asarray(quantize_kv(k_new)[0]).reshape(hd)                        # 11, 21, ..., 127: all distinct
    assert len(set(want.tolist())) == hd
    k_page = np.asarray(out["k"])[1, 0, page].reshape(-1)                        # the page's bytes
    for w in range(hd // 4):
        np.testing.assert_array_equal(k_page[(w * ps + off) * 4:(w * ps + off) * 4 + 4], want[4 * w:4 * w + 4])
    assert np.count_nonzero(k_page) == hd
    np.testing.assert_array_equal(np.asarray(out["v"])[1, 0, page, off], want)       # V: row order
    np.testing.assert_array_equal(np.asarray(k_page_from_cache(out["k"]))[1, 0, page, off], want)
    rows = np.random.default_rng(0).integers(-127, 128, (3, ps, hd)).astype(np.int8)
    np.testing.assert_array_equal(k_page_from_cache(k_page_to_cache(rows)), rows)


def test_f32_k_pages_are_column_major():
    """f32 K is stored word-major too, a word being one column: column x of key j of a page sits at element
    x * page_size + j of the page, so 16 keys' column x is one vector load; V stays in row order."""
    from slipstream.kernels.attention import k_page_from_cache, k_page_to_cache, write_kv

    shape, page, off = (2, 1, 3, 8, 12), 2, 5                                 # layers, KV, pages, ps, hd
    ps, hd = shape[3], shape[4]
    k_new = jnp.arange(1, hd + 1, dtype=jnp.float32).reshape(1, 1, hd)
    want = np.arange(1, hd + 1, dtype=np.float32)
    cache = {"k": jnp.zeros(shape, jnp.float32), "v": jnp.zeros(shape, jnp.float32)}
    out = write_kv(cache, jnp.int32(1), k_new, k_new, jnp.asarray([page * ps + off], jnp.int32))
    k_page = np.asarray(out["k"])[1, 0, page].reshape(-1)
    np.testing.assert_array_equal(k_page[np.arange(hd) * ps + off], want)
    np.testing.assert_array_equal(np.asarray(k_page_from_cache(out["k"]))[1, 0, page, off], want)
    assert np.count_nonzero(k_page) == hd
    np.testing.assert_array_equal(np.asarray(out["v"])[1, 0, page, off], want)
    rows = np.random.default_rng(0).standard_normal((3, ps, hd)).astype(np.float32)
    np.testing.assert_array_equal(k_page_from_cache(k_page_to_cache(rows)), rows)


def test_bf16_k_pages_are_word_major_when_head_dim_is_even():
    """bf16 K with an even head_dim is stored word-major, a word being two columns: columns 2w, 2w+1 of key j
    of a page sit at elements (w * page_size + j) * 2 + (0, 1) of the page; an odd head_dim keeps rows in
    order, and V always does."""
    from slipstream.kernels.attention import k_page_from_cache, k_page_to_cache, k_pages_word_major, write_kv

    page, off, ps = 2, 5, 8
    for hd in (12, 5):
        shape = (2, 1, 3, ps, hd)                                              # layers, KV, pages, ps, hd
        k_new = jnp.arange(1, hd + 1, dtype=jnp.float32).reshape(1, 1, hd)   # exact in bf16
        want = np.arange(1, hd + 1, dtype=np.float32)
        cache = {"k": jnp.zeros(shape, jnp.bfloat16), "v": jnp.zeros(shape, jnp.bfloat16)}
        out = write_kv(cache, jnp.int32(1), k_new, k_new, jnp.asarray([page * ps + off], jnp.int32))
        k_page = np.asarray(out["k"].astype(jnp.float32))[1, 0, page].reshape(-1)
        assert k_pages_word_major(jnp.bfloat16, hd) == (hd % 2 == 0)
        if hd % 2 == 0:
            for w in range(hd // 2):
                at = (w * ps + off) * 2
                np.testing.assert_array_equal(k_page[at:at + 2], want[2 * w:2 * w + 2])
            np.testing.assert_array_equal(np.asarray(k_page_from_cache(out["k"]).astype(jnp.float32))[1, 0, page, off],
                                          want)
            rows = jnp.asarray(np.random.default_rng(0).standard_normal((3, ps, hd)), jnp.bfloat16)
            np.testing.assert_array_equal(np.asarray(k_page_from_cache(k_page_to_cache(rows))), np.asarray(rows))
        else:
            np.testing.assert_array_equal(k_page[off * hd:(off + 1) * hd], want)
        assert np.count_nonzero(k_page) == hd
        np.testing.assert_array_equal(np.asarray(out["v"].astype(jnp.float32))[1, 0, page, off], want)


def test_soft_cap_matches_oracle():
    """Gemma-style cap * tanh(score / cap) on the scaled scores, before masking; through the seam on CPU too
    (the native kernel has no soft-cap, so the reference runs)."""
    from slipstream.kernels.attention import ragged_paged_attention

    rng = np.random.default_rng(1)
    case = make_case(rng, q_lens=[1, 6], cached=[9, 3], kv_heads=1, group=2, head_dim=8, page_size=4)
    case.q *= 4.0                                                              # scores well past the cap
    scale, cap = 8 ** -0.5, 2.0
    want, _ = oracle(case, sm_scale=scale, soft_cap=cap)
    uncapped, _ = oracle(case, sm_scale=scale)
    assert np.abs(want - uncapped).max() > 0.05, "the cap must matter in this case"
    out, _ = _run(case, sm_scale=scale, soft_cap=cap)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=1e-4)
    seam = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=scale, soft_cap=cap))
    cache = {k: jnp.asarray(v) for k, v in case.cache.items()}
    out, _ = seam(jnp.asarray(case.q), jnp.asarray(case.k_new), jnp.asarray(case.v_new), cache, jnp.int32(case.layer),
                  jnp.asarray(case.kv_lens), jnp.asarray(case.page_indices), jnp.asarray(case.cu_q_lens),
                  jnp.asarray(case.num_seqs))
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=1e-4)
