"""The multi-LoRA delta kernel equals its pure-JAX reference and a float64 oracle on every instruction-set
path this CPU has: each token through its own slot's A and B (slot 0 untouched), odd sizes, ranks 1..64 that
cross panel boundaries, stacks read at a traced layer index, y updated in place without touching the caller's."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream.kernels import f32_matmul as fm
from slipstream.kernels import lora_delta as ld
from tests.kernels.isas import runnable_isas

NATIVE = ld.native_available()
if NATIVE:
    import slipstream.kernels._lora_delta as ext

ISAS = runnable_isas(ext, ("avx512", "avx2", "portable")) if NATIVE else []
needs_native = pytest.mark.skipif(not NATIVE, reason="slipstream.kernels._lora_delta is not built")


def case(rng, t, k, n, rank, num_slots, layers=None):
    """y [T, N], x [T, K], A [(L,) K, S*r], B [(L,) S*r, N] (plain), token slots in 0..S (both ends drawn)."""
    lead = () if layers is None else (layers,)
    y = rng.standard_normal((t, n), np.float32)
    x = rng.standard_normal((t, k), np.float32)
    a = rng.standard_normal((*lead, k, num_slots * rank), np.float32)
    b = rng.standard_normal((*lead, num_slots * rank, n), np.float32)
    slots = rng.integers(0, num_slots + 1, t).astype(np.int32)
    slots[: min(t, 2)] = [0, num_slots][: min(t, 2)]
    return y, x, a, b, slots


def oracle(y, x, a, b, slots, rank):
    """float64: y + x[t] A[:, own columns] B[own rows] per token, and the sum of |terms| (error bounds)."""
    want, mag = y.astype(np.float64), np.abs(y).astype(np.float64)
    for t, s in enumerate(slots):
        if s:
            cols = slice((s - 1) * rank, s * rank)
            a_s, b_s = a[:, cols].astype(np.float64), b[cols].astype(np.float64)
            want[t] += x[t] @ a_s @ b_s
            mag[t] += np.abs(x[t]) @ np.abs(a_s) @ np.abs(b_s)
    return want, mag


def close(got, want, mag, k, rank):
    # two f32 sums (k terms, then rank), one add to y, in any order: within (k + rank + 2) ulps of |terms|
    bound = (k + rank + 2) * 2.0**-24 * 1.01 * mag + 1e-30
    err = np.abs(got.astype(np.float64) - want)
    assert (err <= bound).all(), f"max error {err.max():.3g}, {(err > bound).sum()} outputs over the bound"


def run(y, x, pa, pb, slots, rank, isa=None, layer=None):
    prev = ext.set_isa(isa) if isa else None
    try:
        if layer is None:
            f = jax.jit(lambda y, x, a, b, s: ld.lora_add(y, x, a, b, s, rank=rank))
            return np.asarray(f(y, x, pa, pb, slots))
        f = jax.jit(lambda y, x, a, b, s, i: ld.lora_add(y, x, a, b, s, rank=rank, layer=i))
        return np.asarray(f(y, x, pa, pb, slots, np.int32(layer)))
    finally:
        if prev:
            ext.set_isa(prev)


@needs_native
@settings(max_examples=40, deadline=None)
@given(t=st.integers(1, 70), k=st.integers(1, 150), n=st.integers(1, 100), rank=st.integers(1, 64),
       num_slots=st.integers(1, 4), isa=st.sampled_from(ISAS or ["-"]), seed=st.integers(0, 2**31 - 1))
def test_each_token_gets_its_own_slots_delta(t, k, n, rank, num_slots, isa, seed):
    y, x, a, b, slots = case(np.random.default_rng(seed), t, k, n, rank, num_slots)
    pa, pb = fm.pack(a), fm.pack(b)
    want, mag = oracle(y, x, a, b, slots, rank)
    got = run(y, x, pa, pb, slots, rank, isa)
    close(got, want, mag, k, rank)
    np.testing.assert_array_equal(got[slots == 0], y[slots == 0])  # base-model rows as they were, bit for bit


@pytest.mark.parametrize("t,k,n,rank,num_slots", [(5, 33, 70, 1, 3), (17, 100, 45, 24, 4), (3, 9, 130, 64, 2)])
def test_the_reference_gives_each_token_its_own_slots_delta(t, k, n, rank, num_slots):
    """The JAX path (other platforms, SLIPSTREAM_KERNELS=reference) against the same oracle."""
    y, x, a, b, slots = case(np.random.default_rng(t), t, k, n, rank, num_slots)
    ref = jax.jit(lambda *args: ld.reference(*args, rank=rank))(y, x, fm.pack(a), fm.pack(b), slots, np.int32(0))
    close(np.asarray(ref), *oracle(y, x, a, b, slots, rank), k, rank)


@needs_native
@pytest.mark.parametrize("isa", ISAS)
def test_stacks_at_a_traced_layer_index_inside_a_scan(isa):
    """The default model's q_proj shapes (576 -> 576), 4 slots of rank 16, 32 decodes plus a 30-token chunk on
    one slot; each layer of the stacks read where it lies."""
    rng = np.random.default_rng(1)
    layers, rank = 3, 16
    y, x, a, b, slots = case(rng, 62, 576, 576, rank, 4, layers)
    slots[32:] = 3
    pa, pb = jnp.asarray(fm.pack(a)), jnp.asarray(fm.pack(b))

    def body(carry, i):
        return carry, ld.lora_add(jnp.asarray(y), jnp.asarray(x), pa, pb, jnp.asarray(slots), rank=rank, layer=i)

    prev = ext.set_isa(isa)
    try:
        _, ys = jax.jit(lambda: jax.lax.scan(body, 0, jnp.arange(layers, dtype=jnp.int32)))()
    finally:
        ext.set_isa(prev)
    for layer in range(layers):
        close(np.asarray(ys[layer]), *oracle(y, x, a[layer], b[layer], slots, rank), 576, rank)


@needs_native
def test_the_callers_y_is_left_as_it_was():
    """y is updated in place only where XLA gives the kernel its own buffer: an argument the caller keeps
    reads the same after the call."""
    y, x, a, b, slots = case(np.random.default_rng(2), 9, 40, 50, 8, 2)
    y_dev = jnp.asarray(y)
    got = jax.jit(lambda y, x, a, b, s: ld.lora_add(y, x, a, b, s, rank=8))(y_dev, x, fm.pack(a), fm.pack(b), slots)
    np.testing.assert_array_equal(np.asarray(y_dev), y)
    assert np.abs(np.asarray(got) - y)[slots > 0].max() > 1e-3


@needs_native
def test_a_slot_past_the_stacks_is_an_error():
    y, x, a, b, slots = case(np.random.default_rng(3), 4, 16, 16, 4, 2)
    slots[1] = 3
    with pytest.raises(Exception, match="slot is out of range"):
        run(y, x, fm.pack(a), fm.pack(b), slots, 4)


def test_rejects_stacks_of_another_shape():
    y, x, a, b, slots = case(np.random.default_rng(4), 4, 16, 20, 4, 2)
    with pytest.raises(ValueError, match="do not fit"):
        ld.lora_add(jnp.asarray(y), jnp.asarray(x), fm.pack(a), fm.pack(b), jnp.asarray(slots), rank=3)
    with pytest.raises(ValueError, match="do not fit"):
        ld.lora_add(jnp.zeros((4, 40)), jnp.asarray(x), fm.pack(a), fm.pack(b), jnp.asarray(slots), rank=4)
