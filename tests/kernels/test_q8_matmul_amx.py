"""The Q8_0 matmul's AMX path (Intel CPUs whose OS grants the tile state): two-part calls of AMX_MIN_ROWS rows
or more whose weight comes with its tiles (pack_tiles, made at load) multiply x and the dequantized weights split
into bf16 hi + lo; below that, for one part, and without tiles, the AVX-512 VNNI path's bits. The property tests of tests/kernels/test_q8_matmul.py sample this path among the others."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from slipstream.kernels import q8_matmul as q8

from tests.kernels.test_q8_matmul import (AMX_MIN_ROWS, ISAS, assert_split_product_close, exact_product, f16,
                                          outlier_case, random_weight, run_kernel)

pytestmark = pytest.mark.skipif("amx" not in ISAS, reason="this CPU has no AMX-INT8/BF16, or the OS did not grant "
                                "the tile state (lscpu: amx_int8, amx_bf16)")


@pytest.mark.parametrize("m", [1, AMX_MIN_ROWS - 1, AMX_MIN_ROWS, AMX_MIN_ROWS + 1, 600])
@pytest.mark.parametrize("offsets", [False, True])
def test_amx_two_parts_are_the_float_product_from_its_row_count(m, offsets):
    # Row counts across the 256-row items: from AMX_MIN_ROWS on, closer to the float product than the two
    # int8 parts, whose quantization shows; below it, the VNNI path's bits.
    q, d, off, packed, scales, packed_off, x = outlier_case(m, offsets)
    n = q.shape[0]
    got = run_kernel(x, packed, scales, n, "amx", packed_off, parts=2)
    int8_parts = run_kernel(x, packed, scales, n, "avx512_vnni", packed_off, parts=2)
    if m >= AMX_MIN_ROWS:
        assert_split_product_close(got, x, q, d, off)
        exact = exact_product(x, q, d, off)
        assert np.abs(got - exact).mean() < np.abs(int8_parts - exact).mean() / 10  # ~20x here
    else:
        np.testing.assert_array_equal(got, int8_parts)


def test_one_part_calls_stay_on_the_vnni_bits():
    # q8_0 (one int8 part) never runs on the tile unit, whatever the row count.
    q, d, off, packed, scales, packed_off, x = outlier_case(AMX_MIN_ROWS + 1, True)
    n = q.shape[0]
    np.testing.assert_array_equal(run_kernel(x, packed, scales, n, "amx", packed_off),
                                  run_kernel(x, packed, scales, n, "avx512_vnni", packed_off))


def test_two_parts_without_tiles_stay_on_the_vnni_bits():
    q, d, off, packed, scales, packed_off, x = outlier_case(AMX_MIN_ROWS + 1, True)
    n = q.shape[0]
    np.testing.assert_array_equal(run_kernel(x, packed, scales, n, "amx", packed_off, parts=2, tiles=None),
                                  run_kernel(x, packed, scales, n, "avx512_vnni", packed_off, parts=2))


def test_tiles_of_another_weight_are_refused():
    q, d, off, packed, scales, packed_off, x = outlier_case(4, True)
    tiles = q8.pack_tiles(packed, scales, packed_off)
    with pytest.raises(ValueError, match="pack_tiles"):
        q8.q8_matmul(x, packed, scales, packed_off, n=q.shape[0], parts=2, tiles=tiles[:, :-32])


def test_fuse_q8_gives_a16_stacks_their_tiles_and_q8_0_none():
    from slipstream.quantization import groupwise
    from slipstream.quantization.layer_forms import fuse_q8

    w = np.random.default_rng(3).standard_normal((2, 64, 48)).astype(np.float32)
    a16 = fuse_q8([groupwise.quantize_weight(w, "q8_0-a16"), groupwise.quantize_weight(w[..., :32], "q8_0-a16")])
    assert a16.tiles is not None and a16.tiles.shape == (2, (48 + 32) // 16, 64 * 32)
    assert fuse_q8([groupwise.quantize_weight(w, "q8_0")]).tiles is None


def test_stacked_tiles_at_a_traced_layer_equal_each_weight_alone():
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
