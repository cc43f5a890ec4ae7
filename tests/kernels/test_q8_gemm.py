"""The many-row int8 GEMM (kernels/q8_gemm.py) equals kernels.q8_matmul.reference: ragged row counts,
odd K and N, weight stacks read at a traced layer index, Q4_1-style offsets, one and two activation
parts, and every micro-block shape and work split it can be set to."""
from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import q8_gemm as qg
from kernels import q8_matmul as q8

NATIVE = qg.native_available()
needs_native = pytest.mark.skipif(not NATIVE, reason="kernels._q8_gemm is not built or the CPU has no AVX-512 VNNI")


def _weights(rng, k, n, layers, offsets):
    packs = []
    for _ in range(layers):
        q = rng.integers(-128, 128, (n, k)).astype(np.int8)
        d = (rng.random((n, -(-k // q8.GROUP))) * 1e-2).astype(np.float32)
        m = (rng.standard_normal(d.shape) * 1e-2).astype(np.float32) if offsets else None
        packs.append(q8.pack(q, d, m))
    return [np.stack(a) for a in zip(*packs)]


def _check(m, k, n, parts, offsets, layers, seed, *, scale=1.0):
    rng = np.random.default_rng(seed)
    w = _weights(rng, k, n, layers or 1, offsets)
    x = (rng.standard_normal((m, k)) * scale).astype(np.float32)
    x[rng.random(m) < 0.1] = 0.0  # all-zero rows: zero scales
    if layers:
        packed, scales, off = w[0], w[1], (w[2] if offsets else None)
        layer = int(rng.integers(layers))
        fn = jax.jit(lambda x, p, s, o, i: qg.q8_gemm(x, p, s, o, n=n, parts=parts, layer=i))
        got = np.asarray(fn(x, packed, scales, off, jnp.int32(layer)))
        want = np.asarray(q8.reference(jnp.asarray(x), packed[layer], scales[layer],
                                       None if off is None else off[layer], n=n, parts=parts))
    else:
        packed, scales, off = w[0][0], w[1][0], (w[2][0] if offsets else None)
        fn = jax.jit(lambda x, p, s, o: qg.q8_gemm(x, p, s, o, n=n, parts=parts))
        got = np.asarray(fn(x, packed, scales, off))
        want = np.asarray(q8.reference(jnp.asarray(x), packed, scales, off, n=n, parts=parts))
    assert got.shape == (m, n)
    # Same int32 dots and the same scales; only the order of the f32 sums over groups may differ.
    tol = 1e-5 * (np.abs(want).max() + 1.0) * np.sqrt(-(-k // 32))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=tol)
    return got


@needs_native
@settings(max_examples=25, deadline=None)
@given(m=st.integers(16, 512), k=st.integers(1, 700), n=st.integers(1, 200), parts=st.sampled_from([1, 2]),
       offsets=st.booleans(), layers=st.sampled_from([0, 3]), seed=st.integers(0, 2**31 - 1))
def test_equals_reference(m, k, n, parts, offsets, layers, seed):
    _check(m, k, n, parts, offsets, layers, seed)


@needs_native
@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("rows,tiles,item_rows,item_tiles,threads",
                         [(1, 1, 1, 1, 0), (3, 2, 7, 5, 1), (4, 3, 64, 6, 0), (6, 2, 20, 2, 2), (2, 4, 33, 8, 0)])
def test_every_block_shape(parts, rows, tiles, item_rows, item_tiles, threads):
    """Each micro block (and its ragged edges) and work split gives the reference's result."""
    ext = importlib.import_module("kernels._q8_gemm")
    prev = ext.shape(parts, rows, tiles, item_rows, item_tiles, threads)
    try:
        _check(37, 577, 103, parts, True, 2, rows * 10 + tiles)
        _check(130, 96, 49, parts, False, 0, rows * 10 + tiles + 1)
    finally:
        ext.shape(parts, *prev)


@needs_native
def test_large_activations_and_model_shape():
    """Large values (int32 sums near their bound with two parts) and a fused gate/up shape."""
    _check(64, 576, 3072, 2, True, 2, 7, scale=1e4)
    _check(33, 1536, 576, 1, False, 0, 8)


@needs_native
def test_rejects_a_weight_of_another_shape():
    rng = np.random.default_rng(0)
    packed, scales = (a[0] for a in _weights(rng, 64, 32, 1, False))
    with pytest.raises(ValueError):
        qg.q8_gemm(jnp.zeros((16, 65)), packed, scales, n=32)
    with pytest.raises(ValueError):
        qg.q8_gemm(jnp.zeros((16, 64)), packed, scales, n=32, parts=3)


def test_falls_back_without_the_native_module(monkeypatch):
    """Where the kernel cannot run, q8_gemm is q8_matmul's result (whichever path that takes)."""
    monkeypatch.setattr(qg, "native_available", lambda: False)
    rng = np.random.default_rng(1)
    packed, scales = (a[0] for a in _weights(rng, 40, 20, 1, False))
    x = rng.standard_normal((17, 40)).astype(np.float32)
    got = np.asarray(qg.q8_gemm(x, packed, scales, n=20))
    want = np.asarray(q8.q8_matmul(x, packed, scales, n=20))
    np.testing.assert_array_equal(got, want)
