"""The Q8_0 matmul's AMX path (Intel CPUs whose OS grants the tile state): two-part calls of AMX_MIN_ROWS rows
or more multiply x and the dequantized weights split into bf16 hi + lo; below that, and for one part, the
AVX-512 VNNI path's bits. The property tests of tests/kernels/test_q8_matmul.py sample this path among the others."""
from __future__ import annotations

import numpy as np
import pytest

from tests.kernels.test_q8_matmul import (AMX_MIN_ROWS, ISAS, assert_split_product_close, exact_product,
                                          outlier_case, run_kernel)

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
