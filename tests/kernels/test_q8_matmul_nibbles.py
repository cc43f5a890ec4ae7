"""4-bit packing (weights in 0..15, GGUF's Q4_1 / Q4_K blocks, two per byte): the kernel's outputs equal
the 8-bit packing's bit for bit on every instruction-set path."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream.kernels import q8_matmul as q8
from tests.kernels.q8_cases import ISAS, f16, needs_native, run_kernel, run_on_every_isa, run_reference


@needs_native
@settings(max_examples=14, deadline=None)
@given(m=st.integers(1, 300), k=st.integers(1, 200), n=st.integers(1, 90), seed=st.integers(0, 2**31 - 1),
       parts=st.sampled_from([1, 2]), offsets=st.booleans(), gated=st.booleans())
def test_four_bit_packing_gives_the_eight_bit_results(m, k, n, seed, parts, offsets, gated):
    """Weights in 0..15 (GGUF's Q4_1 / Q4_K blocks) packed two to a byte: half the bytes, and the
    kernel's outputs equal those of the same weights at 8 bits bit for bit, on every path (the kernel
    widens each nibble back to the 8-bit encoding), as do the reference's. Every example runs every path."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (n, k)).astype(np.int8)
    d = f16(rng.random((n, -(-k // q8.GROUP))) * 1e-2)
    off = f16(rng.standard_normal(d.shape) * 1e-2) if offsets else None
    p8, s8, *o8 = q8.pack(q, d, off)
    p4, s4, *o4 = q8.pack(q, d, off, bits=4)
    assert p4.shape == (p8.shape[0], p8.shape[1] // 2) and q8.packed_bits(p4.shape[1], s4.shape[1]) == 4
    np.testing.assert_array_equal(q8.widen(p4), p8)
    x = (rng.standard_normal((m, 2 * k if gated else k)) * rng.choice([1e-3, 1.0, 30.0])).astype(np.float32)
    got = run_on_every_isa(x, p4, s4, n, offsets=o4[0] if offsets else None, parts=parts, gated=gated)
    want = run_on_every_isa(x, p8, s8, n, offsets=o8[0] if offsets else None, parts=parts, gated=gated)
    for isa in ISAS:
        np.testing.assert_array_equal(got[isa], want[isa], err_msg=isa)
    if not gated:
        np.testing.assert_array_equal(run_reference(x, p4, s4, n, o4[0] if offsets else None, parts),
                                      run_reference(x, p8, s8, n, o8[0] if offsets else None, parts))


@needs_native
def test_four_bit_stack_reads_the_layer_it_is_given():
    rng = np.random.default_rng(3)
    k, n, layers = 96, 40, 3
    weights = [(rng.integers(0, 16, (n, k)).astype(np.int8), f16(rng.random((n, 3)) * 1e-2)) for _ in range(layers)]
    p4 = [q8.pack(q, d, bits=4) for q, d in weights]
    packed, scales = (jnp.asarray(np.stack([w[i] for w in p4])) for i in range(2))
    x = rng.standard_normal((2, k)).astype(np.float32)
    for layer in range(layers):
        got = jax.jit(lambda x, p, s, i: q8.q8_matmul(x, p, s, n=n, layer=i))(x, packed, scales, jnp.int32(layer))
        np.testing.assert_array_equal(np.asarray(got), run_kernel(x, *q8.pack(*weights[layer]), n))


def test_four_bit_packing_needs_values_in_0_to_15():
    q = np.full((16, 32), 16, np.int8)
    with pytest.raises(ValueError, match="0..15"):
        q8.pack(q, np.ones((16, 1), np.float32), bits=4)
    with pytest.raises(ValueError, match="0..15"):
        q8.pack(-q, np.ones((16, 1), np.float32), bits=4)
    assert q8.pack_bits(q - 1) == 4 and q8.pack_bits(q) == 8 and q8.pack_bits(q - 17) == 8
