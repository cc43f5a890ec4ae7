"""linear(): float and group-wise int8 weights against a float reference; stacked layers under scan."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from slipstream.quantization import ops
from slipstream.quantization.weights import QuantizedWeight, quantize_weight


def make(m: int, k: int, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    return x, w


def deq(qw: QuantizedWeight) -> np.ndarray:
    return np.asarray(qw.dequantize(), np.float64)


def linear(x, w):
    # A fresh jitted lambda per call so monkeypatched module constants are re-read at trace time.
    return jax.jit(lambda a, b: ops.linear(a, b))(x, w)


def test_float_weight_matches_numpy_and_keeps_input_dtype():
    x, w = make(5, 24, 12)
    np.testing.assert_allclose(linear(jnp.asarray(x), jnp.asarray(w)), x @ w, rtol=1e-5, atol=1e-5)
    y16 = linear(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16))
    assert y16.dtype == jnp.bfloat16


@pytest.mark.parametrize("mode", ["q8_0", "q8_0-a16"])
def test_leading_dims_and_dtype_are_kept(mode):
    x, w = make(6, 64, 8)
    qw = quantize_weight(jnp.asarray(w), mode)
    x3 = jnp.asarray(x.reshape(2, 3, 64), jnp.float32)
    y = linear(x3, qw)
    assert y.shape == (2, 3, 8) and y.dtype == jnp.float32
    flat = linear(jnp.asarray(x), qw)
    np.testing.assert_array_equal(
        np.asarray(y, np.float32).reshape(6, 8), np.asarray(flat, np.float32)
    )


@pytest.mark.parametrize("mode", ["q8_0", "q8_0-a16"])
def test_scan_over_stacked_quantized_layers(mode):
    # The model scans over layers: each step sees q [in, out] and scale [out] of one layer.
    n_layers, d = 3, 32
    rng = np.random.default_rng(6)
    w = (rng.standard_normal((n_layers, d, d)) / np.sqrt(d)).astype(np.float32)
    x = rng.standard_normal((4, d)).astype(np.float32)
    qw = quantize_weight(jnp.asarray(w), mode)

    @jax.jit
    def run(h, stacked):
        def step(h, layer_w):
            return jnp.tanh(ops.linear(h, layer_w)), None
        return jax.lax.scan(step, h, stacked)[0]

    got = np.asarray(run(jnp.asarray(x), qw))
    ref = x.astype(np.float64)
    for layer in range(n_layers):
        ref = np.tanh(ref @ deq(qw)[layer])
    tol = 1e-3 if mode == "q8_0-a16" else 3e-2
    np.testing.assert_allclose(got, ref, atol=tol * np.abs(ref).max())


def test_shape_errors_are_actionable():
    qw = quantize_weight(jnp.ones((2, 32, 4)), "q8_0")
    with pytest.raises(ValueError, match="2-D weight"):
        ops.linear(jnp.ones((3, 32)), qw)
    with pytest.raises(ValueError, match="does not match"):
        ops.linear(jnp.ones((3, 5)), jnp.ones((8, 4)))
