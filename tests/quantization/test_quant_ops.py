"""linear(): float, w8a16 and w8a8 paths against a float reference with derived error bounds."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from quantization import ops
from quantization.weights import QuantizedWeight, quantize_weight


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


@pytest.mark.parametrize("m", [1, 7, 33])
def test_w8a16_equals_dequantized_matmul(m):
    # w8a16 only reorders (x @ q) * s vs x @ (q * s): the gap is f32 rounding, ~k * eps.
    x, w = make(m, 96, 40)
    qw = quantize_weight(jnp.asarray(w), "w8a16")
    ref = x.astype(np.float64) @ deq(qw)
    bound = 1e-5 * (np.abs(x) @ np.abs(deq(qw))) + 1e-6
    assert np.all(np.abs(np.asarray(linear(jnp.asarray(x), qw)) - ref) <= bound)
    # Against the original float weight, each weight is off by at most scale/2.
    bound_w = (np.abs(x) @ np.ones_like(w)) * np.asarray(qw.scale) / 2 + 1e-5
    assert np.all(np.abs(np.asarray(linear(jnp.asarray(x), qw)) - x @ w) <= bound_w)


@pytest.mark.parametrize("n_out,tile_bytes", [(300, 256 * 96 * 4), (1000, 128 * 96 * 4)])
def test_w8a16_column_tiled_path_matches_untiled(monkeypatch, n_out, tile_bytes):
    # A small tile budget forces the CPU column loop, including a ragged last tile.
    x, w = make(9, 96, n_out, seed=4)
    qw = quantize_weight(jnp.asarray(w), "w8a16")
    whole = np.asarray(linear(jnp.asarray(x), qw))
    monkeypatch.setattr(ops, "CPU_TILE_BYTES", tile_bytes)
    tiled = np.asarray(linear(jnp.asarray(x), qw))
    np.testing.assert_allclose(tiled, whole, rtol=1e-5, atol=1e-5)
    ref = x.astype(np.float64) @ deq(qw)
    assert np.all(np.abs(tiled - ref) <= 1e-5 * (np.abs(x) @ np.abs(deq(qw))) + 1e-6)


@pytest.mark.parametrize("m", [1, 3, 16, 40])
def test_w8a8_within_activation_rounding_bound(m):
    # x = xq * xs + e with |e| <= xs/2 per element (xs = max|row| / 127), so
    # |linear - x @ deq(w)| <= xs/2 * sum_i |deq(w)[i, o]|; for gaussian rows that is ~1e-2
    # relative.
    x, w = make(m, 128, 72, seed=m)
    qw = quantize_weight(jnp.asarray(w), "w8a8")
    ref = x.astype(np.float64) @ deq(qw)
    x_scale = np.abs(x).max(axis=1, keepdims=True) / 127
    bound = x_scale / 2 * np.abs(deq(qw)).sum(axis=0) * (1 + 1e-4) + 1e-6
    got = np.asarray(linear(jnp.asarray(x), qw))
    assert np.all(np.abs(got - ref) <= bound)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2e-2


def test_w8a8_rows_do_not_leak_into_each_other():
    # Per-token scales: a huge row must not coarsen a small row's quantization (and padding
    # rows up to the kernel minimum must not change results).
    x, w = make(2, 64, 16, seed=5)
    x[0] *= 1e4
    qw = quantize_weight(jnp.asarray(w), "w8a8")
    both = np.asarray(linear(jnp.asarray(x), qw))
    alone = np.asarray(linear(jnp.asarray(x[1:]), qw))
    np.testing.assert_allclose(both[1:], alone, rtol=1e-6, atol=1e-6)
    ref = x[1] @ deq(qw)
    assert np.linalg.norm(both[1] - ref) / np.linalg.norm(ref) < 2e-2


def test_w8a8_zero_row_gives_zero_output():
    x, w = make(3, 32, 8)
    x[1] = 0.0
    got = np.asarray(linear(jnp.asarray(x), quantize_weight(jnp.asarray(w), "w8a8")))
    assert np.all(np.isfinite(got)) and np.all(got[1] == 0.0)


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
def test_leading_dims_and_dtype_are_kept(mode):
    x, w = make(6, 32, 8)
    qw = quantize_weight(jnp.asarray(w), mode)
    x3 = jnp.asarray(x.reshape(2, 3, 32), jnp.bfloat16)
    y = linear(x3, qw)
    assert y.shape == (2, 3, 8) and y.dtype == jnp.bfloat16
    flat = linear(jnp.asarray(x, jnp.bfloat16), qw)
    np.testing.assert_array_equal(
        np.asarray(y, np.float32).reshape(6, 8), np.asarray(flat, np.float32)
    )


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
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
    tol = 1e-5 if mode == "w8a16" else 3e-2
    np.testing.assert_allclose(got, ref, atol=tol * np.abs(ref).max())


def test_shape_errors_are_actionable():
    qw = quantize_weight(jnp.ones((2, 8, 4)), "w8a16")
    with pytest.raises(ValueError, match="2-D weight"):
        ops.linear(jnp.ones((3, 8)), qw)
    with pytest.raises(ValueError, match="does not match"):
        ops.linear(jnp.ones((3, 5)), jnp.ones((8, 4)))
