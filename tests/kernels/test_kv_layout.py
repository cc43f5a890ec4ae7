"""slipstream.kernels.attention.kv_layout: the KV layout and default page size per backend, and the merged TPU
layout's round trip (the engine allocates the cache through it)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from slipstream.kernels.attention import kv_layout
from slipstream.kernels.tpu import layout


def test_cpu_keeps_the_standard_layout_and_16_token_pages():
    lay = kv_layout("cpu")
    assert (lay.name, lay.page_size, lay.head_axis) == ("standard", 16, 1)
    shapes = lay.shapes(3, 2, 10, 16, 64, jnp.int8)
    assert shapes["k"].shape == shapes["v"].shape == (3, 2, 10, 16, 64)
    assert shapes["k_scale"].shape == (3, 2, 10, 16) and shapes["k_scale"].dtype == jnp.float32


def test_tpu_merges_k_and_v_per_page_with_128_token_pages():
    lay = kv_layout("tpu")
    assert (lay.name, lay.page_size, lay.head_axis) == ("merged", 128, 2)
    cache = lay.init(3, 2, 10, 128, 64, jnp.bfloat16)
    assert set(cache) == {"kv"} and cache["kv"].shape == (3, 10, 2, 2, 128, 64)
    assert cache["kv"].dtype == jnp.bfloat16
    int8 = lay.shapes(3, 2, 10, 128, 64, jnp.int8)
    assert int8["kv"].dtype == jnp.int8 and int8["kv_scale"].shape == (3, 10, 2, 2, 128)


def test_merged_layout_round_trip_and_page_contiguity():
    rng = np.random.default_rng(0)
    std = {"k": jnp.asarray(rng.standard_normal((2, 3, 5, 4, 8)), jnp.float32),
           "v": jnp.asarray(rng.standard_normal((2, 3, 5, 4, 8)), jnp.float32),
           "k_scale": jnp.asarray(rng.random((2, 3, 5, 4)), jnp.float32),
           "v_scale": jnp.asarray(rng.random((2, 3, 5, 4)), jnp.float32)}
    merged = layout.from_standard(std)
    # layer 1, page 4: all heads' K and V in one block
    np.testing.assert_array_equal(merged["kv"][1, 4, 2, 0], std["k"][1, 2, 4])
    np.testing.assert_array_equal(merged["kv"][1, 4, 2, 1], std["v"][1, 2, 4])
    np.testing.assert_array_equal(merged["kv_scale"][1, 4, 2, 1], std["v_scale"][1, 2, 4])
    back = layout.to_standard(merged)
    for name in std:
        np.testing.assert_array_equal(back[name], std[name])


def test_write_kv_places_rows_and_drops_pages_past_the_cache():
    """The flat-row scatter: each token's K and V land at (layer, page, head, offset); a page index past
    the cache (padding tokens) writes nothing, not even into the next layer's first page."""
    from slipstream.kernels.ragged_tokens import quantize_kv
    rng = np.random.default_rng(1)
    for dtype in (jnp.float32, jnp.int8):
        cache = {k: jnp.asarray(rng.standard_normal(s.shape), s.dtype) if s.dtype != jnp.int8 else
                 jnp.asarray(rng.integers(-5, 5, s.shape), jnp.int8)
                 for k, s in layout.shapes(3, 2, 4, 8, 16, dtype).items()}
        k_new = jnp.asarray(rng.standard_normal((3, 2, 16)), jnp.float32)
        v_new = jnp.asarray(rng.standard_normal((3, 2, 16)), jnp.float32)
        page, offset = jnp.asarray([2, 4, 3]), jnp.asarray([5, 0, 7])     # token 1: page 4 == num_pages
        out = layout.write_kv(cache, jnp.int32(1), k_new, v_new, page, offset, quantize_kv)
        expect = {k: np.array(v) for k, v in cache.items()}
        for t in (0, 2):
            for j, x in enumerate((k_new, v_new)):
                if dtype == jnp.int8:
                    q, s = quantize_kv(x[t])
                    expect["kv"][1, int(page[t]), :, j, int(offset[t])] = np.asarray(q)
                    expect["kv_scale"][1, int(page[t]), :, j, int(offset[t])] = np.asarray(s)
                else:
                    expect["kv"][1, int(page[t]), :, j, int(offset[t])] = np.asarray(x[t])
        for k in expect:
            np.testing.assert_array_equal(np.asarray(out[k]), expect[k], err_msg=f"{dtype.__name__} {k}")
