"""The q8_matmul kernel's thread and prefetch policies (kernels._q8_matmul.threading / prefetch /
nontemporal): how many threads run the items, and how far ahead and with which cache hint the one-row path
prefetches, must not change any output."""
from __future__ import annotations

import numpy as np
import pytest

from slipstream.kernels import q8_matmul as q8
from tests.kernels.q8_cases import NATIVE, assert_close, needs_native, oracle, random_weight, run_kernel

if NATIVE:
    import slipstream.kernels._q8_matmul as ext


@needs_native
@pytest.mark.parametrize("max_threads", [1, 2, 0])
def test_thread_policy_does_not_change_results(max_threads):
    # which thread runs which item (one thread, two, the pool's) must not change any output
    rng = np.random.default_rng(12)
    k, n = 576, 960
    q, d = random_weight(rng, k, n)
    packed, scales = q8.pack(q, d)
    x = rng.standard_normal((3, k)).astype(np.float32)
    want = [run_kernel(x[:1], packed, scales, n), run_kernel(x, packed, scales, n, parts=2)]
    prev = ext.threading(max_threads)
    try:
        assert ext.threading() == max_threads
        for _ in range(3):
            np.testing.assert_array_equal(run_kernel(x[:1], packed, scales, n), want[0])
            np.testing.assert_array_equal(run_kernel(x, packed, scales, n, parts=2), want[1])
    finally:
        ext.threading(prev)


@needs_native
@pytest.mark.parametrize("distances", [(0, 0), (1024, 0), (512, 2048), (4096, 16384)])
def test_prefetch_distances_do_not_change_results(distances):
    # the one-row path's prefetches (near into L1, far into L2) run past a tile's end into the next
    # tile and past the weight's end; they must never change an output
    rng = np.random.default_rng(13)
    k, n = 1536, 600
    q, d = random_weight(rng, k, n)
    m = (rng.standard_normal(d.shape) * 1e-2).astype(np.float32)
    packed, scales, offsets = q8.pack(q, d, m)
    x = rng.standard_normal((1, k)).astype(np.float32)
    want = [run_kernel(x, packed, scales, n), run_kernel(x, packed, scales, n, offsets=offsets, parts=2)]
    prev = ext.prefetch(*distances)
    try:
        assert ext.prefetch() == tuple(distances)
        np.testing.assert_array_equal(run_kernel(x, packed, scales, n), want[0])
        np.testing.assert_array_equal(run_kernel(x, packed, scales, n, offsets=offsets, parts=2), want[1])
    finally:
        ext.prefetch(*prev)
    assert_close(want[0], oracle(x, q, d), x, q, d)
    assert_close(want[1], oracle(x, q, d, m, parts=2), x, q, d, m)
    with pytest.raises(ValueError, match="near <= 4096"):
        ext.prefetch(8192, 0)


@needs_native
@pytest.mark.parametrize("rows", [1, 3])
def test_prefetching_blocks_of_two_and_three_rows_do_not_change_results(rows):
    # micro blocks of 2-3 output rows prefetch their weights where prefetch_rows allows (calls of 2-3 rows, and
    # the last block of bigger ones); with 4-bit weights and offsets, one and two parts, a ragged last column tile
    rng = np.random.default_rng(14)
    k, n = 1536, 600
    q = rng.integers(0, 16, (n, k)).astype(np.int8)
    d = (rng.random((n, k // q8.GROUP)) * 1e-2).astype(np.float16).astype(np.float32)
    m = (rng.standard_normal(d.shape) * 1e-2).astype(np.float16).astype(np.float32)
    packed, scales, offsets = q8.pack(q, d, m, bits=4)
    xs = [rng.standard_normal((r, k)).astype(np.float32) for r in (2, 3, 7)]
    want = {(r.shape[0], p): run_kernel(r, packed, scales, n, offsets=offsets, parts=p) for r in xs for p in (1, 2)}
    prev = ext.prefetch_rows(rows)
    try:
        assert ext.prefetch_rows() == rows
        for x in xs:
            for parts in (1, 2):
                np.testing.assert_array_equal(run_kernel(x, packed, scales, n, offsets=offsets, parts=parts),
                                              want[(x.shape[0], parts)])
    finally:
        ext.prefetch_rows(prev)
    assert_close(want[(3, 2)], oracle(xs[1], q, d, m, parts=2), xs[1], q, d, m)
    with pytest.raises(ValueError, match="prefetch_rows"):
        ext.prefetch_rows(4)


@needs_native
@pytest.mark.parametrize("on", [False, True])
def test_nontemporal_prefetches_do_not_change_results(on):
    # the one-row path's weight prefetches with the non-temporal hint (the AMD default) or without
    rng = np.random.default_rng(14)
    k, n = 1536, 600
    q, d = random_weight(rng, k, n)
    packed, scales = q8.pack(q, d)
    x = rng.standard_normal((1, k)).astype(np.float32)
    prev = ext.nontemporal(on)
    try:
        assert ext.nontemporal(on) is on  # returns the previous setting: the one just set
        got = [run_kernel(x, packed, scales, n), run_kernel(x, packed, scales, n, parts=2)]
        ext.nontemporal(not on)
        np.testing.assert_array_equal(run_kernel(x, packed, scales, n), got[0])
        np.testing.assert_array_equal(run_kernel(x, packed, scales, n, parts=2), got[1])
    finally:
        ext.nontemporal(prev)
    assert_close(got[0], oracle(x, q, d), x, q, d)
    assert_close(got[1], oracle(x, q, d, parts=2), x, q, d)


@needs_native
def test_a_one_row_call_takes_the_vector_path_on_every_isa():
    # route() reports the dispatch: a decode's one-row call streams its weights on the vector path of the ISA chosen
    # (on AMX, AVX-512 VNNI's: tests/kernels/test_q8_matmul_amx.py checks the tile unit's row window)
    from tests.kernels.q8_cases import ISAS

    prev = ext.isa()
    try:
        for isa in ISAS:
            ext.set_isa(isa)
            for parts in (1, 2):
                assert ext.route(1, parts) == ("avx512_vnni" if isa == "amx" else isa)
        with pytest.raises(ValueError, match="rows >= 1"):
            ext.route(0, 2)
    finally:
        ext.set_isa(prev)
