"""The f32 panel matmul kernel equals an f32 HIGHEST-precision dot and its pure-JAX reference, on every
instruction-set path this CPU has: ragged rows 1..512, odd K and N, a stacked weight read at a traced
layer index, and every work split."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream.kernels import f32_matmul as fm
from tests.kernels.isas import runnable_isas

NATIVE = fm.native_available()
if NATIVE:
    import slipstream.kernels._f32_matmul as ext

ISAS = runnable_isas(ext, ("avx512", "avx2", "portable")) if NATIVE else []
needs_native = pytest.mark.skipif(not NATIVE, reason="slipstream.kernels._f32_matmul is not built")


def oracle(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return np.asarray(jnp.dot(jnp.asarray(x), jnp.asarray(w), precision=jax.lax.Precision.HIGHEST))


def close(got: np.ndarray, want: np.ndarray, k: int) -> None:
    # f32 sums of k products in another order: a few ulps of the sum of |terms| per output
    np.testing.assert_allclose(got, want, rtol=0, atol=4e-7 * max(k, 1) ** 0.5 * float(np.abs(want).max() + 1))


# one program per shape: the kernel reads its ISA and work split when it runs
_kernel = jax.jit(fm.f32_matmul, static_argnames="n")


def run(x, packed, n, isa=None, layer=None, policy=None):
    prev_isa = ext.set_isa(isa) if isa else None
    prev_policy = ext.threading(*policy) if policy else None
    try:
        return np.asarray(_kernel(x, packed, n=n, layer=None if layer is None else np.int32(layer)))
    finally:
        if prev_isa:
            ext.set_isa(prev_isa)
        if prev_policy:
            ext.threading(*prev_policy)


def test_pack_round_trips_with_zero_padding():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 7, 45), np.float32)
    packed = fm.pack(w)
    assert packed.shape == (3, 2, 7 * fm.PANEL)
    np.testing.assert_array_equal(np.asarray(fm.unpack(jnp.asarray(packed), 45)), w)
    assert not packed.reshape(3, 2, 7, fm.PANEL)[:, 1, :, 45 - 32:].any()


@needs_native
@settings(max_examples=14, deadline=None)
@given(m=st.integers(1, 512), k=st.integers(1, 700), n=st.integers(1, 300), seed=st.integers(0, 2**31 - 1))
def test_matches_highest_precision_dot(m, k, n, seed):
    # every example runs every path (one compiled program)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k), np.float32)
    w = rng.standard_normal((k, n), np.float32)
    packed = fm.pack(w)
    want = oracle(x, w)
    for isa in ISAS:
        close(run(x, packed, n, isa), want, k)
    close(np.asarray(fm.reference(jnp.asarray(x), jnp.asarray(packed), n=n)), want, k)


@needs_native
@pytest.mark.parametrize("m", [1, 2, 3, 4, 13, 14, 15, 29, 256, 257])
def test_stacked_weight_at_a_traced_layer_index(m):
    rng = np.random.default_rng(m)
    k, n, layers = 96, 200, 3
    x = rng.standard_normal((m, k), np.float32)
    w = rng.standard_normal((layers, k, n), np.float32)
    packed = fm.pack(w)
    for layer in range(layers):
        want = oracle(x, w[layer])
        for isa in ISAS:
            close(run(x, packed, n, isa, layer=layer), want, k)


@needs_native
@pytest.mark.parametrize("policy", [(1, 0, 0), (2, 0, 0), (0, 5, 1), (0, 64, 3), (0, 1, 7)])
def test_every_work_split_gives_the_same_product(policy):
    """Threads, rows per block and panels per chunk change who computes which outputs, never the
    outputs: each is one micro kernel's sum over all of K, whatever the split."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((77, 130), np.float32)
    w = rng.standard_normal((130, 300), np.float32)
    packed = fm.pack(w)
    np.testing.assert_array_equal(run(x, packed, 300, policy=policy), run(x, packed, 300))


@needs_native
def test_the_default_model_shapes_inside_a_scan():
    """q/k/v fused (576 -> 960) over a stack of layers, read by index inside lax.scan, at prefill and
    decode row counts."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((4, 576, 960), np.float32) * 0.05
    packed = jnp.asarray(fm.pack(w))
    for m in (1, 256):
        x = rng.standard_normal((m, 576), np.float32)

        def body(carry, i):
            return carry, fm.f32_matmul(jnp.asarray(x), packed, n=960, layer=i)

        _, ys = jax.jit(lambda: jax.lax.scan(body, 0, jnp.arange(4, dtype=jnp.int32)))()
        for layer in range(4):
            close(np.asarray(ys[layer]), oracle(x, w[layer]), 576)


def test_rejects_a_weight_of_another_shape():
    packed = jnp.asarray(fm.pack(np.zeros((64, 40), np.float32)))
    with pytest.raises(ValueError, match="does not hold a \\[64, 70\\] weight"):
        fm.f32_matmul(jnp.zeros((2, 64)), packed, n=70)


# SLIPSTREAM_KERNELS=reference: tests/kernels/test_q8_matmul.py::test_reference_forced_by_environment checks
# this kernel's switch too (one process for both).
