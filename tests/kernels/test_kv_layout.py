"""slipstream.kernels.attention.kv_layout: the KV layout and default page size per backend, and the merged TPU
layout's round trip (the engine allocates the cache through it)."""
from __future__ import annotations

import jax.numpy as jnp
import pytest
import numpy as np

from slipstream.kernels.attention import kv_layout
from slipstream.engine.device.attention_layer import cache_head_axis, cache_kv_heads
from slipstream.kernels.tpu import layout


def test_cpu_keeps_the_standard_layout_and_16_token_pages():
    lay = kv_layout("cpu")
    assert (lay.name, lay.page_size) == ("standard", 16)
    shapes = lay.shapes(3, 2, 10, 16, 64, jnp.int8)
    assert shapes["k"].shape == shapes["v"].shape == (3, 2, 10, 16, 64)
    assert shapes["k_scale"].shape == (3, 2, 10, 16) and shapes["k_scale"].dtype == jnp.float32


def test_tpu_keeps_a_token_in_one_row_with_128_token_pages():
    lay = kv_layout("tpu")
    assert (lay.name, lay.page_size) == ("merged", 128)
    cache = lay.init(3, 2, 10, 128, 64, jnp.bfloat16)
    assert set(cache) == {"kv"} and cache["kv"].shape == (3, 10, 128, 2 * 2 * 64)   # a row per token: all heads' K, V
    assert cache["kv"].dtype == jnp.bfloat16 and cache_head_axis(cache) == 3 and cache_kv_heads(cache, 64) == 2
    # int8 keeps a row per token and head (XLA copies an int8 cache scattered in wider rows)
    int8 = lay.shapes(3, 2, 10, 128, 64, jnp.int8)
    assert int8["kv"].shape == (3, 10, 2, 128, 128) and int8["kv"].dtype == jnp.int8
    assert int8["kv_scale"].shape == (3, 10, 2, 2, 128)
    assert lay.shapes(3, 2, 10, 128, 128, jnp.int8)["kv"].shape == (3, 10, 2, 2, 128, 128)
    assert cache_head_axis(int8) == 2 and cache_kv_heads(int8, 64) == 2


def _head(kv, layer, page, head, j, hd, paired=False):
    """Head `head`'s K (j=0) or V (j=1) rows [ps, hd] of (layer, page) in token rows: lanes (2 * head + j) * hd...,
    or with heads of 64 in pairs, [K_0 | K_1 | V_0 | V_1 | ...]."""
    at = ((head // 2) * 4 + 2 * j + head % 2) * hd if paired else (2 * head + j) * hd
    return np.asarray(kv)[layer, page, :, at:at + hd]


@pytest.mark.parametrize("hd,kvh", [(8, 3), (64, 3), (64, 4), (128, 3)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int8])
def test_merged_layout_round_trip_and_page_contiguity(hd, kvh, dtype):
    rng = np.random.default_rng(0)
    std = {"k": jnp.asarray(rng.integers(-100, 100, (2, kvh, 5, 4, hd)), dtype),
           "v": jnp.asarray(rng.integers(-100, 100, (2, kvh, 5, 4, hd)), dtype),
           "k_scale": jnp.asarray(rng.random((2, kvh, 5, 4)), jnp.float32),
           "v_scale": jnp.asarray(rng.random((2, kvh, 5, 4)), jnp.float32)}
    merged = layout.from_standard(std)
    kv = np.asarray(merged["kv"])
    lanes = hd <= 64
    if dtype == jnp.int8:   # a row per token and head: [K | V] lanes (hd <= 64) or K and V rows apart (hd 128)
        assert layout.form(merged) == ("lanes" if lanes else "split")
        assert kv.shape == ((2, 5, kvh, 4, 2 * hd) if lanes else (2, 5, kvh, 2, 4, hd))
        k_rows = kv[1, 4, 2, :, :hd] if lanes else kv[1, 4, 2, 0]
        v_rows = kv[1, 4, 2, :, hd:] if lanes else kv[1, 4, 2, 1]
    else:                   # layer 1, page 4: all heads' K and V in one block, a row per token
        assert layout.form(merged) == "tokens" and kv.shape == (2, 5, 4, kvh * 2 * hd)
        paired = layout.pairs_heads(hd, kvh)
        assert paired == (hd == 64 and kvh == 4)
        k_rows, v_rows = _head(kv, 1, 4, 2, 0, hd, paired), _head(kv, 1, 4, 2, 1, hd, paired)
    np.testing.assert_array_equal(k_rows, std["k"][1, 2, 4])
    np.testing.assert_array_equal(v_rows, std["v"][1, 2, 4])
    np.testing.assert_array_equal(merged["kv_scale"][1, 4, 2, 1], std["v_scale"][1, 2, 4])
    back = layout.to_standard(merged, hd)
    for name in std:
        np.testing.assert_array_equal(back[name], std[name])


@pytest.mark.parametrize("hd", [16, 64, 128])
def test_write_kv_places_rows_and_drops_pages_past_the_cache(hd):
    """The flat-row scatter: each token's K and V (all heads) land at (layer, page, offset); a page index past
    the cache (padding tokens) writes nothing, not even into the next layer's first page."""
    from slipstream.kernels.ragged_tokens import quantize_kv
    rng = np.random.default_rng(1)
    for dtype in (jnp.float32, jnp.int8):
        cache = {k: jnp.asarray(rng.standard_normal(s.shape), s.dtype) if s.dtype != jnp.int8 else
                 jnp.asarray(rng.integers(-5, 5, s.shape), jnp.int8)
                 for k, s in layout.shapes(3, 2, 4, 8, hd, dtype).items()}
        k_new = jnp.asarray(rng.standard_normal((3, 2, hd)), jnp.float32)
        v_new = jnp.asarray(rng.standard_normal((3, 2, hd)), jnp.float32)
        page, offset = jnp.asarray([2, 4, 3]), jnp.asarray([5, 0, 7])     # token 1: page 4 == num_pages
        out = layout.write_kv(cache, jnp.int32(1), k_new, v_new, page, offset, quantize_kv)
        std = layout.to_standard(cache, hd)
        expect = {k: np.array(v) for k, v in std.items()}
        for t in (0, 2):
            for j, (name, x) in enumerate((("k", k_new), ("v", v_new))):
                p, o = int(page[t]), int(offset[t])
                if dtype == jnp.int8:
                    q, sc = quantize_kv(x[t])
                    expect[name][1, :, p, o] = np.asarray(q)
                    expect[name + "_scale"][1, :, p, o] = np.asarray(sc)
                else:
                    expect[name][1, :, p, o] = np.asarray(x[t])
        got = layout.to_standard(out, hd)
        for k in expect:
            np.testing.assert_array_equal(np.asarray(got[k]), expect[k], err_msg=f"{dtype.__name__} hd {hd} {k}")
