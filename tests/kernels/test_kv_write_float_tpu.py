"""The Pallas float K/V write (kernels/tpu/kv_write_float.py), in Pallas' TPU interpret mode on CPU, leaves the
"tokens" cache bit for bit as layout.write_kv's scatter does, and every row the step does not write as it was:
decode rows, prefill chunks starting mid-tile (at odd and even rows) and spanning tiles and pages, padding
tokens, several sequences and layers, steps split over several calls; bf16 (paired and unpaired heads of 64),
f16 and f32; -0.0, infinities, NaN payloads and subnormals."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from slipstream.kernels.ragged_tokens import quantize_kv
from slipstream.kernels.tpu import kv_write_float, layout
from tests.kernels.test_kv_write_tpu import NUM_PAGES, _step   # the same steps as the int8 write's tests

BITS = {2: np.uint16, 4: np.uint32}


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(BITS[x.dtype.itemsize])


def _kv(rng, t_len: int, kvh: int, hd: int, dtype, special: bool = False):
    k = rng.standard_normal((t_len, kvh, hd)).astype(np.float32)
    v = rng.standard_normal((t_len, kvh, hd)).astype(np.float32) * 3
    k, v = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
    if special:   # values a conversion or arithmetic on the way could change: each bit pattern must land as is
        info = jnp.finfo(dtype)
        odd = [-0.0, jnp.inf, -jnp.inf, info.smallest_subnormal, -info.smallest_subnormal * 3, info.max]
        k = k.at[0, 0, :len(odd)].set(jnp.asarray(odd, dtype))
        nan = jax.lax.bitcast_convert_type(jnp.asarray([0x7FC1, 0xFF81, 0x7F82], jnp.uint16), jnp.bfloat16) \
            if jnp.dtype(dtype) == jnp.bfloat16 else jnp.asarray([jnp.nan] * 3, dtype)
        v = v.at[-1, -1, :3].set(nan)
    return k, v


def _check(dtype, hd: int, kvh: int, ps: int, steps, seed: int = 0, special: bool = False, **kw):
    """steps: [(layer, runs, padding tokens)], written one after another into one cache."""
    rng = np.random.default_rng(seed)
    shape = layout.shapes(2, kvh, NUM_PAGES, ps, hd, dtype)["kv"].shape
    cache = {"kv": jnp.asarray(rng.standard_normal(shape), dtype)}
    want, got, written = cache, cache, np.zeros(shape[:3], bool)
    for layer, runs, pad in steps:
        page, offset = _step(runs, ps, pad)
        k, v = _kv(rng, page.shape[0], kvh, hd, dtype, special)
        layer = jnp.int32(layer)
        want = jax.jit(lambda c, k, v, p, o, layer=layer: layout.write_kv(  # one program, not op by op
            c, layer, k, v, p, o, quantize_kv, float_write="scatter"))(want, k, v, page, offset)
        got = jax.jit(lambda c, k, v, p, o, layer=layer: layout.write_kv(
            c, layer, k, v, p, o, quantize_kv, float_write="kernel", interpret=True, **kw))(got, k, v, page, offset)
        real = np.asarray(page) < NUM_PAGES
        written[int(layer), np.asarray(page)[real], np.asarray(offset)[real]] = True
    before, after = _bits(cache["kv"]), _bits(got["kv"])
    assert (after[written] != before[written]).any(), "the steps write their rows"
    np.testing.assert_array_equal(after[~written], before[~written], err_msg="rows the steps do not write")
    np.testing.assert_array_equal(after, _bits(want["kv"]), err_msg="the kernel against the scatter")


# layer 1: decode rows mid-tile, at a tile's first and last rows and a page's last row; a 70-token chunk from
# position 13 (mid-tile, its source at an odd row from the tile's: rows 13..31 of page 2, page 5 whole, 19 rows
# of page 0), then padding; layer 0: a decode, a chunk whose source starts at an even row from the tile's, and
# the chunk of a fresh sequence (the prefill case: whole tiles from a page's start, nothing read back; it ends
# mid-tile)
RAGGED = [(1, [([4], 21, 1), ([1], 16, 1), ([2, 5, 0], 13, 70), ([3], 15, 1), ([6], 31, 1)], 3),
          (0, [([2], 20, 1), ([3, 1], 11, 40), ([6, 4], 0, 43)], 1)]


@pytest.mark.parametrize("dtype,hd,kvh", [pytest.param(jnp.bfloat16, 64, 2, id="bf16_paired_hd64"),
                                          pytest.param(jnp.float32, 128, 1, id="f32_hd128")])
def test_decodes_and_chunks_from_mid_tile_over_pages_and_layers(dtype, hd, kvh):
    _check(dtype, hd, kvh, 32, RAGGED)


def test_unpaired_heads_f16_and_values_that_must_not_be_converted():
    # 3 heads of 64 ([K_0 | V_0 | K_1 | ...], 384 lanes) in f16 with 16-token pages (one tile each); -0.0,
    # infinities, subnormals and the largest value
    _check(jnp.float16, 64, 3, 16, [(1, [([4, 2], 9, 12), ([5], 0, 1)], 1)], seed=1, special=True)


def test_bf16_nan_payloads_and_a_step_over_several_calls(monkeypatch):
    # 24-token calls (CHUNK_BYTES of 256-lane bf16 rows) split runs mid-tile; max_items = T // ps + 2 * sequences;
    # NaNs with payloads and signs
    monkeypatch.setattr(kv_write_float, "CHUNK_BYTES", 24 * 256 * 2)
    _check(jnp.bfloat16, 128, 1, 32, [(1, [([2, 5, 0], 27, 50), ([1], 5, 1), ([4], 28, 4)], 2)], seed=3,
           special=True, max_items=57 // 32 + 2 * 3)


def test_pages_or_rows_that_do_not_tile_keep_the_scatter():
    # bf16 pages of 8 rows (half a (16, 128) tile) and rows of 64 lanes: write_kv scatters even with the kernel
    # chosen; the kernel itself refuses them
    rng = np.random.default_rng(5)
    for ps, hd, kvh in ((8, 64, 2), (16, 32, 1)):
        shape = layout.shapes(1, kvh, NUM_PAGES, ps, hd, jnp.bfloat16)["kv"].shape
        cache = {"kv": jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)}
        assert not kv_write_float.supports(cache["kv"])
        page, offset = _step([([1, 2], 3, 9)], ps)
        k, v = _kv(rng, page.shape[0], kvh, hd, jnp.bfloat16)
        got = layout.write_kv(cache, jnp.int32(0), k, v, page, offset, quantize_kv, interpret=True)
        want = layout.write_kv(cache, jnp.int32(0), k, v, page, offset, quantize_kv, float_write="scatter")
        np.testing.assert_array_equal(_bits(got["kv"]), _bits(want["kv"]))
        with pytest.raises(ValueError, match="float K/V write takes"):
            kv_write_float.write(cache["kv"], jnp.int32(0), jnp.zeros((1, shape[-1]), jnp.bfloat16),
                                 page[:1], offset[:1], interpret=True)


def test_write_kv_rejects_an_unknown_float_write():
    cache = {"kv": jnp.zeros(layout.shapes(1, 1, 2, 16, 128, jnp.bfloat16)["kv"].shape, jnp.bfloat16)}
    k = jnp.zeros((1, 1, 128), jnp.float32)
    with pytest.raises(ValueError, match="float_write must be one of"):
        layout.write_kv(cache, jnp.int32(0), k, k, jnp.asarray([0]), jnp.asarray([0]), quantize_kv,
                        float_write="dma")


def test_the_default_write_off_the_tpu_is_the_scatter():
    # the kernel is the default float write (layout.FLOAT_WRITE), but Mosaic code runs only on a TPU or in
    # Pallas' interpreter: elsewhere (this CPU, interpret off) write_kv scatters rather than failing to lower
    assert layout.FLOAT_WRITE == "kernel" and jax.default_backend() != "tpu"
    rng = np.random.default_rng(6)
    shape = layout.shapes(2, 2, NUM_PAGES, 32, 64, jnp.bfloat16)["kv"].shape
    cache = {"kv": jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)}
    page, offset = _step([([2, 5], 30, 20), ([3], 8, 1)], 32, pad=1)
    k, v = _kv(rng, page.shape[0], 2, 64, jnp.bfloat16)
    lowered = jax.jit(lambda c: layout.write_kv(c, jnp.int32(1), k, v, page, offset, quantize_kv)).lower(cache)
    assert "kv_write_float" not in lowered.as_text() and "scatter" in lowered.as_text()
