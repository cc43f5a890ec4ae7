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
