"""The Q8_0 matmul's AMX path (Intel CPUs whose OS grants the tile state): calls of AMX_MIN_ROWS rows or more
with 8- or 4-bit weights run on the int8 tile unit and give the AVX-512 VNNI path's outputs bit for bit, for one and
two activation parts, so a row's output never depends on how many rows its call has; two-part calls of more than
64 rows with 4-bit weights run on the bf16 tile unit with the VNNI path's integers, with the same outputs. With a q8_0-a16 weight's
pack_tiles (made at load only with SLIPSTREAM_AMX_BF16=1) two-part calls of that many rows multiply x and the
dequantized weights split into bf16 hi + lo instead. The property tests of tests/kernels/test_q8_matmul.py
sample the int8 path among the others."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from slipstream.kernels import q8_matmul as q8

from tests.kernels.q8_cases import (AMX_MIN_ROWS, ISAS, assert_split_product_close, exact_product, f16, outlier_case,
                                    random_weight, run_kernel)

if "amx" in ISAS:
    import slipstream.kernels._q8_matmul as ext

pytestmark = pytest.mark.skipif("amx" not in ISAS, reason="this CPU has no AMX-INT8/BF16, or the OS did not grant "
                                "the tile state (lscpu: amx_int8, amx_bf16)")

# around the tile path's threshold, its 16-row tiles (two parts: 8 input rows a tile) and its 256-row items
ROW_COUNTS = [1, 7, 8, 9, 15, 16, 17, AMX_MIN_ROWS - 1, AMX_MIN_ROWS, AMX_MIN_ROWS + 1, 255, 256, 257, 600]


@pytest.fixture(params=["default", "every call"])
def tile_rows(request):
    """The int8 tile unit's row window: the kernel's default (two-part calls of 4..64 rows), or every call whatever
    its rows and parts."""
    prev = ext.amx_rows(1, 1 << 30, 1, -1) if request.param == "every call" else None
    yield request.param
    if prev:
        ext.amx_rows(*prev)


@pytest.mark.parametrize("m", ROW_COUNTS)
@pytest.mark.parametrize("parts", [1, 2])
def test_amx_equals_vnni_bit_for_bit_at_every_row_count(m, parts, tile_rows):
    # odd K and N (a partial group and a partial column tile), offsets, an outlier column
    q, d, off, packed, scales, packed_off, x = outlier_case(m, True)
    n = q.shape[0]
    for offsets in (None, packed_off):
        np.testing.assert_array_equal(run_kernel(x, packed, scales, n, "amx", offsets, parts=parts),
                                      run_kernel(x, packed, scales, n, "avx512_vnni", offsets, parts=parts))


@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 8, 9, 16, 17, 64, 65, 300])
@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("gated", [False, True])
def test_four_bit_weights_on_the_tile_unit_equal_vnni(m, parts, gated, tile_rows):
    # 4-bit packing (the default model's Q4_1 layers): the tile path widens each group's nibbles to a B tile and
    # adds no bias back; its outputs are the VNNI path's bit for bit, on tiles of fewer than 16 act rows (a call of
    # 1-7 input rows with two parts) as on whole ones, with and without offsets
    _four_bit_amx_equals_vnni(np.random.default_rng(m * 4 + parts * 2 + gated), m, 75, parts, gated)


def _four_bit_amx_equals_vnni(rng, m: int, n: int, parts: int, gated: bool) -> None:
    """4-bit weights (k = 333: 11 groups, a partial last one), with and without offsets: the amx ISA's outputs are
    the VNNI path's bit for bit."""
    k = 333
    q = rng.integers(0, 16, (n, k)).astype(np.int8)
    d = f16(rng.random((n, -(-k // q8.GROUP))) * 1e-2)
    off = f16(rng.standard_normal(d.shape) * 1e-2)
    x = rng.standard_normal((m, 2 * k if gated else k)).astype(np.float32)
    x[:, 7] = 50.0
    for offsets in (None, off):
        packed, scales, *rest = q8.pack(q, d, offsets, bits=4)
        packed_off = rest[0] if rest else None
        np.testing.assert_array_equal(
            run_kernel(x, packed, scales, n, "amx", packed_off, parts=parts, gated=gated),
            run_kernel(x, packed, scales, n, "avx512_vnni", packed_off, parts=parts, gated=gated))


@pytest.fixture
def many_row_path_from_one_row():
    """The bf16 tile path of many rows (TileQ4Bf16, the default for two-part calls of more than 64 rows with 4-bit
    weights) for every two-part call with 4-bit weights that reaches the tile unit."""
    prev = ext.q4_bf16_rows(1)
    yield
    ext.q4_bf16_rows(prev)


@pytest.mark.parametrize("m", [8, 9, 16, 17, 24, 65, 257])
@pytest.mark.parametrize("gated", [False, True])
def test_many_row_bf16_tiles_equal_vnni(m, gated, many_row_path_from_one_row):
    # many-row calls sum each group's 254 * xq0 + xq1 (split into exact bf16 hi + lo) times the nibbles on the bf16
    # tile unit, exactly in f32: still the VNNI path's outputs bit for bit. Whole 16-row tiles and partial last
    # ones; 13 column tiles (several chunks, a partial last one), 11 groups (a partial last one)
    _four_bit_amx_equals_vnni(np.random.default_rng(m * 2 + gated), m, 200, 2, gated)


def test_a_row_is_the_same_alone_and_in_a_tile_unit_call(tile_rows):
    # what speculative verification relies on: row i of a many-row call equals the one-row call on row i
    q, d, off, packed, scales, packed_off, x = outlier_case(AMX_MIN_ROWS + 3, True)
    n = q.shape[0]
    for parts in (1, 2):
        whole = run_kernel(x, packed, scales, n, "amx", packed_off, parts=parts)
        for i in (0, 17, AMX_MIN_ROWS + 2):
            np.testing.assert_array_equal(whole[i:i + 1], run_kernel(x[i:i + 1], packed, scales, n, "amx", packed_off,
                                                                     parts=parts))


def test_stacked_weights_at_a_traced_layer_on_the_tile_unit_equal_vnni(tile_rows):
    import jax

    rng = np.random.default_rng(5)
    layers, m, k, n = 3, AMX_MIN_ROWS, 70, 40
    weights = []
    for _ in range(layers):
        q, d = random_weight(rng, k, n)
        weights.append(q8.pack(q, d, f16(rng.standard_normal(d.shape) * 1e-2)))
    stack = [jnp.asarray(np.stack([w[i] for w in weights])) for i in range(3)]
    x = rng.standard_normal((layers, m, k)).astype(np.float32)

    def body(_, xs):
        xi, i = xs
        return None, q8.q8_matmul(xi, *stack, n=n, parts=2, layer=i)

    got = np.asarray(jax.jit(lambda x: jax.lax.scan(body, None, (x, jnp.arange(layers, dtype=jnp.int32)))[1])(x))
    for i, (packed, scales, packed_off) in enumerate(weights):
        np.testing.assert_array_equal(got[i], run_kernel(x[i], packed, scales, n, "avx512_vnni", packed_off, parts=2))


@pytest.mark.parametrize("m", [1, AMX_MIN_ROWS - 1, AMX_MIN_ROWS, AMX_MIN_ROWS + 1, 600])
@pytest.mark.parametrize("offsets", [False, True])
def test_bf16_tiles_give_the_float_product_from_their_row_count(m, offsets):
    # With pack_tiles, two-part calls from AMX_MIN_ROWS on are closer to the float product than the two int8
    # parts, whose quantization shows; below it, the VNNI path's bits.
    q, d, off, packed, scales, packed_off, x = outlier_case(m, offsets)
    n = q.shape[0]
    got = run_kernel(x, packed, scales, n, "amx", packed_off, parts=2, tiles=q8.pack_tiles(packed, scales, packed_off))
    int8_parts = run_kernel(x, packed, scales, n, "avx512_vnni", packed_off, parts=2)
    if m >= AMX_MIN_ROWS:
        assert_split_product_close(got, x, q, d, off)
        exact = exact_product(x, q, d, off)
        assert np.abs(got - exact).mean() < np.abs(int8_parts - exact).mean() / 10  # ~20x here
    else:
        np.testing.assert_array_equal(got, int8_parts)


def test_tiles_of_another_weight_are_refused():
    q, d, off, packed, scales, packed_off, x = outlier_case(4, True)
    tiles = q8.pack_tiles(packed, scales, packed_off)
    with pytest.raises(ValueError, match="pack_tiles"):
        q8.q8_matmul(x, packed, scales, packed_off, n=q.shape[0], parts=2, tiles=tiles[:, :-32])


@pytest.mark.parametrize("bf16", ["1", None])
def test_fuse_q8_gives_a16_stacks_bf16_tiles_only_when_asked(monkeypatch, bf16):
    from slipstream.quantization import groupwise
    from slipstream.quantization.layer_packing import fuse_q8

    if bf16:
        monkeypatch.setenv("SLIPSTREAM_AMX_BF16", bf16)
    else:
        monkeypatch.delenv("SLIPSTREAM_AMX_BF16", raising=False)
    w = np.random.default_rng(3).standard_normal((2, 64, 48)).astype(np.float32)
    a16 = fuse_q8([groupwise.quantize_weight(w, "q8_0-a16"), groupwise.quantize_weight(w[..., :32], "q8_0-a16")])
    if bf16:
        assert a16.tiles is not None and a16.tiles.shape == (2, (48 + 32) // 16, 64 * 32)
    else:
        assert a16.tiles is None  # the int8 tile path needs no copy
    assert fuse_q8([groupwise.quantize_weight(w, "q8_0")]).tiles is None


def test_stacked_bf16_tiles_at_a_traced_layer_equal_each_weight_alone():
    # the kernel finds layer i's tiles in a stack [L, ...] as it finds its packed weight
    import jax

    rng = np.random.default_rng(5)
    layers, m, k, n = 3, AMX_MIN_ROWS, 70, 40
    weights = []
    for _ in range(layers):
        q, d = random_weight(rng, k, n)
        off = f16(rng.standard_normal(d.shape) * 1e-2)
        packed, scales, packed_off = q8.pack(q, d, off)
        weights.append((packed, scales, packed_off, q8.pack_tiles(packed, scales, packed_off)))
    stack = [jnp.asarray(np.stack([w[i] for w in weights])) for i in range(4)]
    x = rng.standard_normal((layers, m, k)).astype(np.float32)

    def body(_, xs):
        xi, i = xs
        return None, q8.q8_matmul(xi, *stack[:3], n=n, parts=2, layer=i, tiles=stack[3])

    got = np.asarray(jax.jit(lambda x: jax.lax.scan(body, None, (x, jnp.arange(layers, dtype=jnp.int32)))[1])(x))
    for i, (packed, scales, packed_off, tiles) in enumerate(weights):
        np.testing.assert_array_equal(got[i], run_kernel(x[i], packed, scales, n, "amx", packed_off, parts=2, tiles=tiles))


def test_one_to_three_row_calls_stay_on_vnni_and_short_tails_leave_the_tile_unit():
    # the default dispatch (route() reports it; no timing): a decode's one-row calls and calls of 2-3 rows stream their
    # weights on the VNNI path, where the tile path costs 1.2-1.6x; two-part calls of 4-64 rows run on the int8 tile
    # unit, and a last row tile of 1-3 input rows after whole ones (a verification of 9 or 17 rows) runs on VNNI
    prev = ext.set_isa("amx")
    try:
        for parts in (1, 2):
            assert ext.route(1, parts) == "avx512_vnni"
        for m in (2, 3):
            assert ext.route(m, 2) == "avx512_vnni"
        for m in (4, 5, 7, 8, 12, 13, 16, 20, 64):
            assert ext.route(m, 2) == "amx_int8", m
        for m in (9, 10, 11, 17, 19, 57):
            assert ext.route(m, 2) == "amx_int8 + avx512_vnni", m
        assert ext.route(8, 1) == "avx512_vnni"  # one-part calls stay on VNNI
        assert ext.route(65, 2) == "avx512_vnni"
        assert ext.route(64, 2, True) == "amx_bf16" and ext.route(63, 2, True) == "amx_int8"
        # many-row two-part calls with 4-bit weights: the bf16 tile unit on the VNNI path's integers (TileQ4Bf16)
        assert ext.route(65, 2, False, 4) == ext.route(256, 2, False, 4) == "amx_q4_bf16"
        assert ext.route(64, 2, False, 4) == "amx_int8" and ext.route(256, 1, False, 4) == "avx512_vnni"
    finally:
        ext.set_isa(prev)
