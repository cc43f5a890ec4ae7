"""The Q8_0 matmul kernel equals its pure-JAX reference and an independent numpy oracle, on every
instruction-set path this CPU has, for odd sizes, up to 512 rows and the LM head's shape."""
from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream.kernels import q8_matmul as q8
from tests.kernels.q8_cases import (AVX2_F32_MIN_ROWS, ISAS, NATIVE, assert_close, exact_product, f16, needs_native,
                                    oracle, outlier_case, random_weight, run_kernel, run_on_every_isa, run_reference,
                                    silu_times_up, takes_f32_path)

if NATIVE:
    import slipstream.kernels._q8_matmul as ext


@needs_native
@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 512), k=st.integers(1, 200), n=st.integers(1, 90), seed=st.integers(0, 2**31 - 1),
       parts=st.sampled_from([1, 2]), offsets=st.booleans())
def test_kernel_matches_reference_and_oracle(m, k, n, seed, parts, offsets):
    # every example runs every path (one compiled program): 20 shapes per path
    rng = np.random.default_rng(seed)
    q, d = random_weight(rng, k, n)
    off = f16(rng.standard_normal(d.shape) * 1e-2) if offsets else None
    packed, scales, *rest = q8.pack(q, d, off)
    packed_off = rest[0] if offsets else None
    x = (rng.standard_normal((m, k)) * rng.choice([1e-3, 1.0, 30.0])).astype(np.float32)
    x[rng.random((m, k)) < 0.1] = 0.0  # all-zero groups: scale 0, no NaN
    want = oracle(x, q, d, off, parts)
    for isa, got in run_on_every_isa(x, packed, scales, n, offsets=packed_off, parts=parts).items():
        assert got.shape == (m, n)
        assert_close(got, exact_product(x, q, d, off) if takes_f32_path(isa, parts, m) else want, x, q, d, off,
                     err_msg=isa)
    # XLA may fuse the reference's max|x| / 127 into a reduction that divides through a reciprocal,
    # one ulp off the true division the kernel and the oracle do; at a rounding tie (x / xs = j + 0.5)
    # that moves one activation by one step. Allow the reference one such step per output.
    step = np.abs(x).max(initial=0) / 127 * np.abs(q.astype(np.float32)).max(initial=0) * d.max(initial=0)
    assert_close(run_reference(x, packed, scales, n, packed_off, parts), want, x, q, d, off, slack=step)


@needs_native
@settings(max_examples=14, deadline=None)
@given(m=st.integers(1, 300), k=st.integers(1, 200), n=st.integers(1, 120), seed=st.integers(0, 2**31 - 1),
       parts=st.sampled_from([1, 2]), offsets=st.booleans())
def test_gated_call_multiplies_silu_of_gate_times_up(m, k, n, seed, parts, offsets):
    """gated: x = gate | up [M, 2K] and the kernel multiplies silu(gate) * up, formed as it
    quantizes: equal to the oracle on that product (and to the reference's gated path), up to two
    activation quantization steps per output: the kernel's f32 silu is a few ulps from the oracle's
    (and from XLA's), which moves an activation by one step where x / xs lands that close to a
    rounding tie (~1 in 40000 activations here). Every example runs every path: 14 shapes per path."""
    rng = np.random.default_rng(seed)
    q, d = random_weight(rng, k, n)
    off = f16(rng.standard_normal(d.shape) * 1e-2) if offsets else None
    packed, scales, *rest = q8.pack(q, d, off)
    packed_off = rest[0] if offsets else None
    gate_up = (rng.standard_normal((m, 2 * k)) * rng.choice([0.1, 1.0, 30.0])).astype(np.float32)
    gate_up[:, :k][rng.random((m, k)) < 0.05] = 0.0
    x = silu_times_up(gate_up)
    step = 2 * np.abs(x).max(initial=0) / 127 * np.abs(q.astype(np.float32)).max(initial=0) * d.max(initial=0)
    oracle_product = oracle(x, q, d, off, parts)
    for isa, got in run_on_every_isa(gate_up, packed, scales, n, offsets=packed_off, parts=parts, gated=True).items():
        assert got.shape == (m, n)
        want = exact_product(x, q, d, off) if takes_f32_path(isa, parts, m) else oracle_product
        assert_close(got, want, x, q, d, off, slack=step, err_msg=isa)
    ref = jax.jit(lambda x, p, s, o: q8._reference_at(x, p, s, o, None, jnp.int32(0), n=n, parts=parts, gated=True))
    assert_close(np.asarray(ref(gate_up, packed, scales, packed_off)), oracle_product, x, q, d, off, slack=step)


@needs_native
@pytest.mark.parametrize("gated", [False, True])
def test_a_row_range_multiplies_only_its_rows_into_another_calls_output(gated):
    # the hybrid weights' first call (quantization/layer_forms.StackedHybrid): rows [begin, end) as a full call
    # gives them, the others kept from `into` (or left unwritten without it); the reference selects the same rows
    rng = np.random.default_rng(41)
    q, d = random_weight(rng, 96, 40)
    packed, scales = (jnp.asarray(a) for a in q8.pack(q, d))
    x = jnp.asarray(rng.standard_normal((19, 192 if gated else 96)).astype(np.float32))
    full = np.asarray(q8.q8_matmul(x, packed, scales, n=40, parts=2, gated=gated))
    into = jnp.full((19, 40), 7.0, jnp.float32)
    f = jax.jit(lambda x, b, e, into: q8.q8_matmul(x, packed, scales, n=40, parts=2, gated=gated, rows=(b, e),
                                                   into=into))
    ref = jax.jit(lambda x, b, e, into: q8._reference_at(x, packed, scales, None, None, jnp.int32(0),
                                                         jnp.stack([b, e]), into, n=40, parts=2, gated=gated))
    ref_full = np.asarray(q8._reference_at(x, packed, scales, None, None, jnp.int32(0), n=40, parts=2, gated=gated))
    for begin, end in ((0, 19), (4, 11), (18, 1 << 30), (6, 6)):
        inside = (np.arange(19) >= begin) & (np.arange(19) < end)
        got = np.asarray(f(x, jnp.int32(begin), jnp.int32(end), into))
        np.testing.assert_array_equal(got[inside], full[inside], err_msg=f"{begin}..{end}")
        assert (got[~inside] == 7.0).all(), f"{begin}..{end}"
        want = np.asarray(ref(x, jnp.int32(begin), jnp.int32(end), into))
        if not gated:  # (a gated row's silu may differ by an ulp between programs: a quantization step apart)
            np.testing.assert_allclose(want[inside], ref_full[inside], rtol=1e-5, atol=1e-6)
        assert (want[~inside] == 7.0).all()
    alone = np.asarray(q8.q8_matmul(x, packed, scales, n=40, parts=2, gated=gated, rows=(4, 11)))
    np.testing.assert_array_equal(alone[4:11], full[4:11])


@needs_native
def test_gated_call_needs_an_even_width():
    q, d = random_weight(np.random.default_rng(0), 16, 16)
    packed, scales = q8.pack(q, d)[:2]
    with pytest.raises(ValueError, match="even width"):
        q8.q8_matmul(jnp.zeros((2, 33), jnp.float32), packed, scales, n=16, gated=True)


@needs_native
def test_two_parts_hold_activations_to_about_15_bits():
    rng = np.random.default_rng(8)
    q, d = random_weight(rng, 256, 64)
    packed, scales = q8.pack(q, d)
    x = rng.standard_normal((8, 256)).astype(np.float32)
    x[:, 5] = 100.0  # an outlier channel sets its group's scale
    exact = x.astype(np.float64) @ (q.astype(np.float64) * np.repeat(d, 32, axis=1)).T
    err1 = np.abs(run_kernel(x, packed, scales, 64, parts=1) - exact).max()
    err2 = np.abs(run_kernel(x, packed, scales, 64, parts=2) - exact).max()
    assert err2 < err1 / 100


@pytest.mark.skipif("avx2" not in ISAS, reason="this CPU has no AVX2")
@pytest.mark.parametrize("m", [AVX2_F32_MIN_ROWS - 1, AVX2_F32_MIN_ROWS, 64, 65, 200])
@pytest.mark.parametrize("offsets", [False, True])
def test_avx2_two_parts_on_many_rows_are_the_float_product(m, offsets):
    # From AVX2_F32_MIN_ROWS rows on the kernel multiplies the dequantized weights by x itself: as exact
    # as f32 allows, where the two int8 parts of fewer rows keep ~15 bits of each activation.
    q, d, off, packed, scales, packed_off, x = outlier_case(m, offsets)
    got = run_kernel(x, packed, scales, q.shape[0], "avx2", packed_off, parts=2)
    exact = exact_product(x, q, d, off)
    terms = exact_product(np.abs(x), np.abs(q.astype(np.int16)), d, None if off is None else np.abs(off))  # |x| |w|
    err = np.abs(got - exact).max()
    if m >= AVX2_F32_MIN_ROWS:
        assert err <= 1e-6 * terms.max()
    else:
        assert_close(got, oracle(x, q, d, off, parts=2), x, q, d, off)
        assert err > 1e-6 * terms.max()  # the int8 path's quantization shows: the check above can tell


@needs_native
@pytest.mark.parametrize("isa", ISAS)
def test_integer_inputs_are_exact(isa):
    # Groups whose max is 127 quantize exactly (scale 1), unit weight scales: y is an exact integer dot.
    rng = np.random.default_rng(1)
    m, k, n = 37, 96, 50
    x = rng.integers(-127, 128, (m, k)).astype(np.float32)
    x[:, ::32] = 127.0
    q = rng.integers(-128, 128, (n, k)).astype(np.int8)
    packed, scales = q8.pack(q, np.ones((n, k // 32), np.float32))
    want = x.astype(np.int64) @ q.T.astype(np.int64)
    np.testing.assert_array_equal(run_kernel(x, packed, scales, n, isa), want.astype(np.float32))


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 2, 9])
def test_two_parts_at_their_extremes_are_exact(isa, m):
    # Half-integer activations with 127 in every group: xs = 1, the first part rounds each value to an
    # even neighbour and the residual of +-0.5 quantizes to +-127 at xs / 254, so x = q0 + q1 / 254
    # exactly. With weights at -128 and 127 too, every int32 sum of the kernel is at its widest
    # (the kernel may combine the two parts' sums in int32: 254 * acc0 + acc1), and y is the exact dot
    # up to float rounding of its scales.
    rng = np.random.default_rng(m)
    k, n = 96, 40
    x = rng.integers(-127, 127, (m, k)).astype(np.float32) + 0.5
    x[:, ::32] = 127.0
    q = rng.choice(np.array([-128, 127], np.int8), (n, k))
    packed, scales = q8.pack(q, np.ones((n, k // 32), np.float32))
    want = x.astype(np.float64) @ q.T.astype(np.float64)
    got = run_kernel(x, packed, scales, n, isa, parts=2)
    terms = np.abs(x).astype(np.float64) @ np.abs(q.astype(np.float64)).T  # f32 rounding scales with these
    assert np.all(np.abs(got - want) <= 1e-6 * terms)


@needs_native
@pytest.mark.parametrize("m,parts", [(1, 1), (3, 1), (64, 1), (1, 2), (5, 2)])
def test_lm_head_shape(m, parts):
    # the oracle over 49152 outputs, once for every path
    rng = np.random.default_rng(m)
    k, n = 576, 49152
    q, d = random_weight(rng, k, n)
    packed, scales = q8.pack(q, d)
    x = rng.standard_normal((m, k)).astype(np.float32)
    want = oracle(x, q, d, parts=parts)
    for isa, got in run_on_every_isa(x, packed, scales, n, parts=parts).items():
        assert_close(got, want, x, q, d, err_msg=isa)


@needs_native
def test_prefill_sized_batch_matches_reference():
    rng = np.random.default_rng(7)
    m, k, n = 512, 1536, 576
    q, d = random_weight(rng, k, n)
    packed, scales = q8.pack(q, d)
    x = rng.standard_normal((m, k)).astype(np.float32)
    assert_close(run_kernel(x, packed, scales, n), run_reference(x, packed, scales, n), x, q, d)


@needs_native
def test_leading_axes_vector_and_bfloat16_inputs():
    rng = np.random.default_rng(3)
    q, d = random_weight(rng, 64, 40)
    packed, scales = q8.pack(q, d)
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    y = np.asarray(q8.q8_matmul(jnp.asarray(x), packed, scales, n=40))
    assert y.shape == (2, 3, 40)
    assert_close(y.reshape(6, 40), oracle(x.reshape(6, 64), q, d), x.reshape(6, 64), q, d)
    v = np.asarray(q8.q8_matmul(jnp.asarray(x[0, 0]), packed, scales, n=40))  # one row as a vector
    np.testing.assert_array_equal(v, y[0, 0])
    xb = jnp.asarray(x, jnp.bfloat16)
    assert q8.q8_matmul(xb, packed, scales, n=40).dtype == jnp.float32


@needs_native
@pytest.mark.parametrize("offsets,parts", [(False, 1), (True, 2)])
def test_stacked_weights_at_a_traced_layer_equal_each_weight_alone(offsets, parts):
    # A scanned layer loop passes a stack [L, ...] and the traced layer index; each layer's output
    # must be that layer's weight alone, native and reference alike.
    rng = np.random.default_rng(11)
    layers, m, k, n = 3, 2, 70, 40
    weights = []
    for _ in range(layers):
        q, d = random_weight(rng, k, n)
        off = f16(rng.standard_normal(d.shape) * 1e-2) if offsets else None
        weights.append(q8.pack(q, d, off))
    stack = [jnp.asarray(np.stack([w[i] for w in weights])) for i in range(len(weights[0]))]
    x = rng.standard_normal((layers, m, k)).astype(np.float32)

    def scanned(fn):
        def body(_, xs):
            xi, i = xs
            return None, fn(xi, *stack, n=n, parts=parts, layer=i)
        return jax.jit(lambda x: jax.lax.scan(body, None, (x, jnp.arange(layers, dtype=jnp.int32)))[1])

    got = np.asarray(scanned(q8.q8_matmul)(x))
    for i, w in enumerate(weights):
        alone = run_kernel(x[i], w[0], w[1], n, offsets=w[2] if offsets else None, parts=parts)
        np.testing.assert_array_equal(got[i], alone)
    def reference(x, packed, scales, offsets=None, *, n, parts, layer):
        return q8._reference_at(x, packed, scales, offsets, None, layer, n=n, parts=parts)

    with_reference = np.asarray(scanned(reference)(x))
    for i, w in enumerate(weights):
        want = run_reference(x[i], w[0], w[1], n, offsets=w[2] if offsets else None, parts=parts)
        np.testing.assert_array_equal(with_reference[i], want)


def test_stacked_weights_need_a_layer_and_a_layer_a_stack():
    q, d = random_weight(np.random.default_rng(5), 64, 32)
    packed, scales = q8.pack(q, d)
    with pytest.raises(ValueError, match="do not hold"):
        q8.q8_matmul(jnp.zeros((2, 64)), packed[None], scales[None], n=32)
    with pytest.raises(ValueError, match="do not hold"):
        q8.q8_matmul(jnp.zeros((2, 64)), packed, scales, n=32, layer=0)


def test_pack_round_trips():
    rng = np.random.default_rng(4)
    q, d = random_weight(rng, 70, 21)
    packed, scales = q8.pack(q, d)
    uq, ud = q8.unpack(jnp.asarray(packed), jnp.asarray(scales))
    np.testing.assert_array_equal(np.asarray(uq)[:21, :70], q)
    np.testing.assert_array_equal(np.asarray(uq)[:21, 70:], 0)
    np.testing.assert_array_equal(np.asarray(ud)[:21], d)
    np.testing.assert_array_equal(np.asarray(ud)[21:], 0)


def test_mismatched_weight_shape_is_rejected():
    q, d = random_weight(np.random.default_rng(5), 64, 32)
    packed, scales = q8.pack(q, d)
    with pytest.raises(ValueError, match="do not hold"):
        q8.q8_matmul(jnp.zeros((2, 96)), packed, scales, n=32)


def test_reference_forced_by_environment():
    # and f32_matmul's (tests/kernels/test_f32_matmul.py): one process for both
    code = ("import jax.numpy as jnp, numpy as np; from slipstream.kernels import q8_matmul as q8, f32_matmul as fm; "
            "from slipstream.kernels.native import kernel_paths; "
            "p, s = q8.pack(np.ones((16, 32), np.int8), np.ones((16, 1), np.float32)); "
            "w = fm.pack(np.ones((32, 16), np.float32)); "
            "print(float(q8.q8_matmul(jnp.ones((1, 32)), p, s, n=16)[0, 0]), kernel_paths()['q8_matmul'], "
            "float(fm.f32_matmul(jnp.ones((1, 32)), w, n=16)[0, 0]), kernel_paths()['f32_matmul'])")
    env = {**os.environ, "SLIPSTREAM_KERNELS": "reference", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.stdout.split() == ["32.0", "reference", "32.0", "reference"]


@needs_native
def test_profile_records_each_call():
    rng = np.random.default_rng(13)
    k, n = 576, 960
    q, d = random_weight(rng, k, n)
    packed, scales = q8.pack(q, d)
    x = rng.standard_normal((2, k)).astype(np.float32)
    run_kernel(x, packed, scales, n)  # compiled before recording
    ext.profile(True)
    try:
        run_kernel(x, packed, scales, n)
        run_kernel(x[:1], packed, scales, n)
    finally:
        calls = ext.profile(False)
    assert [(rows, nbytes) for _, _, rows, nbytes in calls] == [(2, packed.nbytes), (1, packed.nbytes)]
    assert all(end >= start for start, end, _, _ in calls) and calls[0][1] <= calls[1][0]
    assert ext.profile(False) == []  # recording stopped


def test_scales_and_offsets_are_stored_in_f16_and_other_dtypes_are_refused():
    # 16 bits per scale and offset: a 32-input group of one column streams 36 bytes, not 40; GGUF's
    # f16 block scales pass through unchanged
    rng = np.random.default_rng(21)
    q, d = random_weight(rng, 64, 20)
    m = f16(rng.standard_normal(d.shape) * 1e-2)
    packed, scales, offsets = q8.pack(q, d, m)
    assert scales.dtype == np.float16 and offsets.dtype == np.float16
    np.testing.assert_array_equal(np.asarray(q8.unpack_groups(jnp.asarray(scales)))[:20], d)
    np.testing.assert_array_equal(np.asarray(q8.unpack_groups(jnp.asarray(offsets)))[:20], m)
    x = jnp.ones((1, 64), jnp.float32)
    with pytest.raises(ValueError, match="f16"):
        q8.q8_matmul(x, packed, scales.astype(np.float32), n=20)
    with pytest.raises(ValueError, match="f16"):
        q8.q8_matmul(x, packed, scales, offsets.astype(np.float32), n=20)
    with pytest.raises(ValueError, match="not a finite f16"):
        q8.pack(q, d * 1e7)
