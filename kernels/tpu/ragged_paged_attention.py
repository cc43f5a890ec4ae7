"""Ragged paged attention on TPU (Pallas/Mosaic) over the merged page layout of kernels/tpu/layout.py.

The step's new K/V are written into their pages (in place, layout.write_kv), then two calls of one
kernel attend, each over a list of work items (a sequence and a block of its query rows): blocks of
`decode_rows` rows for the sequences feeding that few tokens, blocks of `prefill_rows` for the rest.
Per item the kernel walks the sequence's pages `pages_per_block` at a time, each page one DMA of all KV
heads' K and V. Blocks are fetched `prefetch` ahead in the call's order, across items (an item's
last block computing while the next item's first blocks arrive), into prefetch + 1 buffer slots. A KV
head's query-head group (G rows per token) attends together (online_softmax.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from slipstream.kernels.ragged_tokens import quantize_kv, token_layout
from slipstream.kernels.tpu import layout, online_softmax
from slipstream.kernels.tpu.online_softmax import LANES, MASK_VALUE


# Blocks in flight ahead of the one computing. An item's short last block (a 1,025-token context: 8 pages, then
# 1) computes only its pages, so with one block ahead the next item's full block could not hide behind it; two
# ahead keep the fetches back to back. On the v5e, 64 x 1025 int8 decodes of 8B heads: 518 -> 441 us a layer
# (attention with the K/V write), and the 8B engine's 64-slot step 30.3 -> 27.4 ms; short tails alone or two
# ahead alone did not move it (benchmarks/results.d/tpu-v5e.md).
PREFETCH = 2


def _kernel(num_items_ref, item_seq_ref, item_row_ref, item_first_ref, item_end_ref, kv_lens_ref,
            pages_ref, cu_ref, layer_ref,                                   # scalar prefetch (SMEM)
            q_hbm, kv_hbm, *rest, rows: int, group: int, pages_per_block: int, pages_per_seq: int,
            sm_scale: float, sliding_window: int | None, soft_cap: float | None, int8: bool, cdt,
            merge_pages: bool, prefetch: int):
    if int8:
        sc_hbm, o_hbm, q_buf, o_buf, kv_buf, sc_buf, acc_ref, m_ref, l_ref, sems, io_sems, slot_ref = rest
    else:
        o_hbm, q_buf, o_buf, kv_buf, acc_ref, m_ref, l_ref, sems, io_sems, slot_ref = rest
        sc_hbm = sc_buf = None
    # kv_buf [2, nb] + a page of layout.py's form: tokens [ps, KV * 2hd], lanes [KV, ps, 2hd], split [KV, 2, ps, hd]
    kind = {4: "tokens", 5: "lanes", 6: "split"}[kv_buf.ndim]
    nb, hd = pages_per_block, q_buf.shape[-1]          # hd: the width q and out use
    ps = kv_buf.shape[layout.PAGE_AXIS[kind]]
    kvh = q_buf.shape[2] // group
    head_w = kv_buf.shape[-1] // kvh                   # tokens: head h's [K | V] in lanes h * head_w...
    # heads of 64: q is [q | 0], as wide as a head's [K | V]
    padded = kind != "split" and hd == (head_w if kind == "tokens" else kv_buf.shape[-1])
    r = rows * group                                    # query rows per KV head: token-major, group-minor
    i = pl.program_id(0)
    n_items = num_items_ref[0]
    n_max = item_seq_ref.shape[0]
    n_slots = prefetch + 1
    layer = layer_ref[0]

    def blocks(item):
        """item's first and last block numbers: block b holds the sequence's pages [b * nb, b * nb + nb)."""
        return item_first_ref[item] // nb, (item_end_ref[item] - 1) // nb

    def copies(item, blk, slot):
        """The DMAs of block `blk` of `item`'s pages into buffer `slot`, each with its predicate (pages
        outside the item's keys are not fetched; their stale buffer rows are masked)."""
        s = item_seq_ref[item]
        out = []
        for j in range(nb):
            p = blk * nb + j
            valid = (p >= item_first_ref[item]) & (p < item_end_ref[item])
            page = pages_ref[s * pages_per_seq + jnp.minimum(p, pages_per_seq - 1)]
            out.append((valid, pltpu.make_async_copy(kv_hbm.at[layer, page], kv_buf.at[slot, j], sems.at[0, slot])))
            if int8:
                out.append((valid, pltpu.make_async_copy(sc_hbm.at[layer, page], sc_buf.at[slot, j],
                                                         sems.at[1, slot])))
        return out

    def q_copy(item, slot):
        return pltpu.make_async_copy(q_hbm.at[pl.ds(item_row_ref[item], rows)], q_buf.at[slot], io_sems.at[0, slot])

    def o_copy(item, slot):
        return pltpu.make_async_copy(o_buf.at[slot], o_hbm.at[pl.ds(item_row_ref[item], rows)], io_sems.at[1, slot])

    def after(item, blk):
        """The block that follows block blk of item in the call's order: (item, blk + 1) within the
        item, else the next item's first block (item == n_items: none)."""
        last = blk == blocks(jnp.minimum(item, n_max - 1))[1]
        nxt = jnp.where(last, item + 1, item)
        return nxt, jnp.where(last, blocks(jnp.minimum(nxt, n_max - 1))[0], blk + 1)

    def ahead(item, blk, k):
        """The block k blocks after (item, blk)."""
        for _ in range(k):
            item, blk = after(item, blk)
        return item, blk

    def start(item, blk, slot):
        for valid, c in copies(item, blk, slot):
            pl.when(valid)(c.start)

    def wait(item, blk, slot):
        for valid, c in copies(item, blk, slot):
            pl.when(valid)(c.wait)

    @pl.when(i == 0)
    def _first():
        slot_ref[0] = 0

        @pl.when(n_items > 0)
        def _():
            # stale buffer rows are masked by p == 0, so they must not be NaN: cleared once per call (not
            # in a call without items: the prefill call of a decode-only step)
            kv_buf[...] = jnp.zeros_like(kv_buf)
            if int8:
                sc_buf[...] = jnp.zeros_like(sc_buf)
            q_copy(0, 0).start()
            # the first `prefetch` blocks of the call go out now; each block then fetches the one
            # `prefetch` blocks after it
            item, blk = 0, blocks(0)[0]
            for k in range(prefetch):
                if k:
                    item, blk = after(item, blk)
                pl.when(item < n_items)(functools.partial(start, jnp.minimum(item, n_max - 1), blk, k))

    @pl.when(i < n_items)
    def _item():
        # q and out are double-buffered too: item i uses slot i % 2 and fetches item i + 1's rows; its out
        # DMA runs during item i + 1, which waits for it before starting its own: an item's block of rows
        # can overrun into the next item's, so the writes must land in item order
        qs = jax.lax.rem(i, 2)

        @pl.when(i + 1 < n_items)
        def _():
            q_copy(i + 1, 1 - qs).start()

        s = item_seq_ref[i]
        row = item_row_ref[i]
        kv_len = kv_lens_ref[s]
        q_start, q_end = cu_ref[s], cu_ref[s + 1]
        base = kv_len - (q_end - q_start) + (row - q_start)       # position of the item's first row
        acc_ref[...] = jnp.zeros_like(acc_ref)
        m_ref[...] = jnp.full_like(m_ref, MASK_VALUE)
        l_ref[...] = jnp.zeros_like(l_ref)
        q_copy(i, qs).wait()
        first_blk, last_blk = blocks(i)

        def block(blk, slot):
            # the block `prefetch` ahead goes into the slot the previous block computed from
            item, ablk = ahead(i, blk, prefetch)
            pl.when(item < n_items)(functools.partial(start, jnp.minimum(item, n_max - 1), ablk,
                                                      jax.lax.rem(slot + prefetch, n_slots)))
            wait(i, blk, slot)
            page0 = blk * nb

            def attend(at, n):
                """Every head's rows against buffer pages [at, at + n) (at may be traced)."""
                for h in range(kvh):
                    q = q_buf[qs, :, h * group:(h + 1) * group, :].reshape(r, hd).astype(cdt)   # [r, hd]
                    _keys(q, h, at, n, page0 + at, slot)

            if not merge_pages:
                for j in range(nb):
                    attend(j, 1)
            else:
                # the block's pages that can hold keys are its first `used` (an item's range ends inside its
                # last block; masked pages cost what kept ones do): one merged update over the smallest power
                # of two of pages covering them, at offset 0 (static shapes; the pages past `used` are masked)
                used = jnp.minimum(nb, item_end_ref[i] - page0)
                lo = 0
                for n in [2 ** k for k in range(nb.bit_length()) if 2 ** k < nb] + [nb]:
                    pl.when((used > lo) & (used <= n))(functools.partial(attend, 0, n))
                    lo = n
            return jax.lax.rem(slot + 1, n_slots)

        def _keys(q, h, at, n, first_page, slot):
            """Head h's rows against the keys of buffer pages [at, at + n) (at may be traced), whose
            first is the sequence's page number first_page."""
            keys = n * ps
            pages = pl.ds(at, n)
            if kind == "split":
                k = kv_buf[slot, pages, h, 0].reshape(keys, hd)                          # [n*ps, hd]
                v = kv_buf[slot, pages, h, 1].reshape(keys, hd)
            else:
                if kind == "tokens":
                    kv_rows = kv_buf[slot, pages, :, h * head_w:(h + 1) * head_w].reshape(keys, head_w)
                else:
                    kv_rows = kv_buf[slot, pages, h].reshape(keys, hd)                  # [n*ps, 2hd]
                if padded:  # q's lanes past hd are zero, and out takes the V lanes of P.[K | V]
                    k = v = kv_rows
                else:       # 128-lane-aligned slices
                    k, v = kv_rows[:, :hd], kv_rows[:, hd:]                               # [n*ps, hd]
            scales = None
            if int8:   # per-key scales as lane rows [1, n*ps]
                scales = tuple(jnp.concatenate([sc_buf[slot, at + j, h, kv:kv + 1, :] for j in range(n)],
                                               axis=1) for kv in (0, 1))
            online_softmax.update(q, k, v, scales, m_ref, l_ref, acc_ref, h, q_pos0=base, group=group,
                                  first_key=first_page * ps, sm_scale=sm_scale, sliding_window=sliding_window,
                                  soft_cap=soft_cap, cdt=cdt)

        slot_ref[0] = jax.lax.fori_loop(first_blk, last_blk + 1, block, slot_ref[0])
        for h in range(kvh):
            out = online_softmax.finish(l_ref, acc_ref, h)                               # [r, hd]
            o_buf[qs, :, h * group:(h + 1) * group, :] = out.reshape(rows, group, hd)

        @pl.when(i >= 1)
        def _():
            o_copy(i - 1, 1 - qs).wait()

        o_copy(i, qs).start()

        @pl.when(i == n_items - 1)
        def _():
            o_copy(i, qs).wait()


def _items(q_lens, kv_lens, cu_q_lens, num_seqs, take, *, rows: int, max_items: int, page_size: int,
           sliding_window: int | None):
    """Work items of the sequences where `take` [S]: (count [1], seq, first row, first page, end page)
    [max_items] each; a sequence of q_len tokens gives ceil(q_len / rows) items."""
    n_blocks = jnp.where(take, -(-q_lens // rows), 0)                      # [S]
    ends = jnp.cumsum(n_blocks)
    k = jnp.arange(max_items, dtype=jnp.int32)
    # the sequence of item k: how many sequences' items end at or before k (one fused compare, where
    # searchsorted lowers to a loop of tiny ops)
    seq = jnp.minimum(jnp.sum(ends[None, :] <= k[:, None], axis=1), q_lens.shape[0] - 1).astype(jnp.int32)
    j = k - (ends[seq] - n_blocks[seq])                                    # block within its sequence
    row = cu_q_lens[seq] + j * rows
    first_pos = kv_lens[seq] - q_lens[seq] + j * rows
    last_pos = jnp.minimum(first_pos + rows - 1, kv_lens[seq] - 1)
    lo = jnp.zeros_like(first_pos) if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)
    count = jnp.minimum(ends[-1], max_items).reshape(1).astype(jnp.int32)
    return count, seq, row.astype(jnp.int32), (lo // page_size).astype(jnp.int32), \
        (last_pos // page_size + 1).astype(jnp.int32)


def _attend_items(q_pad, kv_cache, scalars, items, *, rows, group, pages_per_block, sm_scale, sliding_window,
                  soft_cap, cdt, interpret, vmem_limit_bytes, merge_pages, prefetch,
                  name):
    kv = kv_cache["kv"]
    int8 = "kv_scale" in kv_cache
    h, hd = q_pad.shape[1], q_pad.shape[2]
    kv_lens, pages_flat, cu_q_lens, layer, pages_per_seq = scalars
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    scratch = [pltpu.VMEM((2, rows, h, hd), jnp.float32), pltpu.VMEM((2, rows, h, hd), jnp.float32),
               pltpu.VMEM((prefetch + 1, pages_per_block) + kv.shape[2:], kv.dtype)]
    if int8:
        scratch.append(pltpu.VMEM((prefetch + 1, pages_per_block) + kv_cache["kv_scale"].shape[2:], jnp.float32))
    r, kvh = rows * group, h // group
    scratch += [pltpu.VMEM((kvh, r, hd), jnp.float32), pltpu.VMEM((kvh, r, LANES), jnp.float32),
                pltpu.VMEM((kvh, r, LANES), jnp.float32), pltpu.SemaphoreType.DMA((2, prefetch + 1)),
                pltpu.SemaphoreType.DMA((2, 2)), pltpu.SMEM((1,), jnp.int32)]
    kernel = functools.partial(
        _kernel, rows=rows, group=group, pages_per_block=pages_per_block, pages_per_seq=pages_per_seq,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, int8=int8, cdt=cdt,
        merge_pages=merge_pages, prefetch=prefetch)
    count, seq, row, first, end = items
    call = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=9, grid=(seq.shape[0],),
            in_specs=[any_spec] * (3 if int8 else 2), out_specs=any_spec, scratch_shapes=scratch),
        out_shape=jax.ShapeDtypeStruct(q_pad.shape, jnp.float32),
        # the grid walks items in order: each step finishes the DMAs the previous one started
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                             vmem_limit_bytes=vmem_limit_bytes),
        interpret=(interpret if isinstance(interpret, pltpu.InterpretParams)
                   else pltpu.InterpretParams() if interpret else False), name=name)
    operands = (q_pad, kv) + ((kv_cache["kv_scale"],) if int8 else ())
    return call(count, seq, row, first, end, kv_lens, pages_flat, cu_q_lens, layer, *operands)


def ragged_paged_attention(q, k_new, v_new, kv_cache, layer, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                           sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
                           pages_per_block: int | None = None, decode_rows: int = 1, prefill_rows: int = 128,
                           vmem_limit_bytes: int = 64 * 2 ** 20, merge_pages: bool = True,
                           prefetch: int | None = None,
                           int8_write: str | None = None, float_write: str | None = None,
                           interpret: bool | pltpu.InterpretParams = False):
    """slipstream.kernels.attention.ragged_paged_attention on a cache of layout.py's layout: (out [T, H, hd], cache).
    pages_per_block: pages per DMA block (default: 512 keys' worth, 1024 of int8); decode_rows / prefill_rows:
    query rows per work item of the two calls; merge_pages: one softmax update per block of pages, over the
    smallest power of two of them holding the item's keys (else one per page); prefetch: blocks fetched ahead
    (default PREFETCH);
    int8_write / float_write: how int8 / float K/V are written (layout.write_kv; default layout.INT8_WRITE, and
    for float layout.FLOAT_WRITE in steps of more than two tokens a sequence row, else the scatter); interpret:
    Pallas' TPU interpreter (tests on CPU; its InterpretParams, or True for the defaults)."""
    if not layout.is_merged(kv_cache):
        raise ValueError(f"the TPU kernel takes a cache of kernels/tpu/layout.py's layout ('kv'), "
                         f"got {sorted(kv_cache)}")
    t_len, h, hd = q.shape
    kind, shape = layout.form(kv_cache), kv_cache["kv"].shape
    num_pages = shape[1]
    ps = shape[layout.PAGE_AXIS[kind]]
    kvh = shape[-1] // (2 * hd) if kind == "tokens" else shape[2]
    # an even count of heads of 64 in token rows: the kernel reads each pair as one head of 128
    # (layout.pairs_heads), a KV head's q in the lanes of its K; else heads of 64 pad q to [K | V]
    pairs = kind == "tokens" and layout.pairs_heads(hd, kvh)
    padded = layout.pads_q(hd) and not pairs
    if kvh < 1 or h % kvh:
        raise ValueError(f"q has {h} heads of {hd}, not a multiple of the cache's {kvh} KV heads "
                         f"(cache {kind} {tuple(shape)})")
    group = h // kvh
    # 512 keys a block, 1024 of int8 (the same bytes): measured on a v5e, 64 x 1024 int8 decodes of 8B heads,
    # 8 pages of 128 took 191 us a layer against 4 pages' 250 (benchmarks/results.d/tpu-v5e.md)
    prefetch = PREFETCH if prefetch is None else prefetch
    n_rows, pages_per_seq = page_indices.shape
    # float K/V: the write kernel moves a decode's whole 16-row tile (64 decodes of 8B heads took 17 us a layer
    # against the scatter's 15 on the v5e) and a prefill's pages whole (1B heads, 1024 tokens: 12 us against 133)
    if float_write is None and t_len <= 2 * n_rows:
        float_write = "scatter"
    nb = pages_per_block or max(1, (1024 if kv_cache["kv"].dtype == jnp.int8 else 512) // ps)

    seq, pos, valid = token_layout(kv_lens, cu_q_lens, num_seqs, t_len)
    page = jnp.take_along_axis(page_indices[seq], (pos // ps)[:, None], axis=1)[:, 0]
    # a sequence's tokens fill at most ceil(q_len / ps) + 1 pages: the write's runs of tokens per page
    kv_cache = layout.write_kv(kv_cache, layer, k_new, v_new, jnp.where(valid, page, num_pages), pos % ps,
                               quantize_kv, int8_write=int8_write, float_write=float_write,
                               max_items=min(t_len, t_len // ps + 2 * n_rows), interpret=interpret)

    i32 = jnp.int32
    n = jnp.reshape(num_seqs, ()).astype(i32)
    cu_q_lens = cu_q_lens.astype(i32)
    kv_lens = kv_lens.astype(i32)
    q_lens = jnp.where(jnp.arange(n_rows) < n, cu_q_lens[1:] - cu_q_lens[:-1], 0)            # [S]
    decode = (q_lens > 0) & (q_lens <= decode_rows)
    prefill = q_lens > decode_rows
    scalars = (kv_lens, page_indices.astype(i32).reshape(-1), cu_q_lens,
               jnp.asarray(layer, i32).reshape(1), pages_per_seq)
    cdt = jnp.float32 if jnp.float32 in (q.dtype, kv_cache["kv"].dtype) else jnp.bfloat16
    pad = max(decode_rows, prefill_rows)
    q32 = q.astype(jnp.float32)
    odd = ((jnp.arange(h) // group) % 2 == 1)[None, :, None]        # pairs: the second KV head of a pair
    if pairs:   # [q | 0] against [K_2j | K_2j+1] for KV head 2j, [0 | q] for 2j + 1
        zeros = jnp.zeros_like(q32)
        q32 = jnp.where(odd, jnp.concatenate([zeros, q32], -1), jnp.concatenate([q32, zeros], -1))
    # item rows past T; padded heads of 64: q's rows are [q | 0], as wide as a head's [K | V]
    q_pad = jnp.pad(q32, ((0, pad), (0, 0), (0, hd if padded else 0)))
    common = dict(group=2 * group if pairs else group, pages_per_block=nb, sm_scale=sm_scale,
                  sliding_window=sliding_window, soft_cap=soft_cap, cdt=cdt, interpret=interpret,
                  vmem_limit_bytes=vmem_limit_bytes, merge_pages=merge_pages, prefetch=prefetch)
    item_kw = dict(page_size=ps, sliding_window=sliding_window)

    def run(take, rows, max_items, name):
        items = _items(q_lens, kv_lens, cu_q_lens, n, take, rows=rows, max_items=max_items, **item_kw)
        # always called: a call with no items is a few empty grid steps, and a lax.cond around it
        # would make its branches alias the cache (XLA copies it)
        return _attend_items(q_pad, kv_cache, scalars, items, rows=rows, name=name, **common)

    out_d = run(decode, decode_rows, min(n_rows, t_len), "rpa_decode")
    # each prefill sequence has > decode_rows tokens: at most T / prefill_rows blocks plus one per sequence
    out_p = run(prefill, prefill_rows, -(-t_len // prefill_rows) + min(n_rows, t_len // (decode_rows + 1)),
                "rpa_prefill")
    long_tok = prefill[seq]
    out = jnp.where(long_tok[:, None, None], out_p[:t_len], out_d[:t_len])   # [T, H, hd]
    if padded:
        out = out[..., hd:]
    elif pairs:   # P.[V_2j | V_2j+1]: KV head 2j's output in the first half of the lanes
        out = jnp.where(odd, out[..., hd:], out[..., :hd])
    return jnp.where(valid[:, None, None], out, 0.0).astype(q.dtype), kv_cache
