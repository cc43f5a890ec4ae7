"""int8 KV entries (kernels.attention.quantize_kv, how the attention kernels write an int8 cache):
per-token-per-head scales, error bound, dtype round trip."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from slipstream.kernels.attention import quantize_kv


def dequantize_kv(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """What the kernels read back: int8 [..., KV, hd] * scale [..., KV]."""
    return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_round_trip_error_is_at_most_half_a_step_per_token_head(dtype):
    rng = np.random.default_rng(0)
    # [pages, page_size, n_kv_heads, head_dim] with very different magnitudes per token and head.
    x = rng.standard_normal((3, 4, 2, 16)) * rng.uniform(1e-3, 1e3, (3, 4, 2, 1))
    xj = jnp.asarray(x, dtype)
    q, scale = quantize_kv(xj)
    assert q.dtype == jnp.int8 and q.shape == x.shape
    assert scale.dtype == jnp.float32 and scale.shape == (3, 4, 2)
    x32 = np.asarray(xj, np.float32)
    np.testing.assert_allclose(np.asarray(scale), np.abs(x32).max(-1) / 127, rtol=1e-6)
    back = dequantize_kv(q, scale, dtype)
    assert back.dtype == dtype
    err = np.abs(np.asarray(dequantize_kv(q, scale, jnp.float32)) - x32)
    assert np.all(err <= np.asarray(scale)[..., None] / 2 * (1 + 1e-5))
    # Relative to each token-head's magnitude the error stays under 1/254.
    assert np.all(err.max(-1) <= np.abs(x32).max(-1) / 254 * (1 + 1e-5))


def test_zero_vectors_stay_zero():
    x = jnp.zeros((2, 2, 8)).at[0, 1].set(1.0)
    q, scale = quantize_kv(x)
    back = np.asarray(dequantize_kv(q, scale, jnp.float32))
    assert np.all(np.isfinite(back))
    np.testing.assert_array_equal(back, np.asarray(x))


def test_works_under_jit():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((5, 2, 8)), jnp.float32)
    q, scale = jax.jit(quantize_kv)(x)
    np.testing.assert_allclose(jax.jit(dequantize_kv, static_argnums=2)(q, scale, jnp.float32), x,
                               atol=float(scale.max()) / 2 * 1.001)
