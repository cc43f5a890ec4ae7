"""The step's int8 K/V write into layout.py's per-head pages ("split" and "lanes") as a Pallas TPU kernel, in
place of layout.write_kv's XLA scatter (16 row indices and 16 scale indices per token at 8 KV heads, each
40-95 ns on the v5e).

Mosaic moves int8 to and from HBM by whole (32, 128) tiles, so the unit of work is a 32-row tile of a page:
  - the step's tokens become work items, one per run of consecutive rows of one page (`work_items`): a
    decode is one item of one row, a prefill chunk one item per page it touches, its edge pages partly filled;
  - per item, one strided DMA per touched tile reads [KV, 2, 32, hd] ("split"; "lanes": [KV, 32, 2hd]) of all
    heads' K and V into VMEM (skipped for a tile the item fills), and one DMA the page's scales [KV, 2, ps];
  - the new rows are merged into the tiles and scales, and the same DMAs write them back, in place (the cache
    is aliased to the output: no cache-sized copy);
  - items are pipelined over SLOTS buffer slots: items i + 1 and i + 2's reads are in flight while item i
    merges, and item i's writes complete during item i + 1. Items touch distinct pages (a page is written by one sequence,
    in one run of rows), so the reordered DMAs never meet.

The new K/V are quantized outside the kernel by the same `quantize` callable the scatter uses (the cache
content is bit-identical) and DMA'd whole into VMEM token-major, [rows, KV * 2 * hd] int8 and their scales
[KV * 2, tokens] f32, padded so every window below stays inside. A tile's new rows are a shifted window of
that source: WINDOW = 64 rows at a 32-aligned offset picked by a one-hot [32, 64] matmul on the MXU (exact: one
product of an int8 value and 1 per output), or copied as they lie when the item's rows start where the
tile does; the scales' window is a dynamic lane rotation. Steps with more tokens than CHUNK_BYTES of
source are written in several calls.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

TILE = 32            # int8 rows per (32, 128) memory tile: the DMA unit
LANES = 128
PREFETCH = 2         # items whose reads are in flight ahead of the one merging (a DMA outlasts a decode's merge)
SLOTS = PREFETCH + 2  # VMEM buffer slots: those reads, the item merging, and one item's writes in flight
PAD_ROWS = TILE      # source rows before token 0: a tile's window may start up to 31 rows before its first token
WINDOW = 2 * TILE    # source rows under a tile's one-hot matmul (its contraction): any 32 rows from a 32-aligned start
CHUNK_BYTES = 16 << 20   # int8 source bytes per call (8B heads: 8192 tokens)
VMEM_CAP = 100 << 20
DOT_DTYPE = jnp.int8     # the one-hot matmul's operands by default (int8 or bfloat16: both exact)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def work_items(page: jax.Array, offset: jax.Array, num_pages: int, max_items: int):
    """Runs of tokens with consecutive offsets in one page, in token order: (count [1], page, first row,
    end row (exclusive), first token) [max_items] each. Tokens with page outside [0, num_pages) are
    padding and write nothing. max_items must bound the count (ragged steps: T // ps + 2 * sequences)."""
    t_len = page.shape[0]
    valid = (page >= 0) & (page < num_pages)
    cont = valid[1:] & valid[:-1] & (page[1:] == page[:-1]) & (offset[1:] == offset[:-1] + 1)
    start = valid & ~jnp.concatenate([jnp.zeros((1,), bool), cont])                       # [T]
    end = valid & ~jnp.concatenate([cont, jnp.zeros((1,), bool)])
    k = jnp.arange(max_items, dtype=jnp.int32)[:, None]
    # the k-th start (end): how many tokens have fewer than k + 1 starts (ends) up to them; one fused compare
    first = jnp.sum(jnp.cumsum(start)[None, :] <= k, axis=1)                              # [M]
    last = jnp.sum(jnp.cumsum(end)[None, :] <= k, axis=1)
    first, last = jnp.minimum(first, t_len - 1), jnp.minimum(last, t_len - 1)
    count = jnp.minimum(jnp.sum(start), max_items).astype(jnp.int32).reshape(1)
    i32 = jnp.int32
    return count, page[first].astype(i32), offset[first].astype(i32), (offset[last] + 1).astype(i32), \
        first.astype(i32)


def _kernel(count_ref, page_ref, lo_ref, hi_ref, src_ref, layer_ref,                 # scalar prefetch (SMEM)
            new_hbm, new_sc_hbm, _kv_in, _sc_in, kv_hbm, sc_hbm,                     # HBM (kv, sc: in place)
            new_buf, new_sc_buf, tiles, scales, sc_tmp, sems, src_sems, *, dot_dtype):
    # tiles [SLOTS, ps / 32] + a tile of all heads: split [KV, 2, 32, hd], lanes [KV, 32, 2hd]
    split = tiles.ndim == 6
    n_tiles, kvh, piece_w = tiles.shape[1], tiles.shape[2], tiles.shape[-1]
    ps = n_tiles * TILE
    pieces = [(h, c) for h in range(kvh) for c in range(2)] if split else [(h,) for h in range(kvh)]
    win_sc, pad_sc = _sc_window(ps), _sc_pad(ps)
    n = count_ref[0]
    layer = layer_ref[0]

    def hbm_tile(page, j):
        rows = pl.ds(j * TILE, TILE)
        return kv_hbm.at[layer, page, :, :, rows, :] if split else kv_hbm.at[layer, page, :, rows, :]

    def span(i, j):
        """Whether item i's rows touch tile j, and whether they fill it."""
        lo, hi = lo_ref[i], hi_ref[i]
        return (lo < (j + 1) * TILE) & (hi > j * TILE), (lo <= j * TILE) & (hi >= (j + 1) * TILE)

    def copies(i, slot, write: bool):
        """Item i's DMAs between its page and buffer `slot`, each with its predicate: reads fetch the
        touched tiles the item does not fill and the scales unless it fills the page; writes store every
        touched tile and the scales."""
        page = page_ref[i]
        sem = sems.at[int(write), slot]
        out = []
        for j in range(n_tiles):
            touched, full = span(i, j)
            hbm, vmem = hbm_tile(page, j), tiles.at[slot, j]
            out.append((touched if write else touched & ~full,
                        pltpu.make_async_copy(vmem, hbm, sem) if write else pltpu.make_async_copy(hbm, vmem, sem)))
        whole = (lo_ref[i] == 0) & (hi_ref[i] == ps)
        hbm, vmem = sc_hbm.at[layer, page], scales.at[slot]
        out.append((None if write else ~whole,
                    pltpu.make_async_copy(vmem, hbm, sem) if write else pltpu.make_async_copy(hbm, vmem, sem)))
        return out

    def start(cs):
        for pred, c in cs:
            c.start() if pred is None else pl.when(pred)(c.start)

    def wait(cs):
        for pred, c in cs:
            c.wait() if pred is None else pl.when(pred)(c.wait)

    def merge(i, slot):
        lo, hi, src = lo_ref[i], hi_ref[i], src_ref[i]
        for j in range(n_tiles):
            touched, full = span(i, j)
            d = src + PAD_ROWS + j * TILE - lo          # the source row of the tile's row 0 (> 0)
            a = pl.multiple_of(jax.lax.div(d, TILE) * TILE, TILE)
            s = d - a                                    # 0..31
            as_lies = full & (s == 0)

            @pl.when(touched & as_lies)
            def _copy():
                rows = new_buf[pl.ds(a, TILE), :]                                          # [32, KV*2*hd]
                for p, idx in enumerate(pieces):
                    tiles[(slot, j) + idx] = rows[:, p * piece_w:(p + 1) * piece_w]

            @pl.when(touched & ~as_lies)
            def _shifted():
                win = new_buf[pl.ds(a, WINDOW), :]                                         # [64, KV*2*hd]
                r = jax.lax.broadcasted_iota(jnp.int32, (TILE, WINDOW), 0)
                col = jax.lax.broadcasted_iota(jnp.int32, (TILE, WINDOW), 1)
                row = j * TILE + r
                pick = (col == r + s) & (row >= lo) & (row < hi)                           # [32, 64] one-hot
                if dot_dtype == jnp.int8:
                    new = jnp.dot(pick.astype(jnp.int32).astype(jnp.int8), win, preferred_element_type=jnp.int32)
                else:   # conversions through f32 (int8 -> f32 as int8_matmul.py does)
                    one = jnp.where(pick, 1.0, 0.0).astype(dot_dtype)
                    new = jnp.dot(one, win.astype(jnp.float32).astype(dot_dtype),
                                  preferred_element_type=jnp.float32).astype(jnp.int32)           # [32, KV*2*hd]
                row = j * TILE + jax.lax.broadcasted_iota(jnp.int32, (TILE, piece_w), 0)
                keep = (row >= lo) & (row < hi)
                for p, idx in enumerate(pieces):
                    old = tiles[(slot, j) + idx].astype(jnp.int32)                         # [32, hd]
                    tiles[(slot, j) + idx] = jnp.where(keep, new[:, p * piece_w:(p + 1) * piece_w],
                                                       old).astype(jnp.int8)

        # scales: lane l of the page <- source token src + l - lo, a rotated window of whole lane tiles
        d = src + pad_sc - lo                                                              # > 0
        a = pl.multiple_of(jax.lax.div(d, LANES) * LANES, LANES)
        win = new_sc_buf[:, pl.ds(a, win_sc)]                                              # [KV*2, win]
        shift = jax.lax.rem(win_sc - (d - a), win_sc)                                      # in [0, win)
        sc_tmp[...] = pltpu.roll(win, shift, 1)[:, :ps]                                    # [KV*2, ps]
        lane = jax.lax.broadcasted_iota(jnp.int32, (2, ps), 1)
        keep = (lane >= lo) & (lane < hi)
        for h in range(kvh):
            scales[slot, h] = jnp.where(keep, sc_tmp[2 * h:2 * h + 2, :], scales[slot, h])

    src_copies = (pltpu.make_async_copy(new_hbm, new_buf, src_sems.at[0]),
                  pltpu.make_async_copy(new_sc_hbm, new_sc_buf, src_sems.at[1]))
    for c in src_copies:
        c.start()

    for first in range(PREFETCH):
        pl.when(first < n)(lambda first=first: start(copies(first, first, False)))

    for c in src_copies:
        c.wait()

    def item(i, carry):
        slot, ahead = jax.lax.rem(i, SLOTS), i + PREFETCH

        @pl.when(ahead < n)
        def _prefetch():
            nxt = jax.lax.rem(ahead, SLOTS)

            @pl.when(ahead >= SLOTS)
            def _():   # the writes of the slot's previous item
                wait(copies(ahead - SLOTS, nxt, True))
            start(copies(ahead, nxt, False))

        wait(copies(i, slot, False))
        merge(i, slot)
        start(copies(i, slot, True))
        return carry

    jax.lax.fori_loop(0, n, item, 0)
    for back in range(SLOTS, 0, -1):   # the last items' writes
        last = n - back

        @pl.when(last >= 0)
        def _():
            wait(copies(last, jax.lax.rem(last, SLOTS), True))


def _sc_pad(ps: int) -> int:
    """Source scale lanes before token 0: a page's window starts up to ps - 1 tokens before its first."""
    return _round_up(ps, LANES)


def _sc_window(ps: int) -> int:
    """Lanes of a page's scale window: ps past any offset inside one lane tile."""
    return LANES + _round_up(ps, LANES)


def _write_chunk(kv, sc, layer, new, new_sc, page, offset, *, max_items, dot_dtype, interpret):
    """One call: new [T, KV * 2 * hd] int8 (token-major, a token's K and V per head in the cache's order),
    new_sc [T, KV, 2] f32, at (page [T], offset [T])."""
    t_len, width = new.shape
    split = kv.ndim == 6
    kvh, ps = kv.shape[2], kv.shape[4 if split else 3]
    items = work_items(page, offset, kv.shape[1], min(max_items, t_len))
    rows = _round_up(PAD_ROWS + t_len + WINDOW, TILE)
    new = jnp.pad(new, ((PAD_ROWS, rows - PAD_ROWS - t_len), (0, 0)))                        # [R, KV*2*hd]
    lanes = _round_up(_sc_pad(ps) + t_len + _sc_window(ps), LANES)
    new_sc = jnp.pad(new_sc.reshape(t_len, 2 * kvh).T, ((0, 0), (_sc_pad(ps), lanes - _sc_pad(ps) - t_len)))
    tile = (kvh, 2, TILE, kv.shape[-1]) if split else (kvh, TILE, kv.shape[-1])
    scratch = [pltpu.VMEM(new.shape, jnp.int8), pltpu.VMEM(new_sc.shape, jnp.float32),
               pltpu.VMEM((SLOTS, ps // TILE) + tile, jnp.int8),
               pltpu.VMEM((SLOTS, kvh, 2, ps), jnp.float32), pltpu.VMEM((2 * kvh, ps), jnp.float32),
               pltpu.SemaphoreType.DMA((2, SLOTS)), pltpu.SemaphoreType.DMA((2,))]
    # the source, its scales (sublanes padded to 8), the slots, and the merge's [64, width] f32 temporaries
    need = new.size + 8 * new_sc.shape[1] * 4 * -(-2 * kvh // 8) + SLOTS * (ps * width + kvh * 8 * ps * 4) \
        + 6 * WINDOW * width * 4
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    call = pl.pallas_call(
        functools.partial(_kernel, dot_dtype=dot_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6, grid=(1,), in_specs=[any_spec] * 4, out_specs=[any_spec] * 2,
            scratch_shapes=scratch),
        out_shape=(jax.ShapeDtypeStruct(kv.shape, kv.dtype), jax.ShapeDtypeStruct(sc.shape, sc.dtype)),
        input_output_aliases={8: 0, 9: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                             vmem_limit_bytes=min(VMEM_CAP, need + (16 << 20))),
        interpret=pltpu.InterpretParams() if interpret else False, name="kv_write_int8")
    return call(*items, jnp.asarray(layer, jnp.int32).reshape(1), new, new_sc, kv, sc)


def write(kv_cache: dict, layer: jax.Array, k_new: jax.Array, v_new: jax.Array, page: jax.Array,
          offset: jax.Array, quantize, *, max_items: int | None = None, chunk_tokens: int | None = None,
          dot_dtype=None, interpret: bool = False) -> dict:
    """layout.write_kv for the int8 forms ("split" [L, pages, KV, 2, ps, hd], "lanes" [L, pages, KV, ps, 2hd],
    scales [L, pages, KV, 2, ps]): K/V [T, KV, hd] quantized by `quantize` at (page [T], offset [T]); a page
    outside [0, num_pages) writes nothing. A page's tokens must be consecutive in T with consecutive offsets
    (one run per page and step, as ragged steps have). max_items bounds the runs (default T); chunk_tokens:
    tokens per call (default: CHUNK_BYTES of int8 source); dot_dtype: the one-hot matmul's operands (int8 or
    bfloat16, both exact; default DOT_DTYPE); interpret: Pallas' TPU interpreter (tests on CPU)."""
    kv, sc = kv_cache["kv"], kv_cache.get("kv_scale")
    if kv.dtype != jnp.int8 or kv.ndim not in (5, 6) or sc is None:
        raise ValueError(f"the int8 K/V write takes an int8 cache of layout.py's split or lanes form with "
                         f"kv_scale, got {({k: (v.dtype.name, v.shape) for k, v in kv_cache.items()})}")
    split = kv.ndim == 6
    ps = kv.shape[4 if split else 3]
    if ps % TILE:
        raise ValueError(f"the int8 K/V write moves whole {TILE}-row tiles: page size {ps} is not a multiple "
                         f"of {TILE} (use layout.write_kv's scatter)")
    t_len, kvh, hd = k_new.shape
    (kq, ks), (vq, vs) = quantize(k_new), quantize(v_new)                   # [T, KV, hd] int8, [T, KV] f32
    new = jnp.stack([kq, vq], axis=2) if split else jnp.concatenate([kq, vq], axis=-1)
    new = new.reshape(t_len, kvh * 2 * hd).astype(jnp.int8)               # [T, KV*2*hd]
    new_sc = jnp.stack([ks, vs], axis=2).astype(jnp.float32)               # [T, KV, 2]
    chunk = chunk_tokens or max(TILE, CHUNK_BYTES // (kvh * 2 * hd) // TILE * TILE)
    max_items = t_len if max_items is None else max_items
    for t0 in range(0, t_len, chunk):
        t1 = min(t_len, t0 + chunk)
        kv, sc = _write_chunk(kv, sc, layer, new[t0:t1], new_sc[t0:t1], page[t0:t1], offset[t0:t1],
                              max_items=max_items, dot_dtype=jnp.dtype(dot_dtype or DOT_DTYPE),
                              interpret=interpret)
    return {**kv_cache, "kv": kv, "kv_scale": sc}
