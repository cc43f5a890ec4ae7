"""The Pallas int8 K/V write (kernels/tpu/kv_write.py), in Pallas' TPU interpret mode on CPU, leaves the cache
bit for bit as layout.write_kv's scatter does: decode rows, prefill chunks starting mid-tile and spanning
tiles and pages (and at a page's start), padding tokens, several sequences in one step, steps split over
several calls, for the "split" (hd 128) and "lanes" (hd 64) forms."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from slipstream.kernels.ragged_tokens import quantize_kv
from slipstream.kernels.tpu import kv_write, layout

NUM_PAGES = 7


def _cache(rng, hd: int, ps: int) -> dict:
    shapes = layout.shapes(2, 2, NUM_PAGES, ps, hd, jnp.int8)
    return {"kv": jnp.asarray(rng.integers(-127, 128, shapes["kv"].shape), jnp.int8),
            "kv_scale": jnp.asarray(rng.random(shapes["kv_scale"].shape), jnp.float32)}


def _step(runs, ps: int, pad: int = 0):
    """Tokens of sequences [(page list, first position, token count)] in order, then `pad` padding tokens
    (page == NUM_PAGES): (page [T], offset [T])."""
    page, offset = [], []
    for pages, pos0, n in runs:
        pos = np.arange(pos0, pos0 + n)
        page += [pages[p] for p in pos // ps]
        offset += list(pos % ps)
    page += [NUM_PAGES] * pad
    offset += [3] * pad
    return jnp.asarray(page, jnp.int32), jnp.asarray(offset, jnp.int32)


def _check(hd: int, ps: int, runs, pad: int = 0, seed: int = 0, **kw):
    rng = np.random.default_rng(seed)
    cache = _cache(rng, hd, ps)
    page, offset = _step(runs, ps, pad)
    k = jnp.asarray(rng.standard_normal((page.shape[0], 2, hd)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((page.shape[0], 2, hd)) * 3, jnp.float32)
    layer = jnp.int32(1)
    # (jitted: one program, not an eager dispatch of each of the scatter's ops)
    want = jax.jit(lambda c, k, v, p, o: layout.write_kv(c, layer, k, v, p, o, quantize_kv, int8_write="scatter"))(
        cache, k, v, page, offset)
    got = jax.jit(lambda c, k, v, p, o: kv_write.write(c, layer, k, v, p, o, quantize_kv, interpret=True, **kw))(
        cache, k, v, page, offset)
    for name in ("kv", "kv_scale"):
        changed = np.asarray(want[name]) != np.asarray(cache[name])
        assert changed.any(), f"the step writes {name}"
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)


# the split form also with the merge's one-hot matmul in bf16 (exact for int8 values too); the default operands
# write the split form in the tests below and the lanes form here
FORMS = [pytest.param(128, jnp.bfloat16, id="split_hd128_bf16_one_hot"), pytest.param(64, None, id="lanes_hd64")]


@pytest.mark.parametrize("hd,dot_dtype", FORMS)
def test_decodes_and_a_chunk_from_mid_tile_over_pages_with_padding(hd, dot_dtype):
    # decode rows mid-tile, at a tile's first and last rows and a page's last row; a 150-token chunk from
    # position 45: rows 45..63 of page 2 (a partial tile, then a whole one), pages 5 and 0 whole, 3 rows of
    # page 4; then padding tokens (page == num_pages)
    runs = [([4], 37, 1), ([1, 6], 64, 1), ([2, 5, 0, 4], 45, 150), ([3], 31, 1), ([6], 63, 1)]
    _check(hd, 64, runs, pad=3, dot_dtype=dot_dtype)


def test_chunk_from_a_page_start_and_128_token_pages():
    # tiles filled from their first row (copied as they lie), a chunk ending mid-tile, 128-token pages
    runs = [([3, 1], 0, 160), ([5], 64, 40)]
    _check(128, 128, runs, seed=2)


def test_a_step_over_several_calls_and_a_tight_item_bound():
    # two 24-token calls: the first ends at position 60 of a run crossing into its second page (mid-tile);
    # max_items = T // ps + 2 * sequences
    runs = [([2, 5], 37, 30), ([1], 5, 1), ([4], 60, 4)]
    _check(128, 64, runs, pad=2, seed=3, chunk_tokens=24, max_items=37 // 64 + 2 * 3)


def test_work_items_are_runs_of_a_page():
    page = jnp.asarray([3, 3, 3, 1, 1, 7, 2, 2, 7], jnp.int32)     # 7 == num_pages: padding
    offset = jnp.asarray([5, 6, 7, 0, 1, 0, 9, 10, 0], jnp.int32)
    count, pages, lo, hi, src = (np.asarray(x) for x in kv_write.work_items(page, offset, 7, 9))
    assert count[0] == 3
    assert pages[:3].tolist() == [3, 1, 2] and lo[:3].tolist() == [5, 0, 9] and hi[:3].tolist() == [8, 2, 11]
    assert src[:3].tolist() == [0, 3, 6]


def test_rejects_pages_that_do_not_tile():
    rng = np.random.default_rng(0)
    cache = _cache(rng, 128, 16)
    k = jnp.zeros((1, 2, 128), jnp.float32)
    with pytest.raises(ValueError, match="multiple of 32"):
        kv_write.write(cache, jnp.int32(0), k, k, jnp.asarray([0]), jnp.asarray([0]), quantize_kv, interpret=True)


def test_write_kv_rejects_an_unknown_int8_write():
    cache = _cache(np.random.default_rng(0), 128, 64)
    k = jnp.zeros((1, 2, 128), jnp.float32)
    with pytest.raises(ValueError, match="int8_write must be one of"):
        layout.write_kv(cache, jnp.int32(0), k, k, jnp.asarray([0]), jnp.asarray([0]), quantize_kv, int8_write="dma")


def test_the_default_write_off_the_tpu_is_the_scatter():
    # the kernel is the default int8 write (layout.INT8_WRITE), but Mosaic code runs only on a TPU or in Pallas'
    # interpreter: elsewhere (this CPU, interpret off) write_kv takes the scatter rather than failing to lower
    assert layout.INT8_WRITE == "kernel" and jax.default_backend() != "tpu"
    rng = np.random.default_rng(5)
    cache = _cache(rng, 128, 64)
    page, offset = _step([([2, 5], 50, 30), ([3], 40, 1)], 64, pad=1)
    k = jnp.asarray(rng.standard_normal((page.shape[0], 2, 128)), jnp.float32)
    got = layout.write_kv(cache, jnp.int32(1), k, k * 2, page, offset, quantize_kv)
    want = layout.write_kv(cache, jnp.int32(1), k, k * 2, page, offset, quantize_kv, int8_write="scatter")
    for name in ("kv", "kv_scale"):
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)
