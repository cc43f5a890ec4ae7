"""The multi-LoRA delta kernel equals its pure-JAX reference and a float64 oracle on every instruction-set
path this CPU has: each token through its own slot's A and B (slot 0 untouched), odd sizes, ranks 1..64 that
cross panel boundaries, a member's columns of a fused output (the others untouched), a gated MLP's gate | up
as the input (silu(gate) * up), stacks read at a traced layer index, y updated in place without touching the
caller's."""
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


def silu_times_up(gu):
    """float64 silu(gate) * up of gate | up rows."""
    g, u = np.split(gu.astype(np.float64), 2, axis=-1)
    return g / (1 + np.exp(-g)) * u


def close(got, want, mag, k, rank, gated=False):
    # two f32 sums (k terms, then rank), one add to y, in any order: within (k + rank + 2) ulps of |terms|;
    # a gated input's silu(gate) * up within a few ulps of its own
    bound = (k + rank + 2 + 8 * gated) * 2.0**-24 * 1.01 * mag + 1e-30
    err = np.abs(got.astype(np.float64) - want)
    assert (err <= bound).all(), f"max error {err.max():.3g}, {(err > bound).sum()} outputs over the bound"


def run(y, x, pa, pb, slots, rank, isa=None, layer=None, col=0, n=None, gated=False):
    prev = ext.set_isa(isa) if isa else None
    try:
        if layer is None:
            f = jax.jit(lambda y, x, a, b, s: ld.lora_add(y, x, a, b, s, rank=rank, col=col, n=n, gated=gated))
            return np.asarray(f(y, x, pa, pb, slots))
        f = jax.jit(lambda y, x, a, b, s, i: ld.lora_add(y, x, a, b, s, rank=rank, layer=i))
        return np.asarray(f(y, x, pa, pb, slots, np.int32(layer)))
    finally:
        if prev:
            ext.set_isa(prev)


@needs_native
@settings(max_examples=40, deadline=None)
@given(t=st.integers(1, 70), k=st.integers(1, 150), n=st.integers(1, 100), rank=st.integers(1, 64),
       num_slots=st.integers(1, 4), before=st.sampled_from([0, 0, 5, 32]), after=st.sampled_from([0, 0, 3, 40]),
       gated=st.booleans(), isa=st.sampled_from(ISAS or ["-"]), seed=st.integers(0, 2**31 - 1))
def test_each_token_gets_its_own_slots_delta(t, k, n, rank, num_slots, before, after, gated, isa, seed):
    """In columns before .. before + n of y (a fused output's member, when before or after is not 0)."""
    rng = np.random.default_rng(seed)
    _, x, a, b, slots = case(rng, t, k, n, rank, num_slots)
    y = rng.standard_normal((t, before + n + after), np.float32)
    if gated:
        x = rng.standard_normal((t, 2 * k), np.float32) * 2
    pa, pb = fm.pack(a), fm.pack(b)
    want, mag = oracle(y[:, before:before + n], silu_times_up(x) if gated else x, a, b, slots, rank)
    got = run(y, x, pa, pb, slots, rank, isa, col=before, n=n, gated=gated)
    close(got[:, before:before + n], want, mag, k, rank, gated)
    np.testing.assert_array_equal(got[slots == 0], y[slots == 0])  # base-model rows as they were, bit for bit
    np.testing.assert_array_equal(got[:, :before], y[:, :before])  # the other members' columns too
    np.testing.assert_array_equal(got[:, before + n:], y[:, before + n:])


@pytest.mark.parametrize("t,k,n,rank,num_slots,col,gated", [(5, 33, 70, 1, 3, 0, False), (17, 100, 45, 24, 4, 7, False),
                                                             (3, 9, 130, 64, 2, 0, True)])
def test_the_reference_gives_each_token_its_own_slots_delta(t, k, n, rank, num_slots, col, gated):
    """The JAX path (other platforms, SLIPSTREAM_KERNELS=reference) against the same oracle."""
    rng = np.random.default_rng(t)
    _, x, a, b, slots = case(rng, t, k, n, rank, num_slots)
    if gated:
        x = rng.standard_normal((t, 2 * k), np.float32)
    y = rng.standard_normal((t, col + n + col), np.float32)
    ref = jax.jit(lambda *args: ld.reference(*args, rank=rank, col=col, n=n, gated=gated))(
        y, x, fm.pack(a), fm.pack(b), slots, np.int32(0))
    ref = np.asarray(ref)
    want, mag = oracle(y[:, col:col + n], silu_times_up(x) if gated else x, a, b, slots, rank)
    close(ref[:, col:col + n], want, mag, k, rank, gated)
    np.testing.assert_array_equal(np.delete(ref, np.s_[col:col + n], axis=1), np.delete(y, np.s_[col:col + n], axis=1))


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
        ld.lora_add(jnp.zeros((4, 30)), jnp.asarray(x), fm.pack(a), fm.pack(b), jnp.asarray(slots), rank=4, col=11,
                    n=20)
    with pytest.raises(ValueError, match="do not fit"):
        ld.lora_add(jnp.zeros((4, 40)), jnp.asarray(x), fm.pack(a), fm.pack(b), jnp.asarray(slots), rank=4)
