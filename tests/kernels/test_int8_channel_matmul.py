"""The per-output-channel int8 matmul (kernels/int8_channel_matmul.py): its outputs equal the numpy reference of
the same integer and float steps bit for bit on every instruction set, and a row's output is the same whatever the
call's row count and whether the tile unit (AMX) or VNNI formed its sums: what speculative decoding and batch
invariance rely on."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from slipstream.kernels import int8_channel_matmul as icm
from slipstream.kernels import native
from tests.kernels.isas import runnable_isas

NATIVE = icm.native_available()
if NATIVE:
    import slipstream.kernels._int8_channel_matmul as ext
ISAS = runnable_isas(ext, ("amx", "avx512_vnni", "portable")) if NATIVE else []
needs_native = pytest.mark.skipif(not NATIVE, reason="slipstream.kernels._int8_channel_matmul is not built")
needs_amx = pytest.mark.skipif("amx" not in ISAS, reason="this CPU has no AMX-INT8, or the OS did not grant the tile "
                               "state (lscpu: amx_int8)")

ROWS = [1, 3, 17, 64, 257]


def case(rng, m: int, k: int, n: int):
    """x with an outlier row and a zero row, q over the whole -127..127 range with a zero column."""
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[m // 2] *= 50.0
    if m > 2:
        x[1] = 0.0
    q = rng.integers(-127, 128, (k, n)).astype(np.int8)
    q[:, n // 3] = 0
    scale = (rng.random(n) * 1e-2).astype(np.float32)
    return x, q, scale


def residual_case(rng, k: int, n: int, scale):
    """A residual weight over the whole -127..127 range (a zero column elsewhere than q's) and its scale / 254."""
    r = rng.integers(-127, 128, (k, n)).astype(np.int8)
    r[:, n // 2] = 0
    return r, (scale / np.float32(254)).astype(np.float32)


def run(x, q, scale, parts, isa=None, amx_rows=None, residual=None):
    """The kernel's outputs (numpy), on `isa` (None: this CPU's best) with the tile unit from `amx_rows` rows;
    residual: (r [K, N], its scale [N]) or None."""
    packed, scales, colsum = (jnp.asarray(a) for a in icm.pack(q, scale))
    lo = None if residual is None else tuple(jnp.asarray(a) for a in icm.pack(*residual))
    prev_isa = ext.set_isa(isa) if isa else None
    prev_rows = ext.amx_rows(amx_rows) if amx_rows else None
    try:
        return np.asarray(icm.int8_channel_matmul(jnp.asarray(x), packed, scales, colsum, n=q.shape[1], parts=parts,
                                                  residual=lo))
    finally:
        if prev_isa:
            ext.set_isa(prev_isa)
        if prev_rows:
            ext.amx_rows(prev_rows)


@needs_native
@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("m", ROWS)
def test_kernel_equals_the_reference_bit_for_bit_on_every_isa(m, parts):
    # K not a multiple of 64 (nor of 4), N not a multiple of 16
    x, q, scale = case(np.random.default_rng(m), m, 201, 37)
    want = icm.reference_numpy(x, q, scale, parts)
    for isa in ISAS:
        for amx_rows in ((1, 1 << 30) if isa == "amx" else (None,)):
            np.testing.assert_array_equal(run(x, q, scale, parts, isa, amx_rows), want, err_msg=f"{isa} {amx_rows}")


@needs_native
@pytest.mark.parametrize("parts", [1, 2])
def test_wide_outputs_in_several_column_chunks_equal_the_reference(parts):
    # 98 column tiles: the tile unit splits them into chunks of up to 48 (the last one odd-sized), 257 rows into two
    # row blocks
    x, q, scale = case(np.random.default_rng(9), 257, 100, 1560)
    want = icm.reference_numpy(x, q, scale, parts)
    for isa in ISAS:
        np.testing.assert_array_equal(run(x, q, scale, parts, isa, 1 if isa == "amx" else None), want, err_msg=isa)


@needs_native
@pytest.mark.parametrize("parts", [1, 2])
def test_a_row_is_the_same_alone_and_in_a_call_of_many_rows(parts):
    x, q, scale = case(np.random.default_rng(5), 257, 576, 200)
    paths = [("avx512_vnni" if "avx512_vnni" in ISAS else ISAS[0], None)]
    if "amx" in ISAS:
        paths += [("amx", 1), ("amx", 1 << 30)]  # the tile unit at every row count, and never
    outs = [run(x, q, scale, parts, isa, rows) for isa, rows in paths]
    for other in outs[1:]:
        np.testing.assert_array_equal(other, outs[0])
    for i in (0, 1, 128, 256):  # a one-row call takes the decode path
        for isa, rows in paths:
            np.testing.assert_array_equal(run(x[i:i + 1], q, scale, parts, isa, rows), outs[0][i:i + 1])


@needs_native
@pytest.mark.parametrize("m", [1, 2, 3, 4, 17, 300])
def test_fused_residual_equals_the_reference_bit_for_bit_on_every_isa(m):
    # odd K and N; 1-3 rows take the VNNI stream / micro blocks, 4 on take the tile unit where it is chosen (and
    # amx_rows forces either way); 300 rows: two row tile pairs' worth of blocks and a partial one
    rng = np.random.default_rng(20 + m)
    x, q, scale = case(rng, m, 201, 37)
    residual = residual_case(rng, 201, 37, scale)
    want = icm.reference_numpy(x, q, scale, 2, residual)
    for isa in ISAS:
        for amx_rows in ((1, 1 << 30) if isa == "amx" else (None,)):
            got = run(x, q, scale, 2, isa, amx_rows, residual)
            np.testing.assert_array_equal(got, want, err_msg=f"{isa} {amx_rows}")
            for i in sorted({0, m // 2, m - 1}):  # a row alone equals itself in the batch
                np.testing.assert_array_equal(run(x[i:i + 1], q, scale, 2, isa, amx_rows, residual), want[i:i + 1],
                                              err_msg=f"{isa} {amx_rows} row {i}")


@needs_native
def test_fused_residual_equals_the_sum_of_two_calls_and_reads_a_stack_at_a_layer():
    # the fused sequence is the two calls' (q on two parts + the residual on one, added) float for float
    rng = np.random.default_rng(12)
    x = rng.standard_normal((6, 100)).astype(np.float32)
    layers = [case(rng, 1, 100, 30)[1:] for _ in range(2)]
    layers = [(q, s, *residual_case(rng, 100, 30, s)) for q, s in layers]
    for q, s, r, sr in layers:
        np.testing.assert_array_equal(run(x, q, s, 2, residual=(r, sr)), run(x, q, s, 2) + run(x, r, sr, 1))
    packs = [(icm.pack(q, s), icm.pack(r, sr)) for q, s, r, sr in layers]
    stack = [jnp.asarray(np.stack([p[w][i] for p in packs])) for w in range(2) for i in range(3)]
    f = jax.jit(lambda x, layer: icm.int8_channel_matmul(x, *stack[:3], n=30, parts=2, layer=layer,
                                                         residual=tuple(stack[3:])))
    for i, (q, s, r, sr) in enumerate(layers):
        np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x), jnp.int32(i))),
                                      icm.reference_numpy(x, q, s, 2, (r, sr)))


@pytest.mark.parametrize("kernels", ["native", "reference"])
def test_a_row_range_multiplies_only_its_rows_into_another_calls_output(monkeypatch, kernels):
    # the hybrid weights' second call (quantization/layer_forms.StackedHybrid): rows [begin, end) as a full call
    # gives them, the others kept from `into`, in place; the range clamped to the rows
    if kernels == "native" and not NATIVE:
        pytest.skip("slipstream.kernels._int8_channel_matmul is not built")
    if kernels == "reference":
        monkeypatch.setitem(native._paths, "int8_channel_matmul", "reference")
    rng = np.random.default_rng(31)
    x, q, scale = case(rng, 21, 130, 40)
    residual = residual_case(rng, 130, 40, scale)
    w = tuple(jnp.asarray(a) for a in icm.pack(q, scale))
    lo = tuple(jnp.asarray(a) for a in icm.pack(*residual))
    full = np.asarray(icm.int8_channel_matmul(jnp.asarray(x), *w, n=40, parts=2, residual=lo))
    into = jnp.full((21, 40), 7.0, jnp.float32)
    f = jax.jit(lambda x, b, e, into: icm.int8_channel_matmul(x, *w, n=40, parts=2, residual=lo, rows=(b, e),
                                                              into=into))
    for begin, end in ((0, 21), (5, 9), (20, 1 << 30), (9, 9), (-3, 2)):
        got = np.asarray(f(jnp.asarray(x), jnp.int32(begin), jnp.int32(end), into))
        inside = (np.arange(21) >= begin) & (np.arange(21) < end)
        if kernels == "native":
            np.testing.assert_array_equal(got[inside], full[inside], err_msg=f"{begin}..{end}")
        else:  # XLA's programs, one jitted and one not, may round an ulp apart
            np.testing.assert_allclose(got[inside], full[inside], rtol=1e-5, atol=1e-6, err_msg=f"{begin}..{end}")
        assert (got[~inside] == 7.0).all(), f"{begin}..{end}"
    with pytest.raises(ValueError, match="residual"):
        icm.int8_channel_matmul(jnp.asarray(x), *w, n=40, parts=2, rows=(0, 3))
    with pytest.raises(ValueError, match="into"):
        icm.int8_channel_matmul(jnp.asarray(x), *w, n=40, parts=2, residual=lo, rows=(0, 3), into=into[:3])


@needs_amx
def test_tile_unit_and_vnni_agree_on_wide_k():
    # a long int32 chain (K = 1536, the default model's down projection) near the int8 extremes
    rng = np.random.default_rng(3)
    x = np.where(rng.random((40, 1536)) < 0.5, -1.0, 1.0).astype(np.float32)
    q = np.where(rng.random((1536, 48)) < 0.5, -127, 127).astype(np.int8)
    scale = np.ones(48, np.float32)
    for parts in (1, 2):
        np.testing.assert_array_equal(run(x, q, scale, parts, "amx", 1), run(x, q, scale, parts, "avx512_vnni"))
        np.testing.assert_array_equal(run(x, q, scale, parts, "amx", 1), icm.reference_numpy(x, q, scale, parts))


def test_two_parts_hold_activations_to_about_15_bits():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 512)).astype(np.float32)
    q = rng.integers(-127, 128, (512, 32)).astype(np.int8)
    scale = np.ones(32, np.float32)
    exact = x.astype(np.float64) @ q.astype(np.float64)
    err = [np.abs(icm.reference_numpy(x, q, scale, parts) - exact).max() for parts in (1, 2)]
    bound = np.abs(x).max(axis=1, keepdims=True) / 127 * np.abs(q).sum(axis=0) / 2  # half a step per product
    assert err[0] <= bound.max() and err[1] <= bound.max() / 200 and err[1] < err[0] / 50


def test_jax_reference_is_close_to_the_numpy_reference():
    rng = np.random.default_rng(2)
    x, q, scale = case(rng, 17, 130, 40)
    packed, scales, _ = icm.pack(q, scale)
    for parts in (1, 2):
        got = np.asarray(icm.reference(jnp.asarray(x), jnp.asarray(packed), jnp.asarray(scales), n=40, parts=parts))
        np.testing.assert_allclose(got, icm.reference_numpy(x, q, scale, parts), rtol=1e-5, atol=1e-5)
    r, sr = residual_case(rng, 130, 40, scale)
    lo, lo_scales, _ = icm.pack(r, sr)
    got = np.asarray(icm.reference(jnp.asarray(x), jnp.asarray(packed), jnp.asarray(scales), n=40, parts=2,
                                   residual=(jnp.asarray(lo), jnp.asarray(lo_scales))))
    want = icm.reference_numpy(x, q, scale, 2, (r, sr))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(want - icm.reference_numpy(x, q, scale, 2)).max() > 1e-3   # the residual's term is there


@needs_native
def test_stacked_weights_at_a_traced_layer_equal_each_weight_alone():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, 100)).astype(np.float32)
    layers = [case(rng, 1, 100, 30)[1:] for _ in range(3)]
    packs = [icm.pack(q, s) for q, s in layers]
    stack = [jnp.asarray(np.stack([p[i] for p in packs])) for i in range(3)]
    f = jax.jit(lambda x, layer: icm.int8_channel_matmul(x, *stack, n=30, parts=2, layer=layer))
    for i, (q, s) in enumerate(layers):
        np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x), jnp.int32(i))), icm.reference_numpy(x, q, s, 2))


def test_pack_round_trips_and_sums_columns():
    q = np.random.default_rng(6).integers(-127, 128, (70, 33)).astype(np.int8)
    packed, scales, colsum = icm.pack(q, np.ones(33, np.float32))
    assert packed.shape == (3, 128 * 16) and scales.shape == colsum.shape == (48,)
    np.testing.assert_array_equal(icm.unpack(packed)[:70, :33], q)
    np.testing.assert_array_equal(colsum[:33], q.sum(axis=0))
    jp, js, jc = icm.pack_jax(jnp.asarray(q), jnp.ones(33, jnp.float32))
    np.testing.assert_array_equal(np.asarray(jp), packed)
    np.testing.assert_array_equal(np.asarray(jc), colsum)


def test_bad_shapes_and_values_are_rejected():
    q = np.zeros((64, 16), np.int8)
    packed, scales, colsum = (jnp.asarray(a) for a in icm.pack(q, np.ones(16, np.float32)))
    with pytest.raises(ValueError, match="do not hold a"):
        icm.int8_channel_matmul(jnp.ones((2, 65)), packed, scales, colsum, n=16)
    with pytest.raises(ValueError, match="do not hold a"):
        icm.int8_channel_matmul(jnp.ones((2, 64)), packed, scales, colsum, n=17)
    with pytest.raises(ValueError, match="parts must be 1 or 2"):
        icm.int8_channel_matmul(jnp.ones((2, 64)), packed, scales, colsum, n=16, parts=3)
    with pytest.raises(ValueError, match="int8"):
        icm.int8_channel_matmul(jnp.ones((2, 64)), packed.astype(jnp.uint8), scales, colsum, n=16)
    with pytest.raises(ValueError, match="needs parts = 2"):
        icm.int8_channel_matmul(jnp.ones((2, 64)), packed, scales, colsum, n=16, parts=1,
                                residual=(packed, scales, colsum))
    wide = tuple(jnp.asarray(a) for a in icm.pack(np.zeros((64, 32), np.int8), np.ones(32, np.float32)))
    with pytest.raises(ValueError, match="residual packed .* do not hold a"):
        icm.int8_channel_matmul(jnp.ones((2, 64)), packed, scales, colsum, n=16, parts=2, residual=wide)
    with pytest.raises(ValueError, match="-127..127"):
        icm.pack(np.full((4, 4), -128, np.int8), np.ones(4, np.float32))
    with pytest.raises(ValueError, match="int8 q"):
        icm.pack(q.astype(np.int16), np.ones(16, np.float32))


@needs_native
def test_reference_forced_by_environment(monkeypatch):
    x, q, scale = case(np.random.default_rng(8), 3, 64, 16)
    monkeypatch.setitem(native._paths, "int8_channel_matmul", "reference")
    packed, scales, colsum = (jnp.asarray(a) for a in icm.pack(q, scale))
    got = np.asarray(icm.int8_channel_matmul(jnp.asarray(x), packed, scales, colsum, n=16, parts=2))
    np.testing.assert_allclose(got, icm.reference_numpy(x, q, scale, 2), rtol=1e-5, atol=1e-5)
    r, sr = residual_case(np.random.default_rng(9), 64, 16, scale)   # and with a residual weight, in a stack
    lo = tuple(jnp.asarray(a)[None] for a in icm.pack(r, sr))
    got = np.asarray(icm.int8_channel_matmul(jnp.asarray(x), packed[None], scales[None], colsum[None], n=16, parts=2,
                                             layer=0, residual=lo))
    np.testing.assert_allclose(got, icm.reference_numpy(x, q, scale, 2, (r, sr)), rtol=1e-5, atol=1e-5)
