"""The step's float K/V write into layout.py's "tokens" pages ([L, pages, ps, KV * 2 * hd], 16- or 32-bit) as a
Pallas TPU kernel, in place of layout.write_kv's XLA scatter (one row index per token, 70-95 ns each on the v5e:
2.0 ms of a Llama-3.2-1B 1024-token prefill step). It must not change a bit of what the scatter writes.

Mosaic moves a page's rows to and from HBM by whole memory tiles (bf16 (16, 128), f32 (8, 128)), so the unit of
work is a tile of R rows (R = 8 * P, P the values per 32-bit word: bf16 2, f32 1) across the whole row:
  - the step's tokens become work items, one per run of consecutive rows of one page (kv_write.work_items);
  - per item, the first and last tiles it touches are read from HBM into VMEM unless it fills them, the new
    rows are merged into the tiles in VMEM, and every touched tile is written back by one DMA each, in place
    (the cache is aliased to the output: no cache-sized copy);
  - items are pipelined over SLOTS buffer slots (PREFETCH items' reads ahead, one item's writes behind), as
    kv_write.py does; items touch distinct pages, so the reordered DMAs never meet.
The merge works on 32-bit words, so it moves bits, never values: the new rows come in (made by XLA, fused with
the K/V stacking the scatter does too) as words [C, rows / P, 128] (C = row width / 128; a word holds P
consecutive rows of one lane, the first row in the low bits, as pltpu.bitcast packs them), one column of
128 lanes after another, so that any 8 consecutive words of a column are one VMEM load whatever their start
(Mosaic loads 32-bit rows at any offset from an array of one lane tile). A tile's words are that load at the
tile's source start (bf16 at an odd row: two loads, each word's halves from two neighbours), masked into the
tile's old words where the item's rows end. Steps with more than CHUNK_BYTES of new rows are written in
several calls. VMEM: the call's words (at most CHUNK_BYTES + 3 tiles) and SLOTS pages of tiles (8B heads in
bf16: 6 x 512 KiB).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from slipstream.kernels.tpu.kv_write import work_items

LANES = 128
SUBLANES = 8         # 32-bit words per vreg column: a tile is SUBLANES words tall
PREFETCH = 4         # items whose reads are in flight ahead of the one merging (a decode item is mostly DMA latency)
SLOTS = PREFETCH + 2  # VMEM buffer slots: those reads, the item merging, and one item's writes in flight
CHUNK_BYTES = 16 << 20   # new rows' bytes per call (8B heads in bf16: 4096 tokens)
VMEM_CAP = 100 << 20


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def packing(dtype) -> int:
    """Rows per 32-bit word of a cache of `dtype`: 2 for 16-bit floats, 1 for 32-bit; 0 if the kernel does not
    take it."""
    return {2: 2, 4: 1}.get(jnp.dtype(dtype).itemsize, 0) if jnp.issubdtype(dtype, jnp.floating) else 0


def tile_rows(dtype) -> int:
    """Rows per memory tile, the DMA unit: 16 for bf16, 8 for f32."""
    return SUBLANES * packing(dtype)


def supports(kv: jax.ShapeDtypeStruct) -> bool:
    """Whether the kernel writes this "tokens" cache: 16/32-bit floats, whole tiles per page, whole lane tiles
    per row (else layout.write_kv's scatter)."""
    p = packing(kv.dtype)
    return kv.ndim == 4 and p > 0 and kv.shape[2] % (SUBLANES * p) == 0 and kv.shape[3] % LANES == 0


def _words(new: jax.Array, pad: int, rows: int) -> jax.Array:
    """new [T, W] (the cache's dtype) -> [W / 128, rows / P, 128] uint32: `pad` zero rows, the T rows, zero rows
    up to `rows`; word (c, i, l) holds rows P*i .. P*i + P - 1 of lane c * 128 + l, the first in its low bits."""
    t_len, width = new.shape
    p = packing(new.dtype)
    x = jnp.pad(new, ((pad, rows - pad - t_len), (0, 0)))                                 # [rows, W]
    if p == 1:
        w = jax.lax.bitcast_convert_type(x, jnp.uint32)
    else:
        # each row pair side by side in one row, then two lane-aligned halves: strided row slices
        # (u[0::2], u[1::2]) took 128 us a layer each in a 1B prefill step, in the column-major layout XLA
        # gave them
        u = jax.lax.bitcast_convert_type(x.reshape(rows // 2, 2 * width), jnp.uint16).astype(jnp.uint32)
        w = u[:, :width] | (u[:, width:] << 16)                                          # [rows/2, W]
    return jnp.transpose(w.reshape(rows // p, width // LANES, LANES), (1, 0, 2))


def _kernel(count_ref, page_ref, lo_ref, hi_ref, src_ref, layer_ref,            # scalar prefetch (SMEM)
            new_hbm, _kv_in, kv_hbm,                                              # HBM (kv: in place)
            new_buf, tiles, sems, src_sem, *, pack: int, pad: int):
    # new_buf [C, rows / P, 128] uint32; tiles [SLOTS, ps / R, R, W] in the cache's dtype
    n_tiles, r, width = tiles.shape[1], tiles.shape[2], tiles.shape[3]
    bits = 32 // pack
    n, layer = count_ref[0], layer_ref[0]

    def first_last(i):
        """The first and last tiles item i touches."""
        return jax.lax.div(lo_ref[i], r), jax.lax.div(hi_ref[i] - 1, r)

    def full(i, j):
        return (lo_ref[i] <= j * r) & (hi_ref[i] >= (j + 1) * r)

    def copy(i, slot, j, write: bool):
        rows = pl.ds(pl.multiple_of(j * r, r), r)
        hbm, vmem = kv_hbm.at[layer, page_ref[i], rows, :], tiles.at[slot, j]
        sem = sems.at[int(write), slot]
        return pltpu.make_async_copy(vmem, hbm, sem) if write else pltpu.make_async_copy(hbm, vmem, sem)

    def reads(i, slot, do):
        """The item's edge tiles it does not fill: the first, and the last if another."""
        j0, j1 = first_last(i)
        pl.when(~full(i, j0))(lambda: do(copy(i, slot, j0, False)))
        pl.when((j1 != j0) & ~full(i, j1))(lambda: do(copy(i, slot, j1, False)))

    def writes(i, slot, do):
        j0, j1 = first_last(i)

        def one(j, carry):
            do(copy(i, slot, j, True))
            return carry
        jax.lax.fori_loop(j0, j1 + 1, one, 0)

    def start(c):
        c.start()

    def wait(c):
        c.wait()

    def merge(i, slot):
        lo, hi, src = lo_ref[i], hi_ref[i], src_ref[i]
        j0, j1 = first_last(i)
        w = jax.lax.broadcasted_iota(jnp.int32, (SUBLANES, LANES), 0)

        def tile(j, carry):
            d = src + pad + j * r - lo                   # the source row of the tile's row 0 (>= 0)
            q, odd = jax.lax.div(d, pack), jnp.zeros((SUBLANES, LANES), jnp.int32) + jax.lax.rem(d, pack)
            mask = jnp.zeros((SUBLANES, LANES), jnp.uint32)
            for h in range(pack):                        # a word's rows j*r + P*w + h, kept where the item writes
                row = j * r + pack * w + h
                ones = jnp.uint32(((1 << bits) - 1) << (bits * h))
                mask = mask | jnp.where((row >= lo) & (row < hi), ones, jnp.uint32(0))
            for c in range(width // LANES):
                a = new_buf[c, pl.ds(q, SUBLANES), :]                                   # [8, 128]
                if pack == 2:   # an odd start: each word's rows are the high half of a and the low half of b
                    b = new_buf[c, pl.ds(q + 1, SUBLANES), :]
                    a = jnp.where(odd == 0, a, (a >> 16) | (b << 16))
                lanes = pl.ds(c * LANES, LANES)
                old = pltpu.bitcast(tiles[slot, j, :, lanes], jnp.uint32)                  # [8, 128]
                tiles[slot, j, :, lanes] = pltpu.bitcast((a & mask) | (old & ~mask), tiles.dtype)
            return carry
        jax.lax.fori_loop(j0, j1 + 1, tile, 0)

    src_copy = pltpu.make_async_copy(new_hbm, new_buf, src_sem.at[0])
    src_copy.start()
    for first in range(PREFETCH):
        pl.when(first < n)(lambda first=first: reads(first, first, start))
    src_copy.wait()

    def item(i, carry):
        slot, ahead = jax.lax.rem(i, SLOTS), i + PREFETCH

        @pl.when(ahead < n)
        def _prefetch():
            nxt = jax.lax.rem(ahead, SLOTS)

            @pl.when(ahead >= SLOTS)
            def _():   # the writes of the slot's previous item
                writes(ahead - SLOTS, nxt, wait)
            reads(ahead, nxt, start)

        reads(i, slot, wait)
        merge(i, slot)
        writes(i, slot, start)
        return carry

    jax.lax.fori_loop(0, n, item, 0)
    for back in range(SLOTS, 0, -1):   # the last items' writes
        last = n - back
        pl.when(last >= 0)(lambda last=last: writes(last, jax.lax.rem(last, SLOTS), wait))


def _write_chunk(kv, layer, new, page, offset, *, max_items, interpret):
    """One call: new [T, W] rows in the cache's dtype at (page [T], offset [T])."""
    t_len, width = new.shape
    _, num_pages, ps, _ = kv.shape
    pack = packing(kv.dtype)
    r = SUBLANES * pack
    items = work_items(page, offset, num_pages, min(max_items, t_len))
    # a tile's source starts up to r - 1 rows before its first token and reads 8 words past its start, one
    # more at an odd bf16 start
    rows = _round_up(r + t_len + 2 * r, r)
    src = _words(new, r, rows)                                                           # [C, rows/P, 128]
    scratch = [pltpu.VMEM(src.shape, jnp.uint32), pltpu.VMEM((SLOTS, ps // r, r, width), kv.dtype),
               pltpu.SemaphoreType.DMA((2, SLOTS)), pltpu.SemaphoreType.DMA((1,))]
    need = src.size * 4 + SLOTS * ps * width * kv.dtype.itemsize
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    call = pl.pallas_call(
        functools.partial(_kernel, pack=pack, pad=r),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6, grid=(1,), in_specs=[any_spec] * 2, out_specs=any_spec,
            scratch_shapes=scratch),
        out_shape=jax.ShapeDtypeStruct(kv.shape, kv.dtype),
        input_output_aliases={7: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                             vmem_limit_bytes=min(VMEM_CAP, need + (16 << 20))),
        interpret=pltpu.InterpretParams() if interpret else False, name="kv_write_float")
    return call(*items, jnp.asarray(layer, jnp.int32).reshape(1), src, kv)


def write(kv: jax.Array, layer: jax.Array, rows: jax.Array, page: jax.Array, offset: jax.Array, *,
          max_items: int | None = None, chunk_tokens: int | None = None, interpret: bool = False) -> jax.Array:
    """layout.write_kv for the float "tokens" form: rows [T, W] (the cache's dtype, made as the scatter makes
    them) into kv [L, pages, ps, W] at (layer, page [T], offset [T]); a page outside [0, num_pages) writes
    nothing. A page's tokens must be consecutive in T with consecutive offsets (one run per page and step, as
    ragged steps have). max_items bounds the runs (default T); chunk_tokens: tokens per call (default:
    CHUNK_BYTES of rows); interpret: Pallas' TPU interpreter (tests on CPU)."""
    if not supports(kv) or rows.dtype != kv.dtype or rows.shape[1:] != kv.shape[3:]:
        raise ValueError(f"the float K/V write takes a 16/32-bit float cache of layout.py's tokens form, its pages "
                         f"whole {tile_rows(kv.dtype) or 'memory'}-row tiles and its rows whole 128-lane tiles, and "
                         f"rows of its dtype and width; got cache {kv.dtype.name} {kv.shape}, rows "
                         f"{rows.dtype.name} {rows.shape} (use layout.write_kv's scatter)")
    t_len, width = rows.shape
    chunk = chunk_tokens or max(SUBLANES, CHUNK_BYTES // (width * kv.dtype.itemsize) // SUBLANES * SUBLANES)
    max_items = t_len if max_items is None else max_items
    for t0 in range(0, t_len, chunk):
        t1 = min(t_len, t0 + chunk)
        kv = _write_chunk(kv, layer, rows[t0:t1], page[t0:t1], offset[t0:t1], max_items=max_items,
                          interpret=interpret)
    return kv
