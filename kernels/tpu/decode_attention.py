"""Decode attention on TPU (Pallas/Mosaic): the sequences that feed a few query rows each (decodes), `batch`
of them per grid step, over the merged page layout of kernels/tpu/layout.py.

Work split: q and out move as one [batch, rows, H, hd] block per grid step (Pallas pipelines them). The
KV pages of all decode sequences form one stream, walked sequence by sequence, one page (all KV heads'
K and V: one DMA) at a time through a ring of `buffers` page buffers: a page's DMA starts `buffers - 1`
pages ahead of its compute, across sequence and grid-step boundaries, so the DMA engine never waits for
a sequence's first page and no page past a sequence's keys is fetched or computed. The prefetch
cursor (sequence, page) lives in SMEM. Softmax state is per KV head of the current sequence
(online_softmax.py). VMEM: buffers x one page (bf16, 8 KV heads, hd 128, 128 tokens: 512 KiB), plus
two q and out blocks.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from slipstream.kernels.tpu import online_softmax
from slipstream.kernels.tpu.online_softmax import LANES, MASK_VALUE


def _kernel(num_ref, seq_ref, first_ref, end_ref, base_ref, pages_ref, layer_ref,     # scalar prefetch
            q_ref, kv_hbm, *rest, batch: int, group: int, pages_per_seq: int, sm_scale: float,
            sliding_window: int | None, soft_cap: float | None, int8: bool, cdt,
            int8_mxu: bool):
    mxu8 = int8 and int8_mxu
    split_bufs = rest[-2:] if mxu8 else (None, None)    # online_softmax.split_int8's: q rows, p rows
    rest = rest[:-2] if mxu8 else rest
    if int8:
        sc_hbm, o_ref, kv_buf, sc_buf, acc_ref, m_ref, l_ref, sems, cur = rest
    else:
        o_ref, kv_buf, acc_ref, m_ref, l_ref, sems, cur = rest
        sc_hbm = sc_buf = None
    lanes = kv_buf.ndim == 4                  # [buffers, KV, ps, 2hd]: K and V side by side in the lanes
    nbuf, kvh = kv_buf.shape[0], kv_buf.shape[1]
    ps = kv_buf.shape[2] if lanes else kv_buf.shape[3]
    rows, hd = q_ref.shape[1], q_ref.shape[-1]        # hd: the row width q and out use
    r = rows * group
    b = pl.program_id(0)
    n_dec = num_ref[0]
    last_dec = seq_ref.shape[0] - 1
    layer = layer_ref[0]
    # cur: [0] sequence and [1] page of the next page to fetch, [2] pages fetched, [3] pages computed

    def copies(page, slot):
        out = [pltpu.make_async_copy(kv_hbm.at[layer, page], kv_buf.at[slot], sems.at[0, slot])]
        if int8:
            out.append(pltpu.make_async_copy(sc_hbm.at[layer, page], sc_buf.at[slot], sems.at[1, slot]))
        return out

    def fetch_next():
        d = cur[0]

        @pl.when(d < n_dec)
        def _():
            p = cur[1]
            for c in copies(pages_ref[seq_ref[d] * pages_per_seq + p], jax.lax.rem(cur[2], nbuf)):
                c.start()
            cur[2] = cur[2] + 1
            done = p + 1 >= end_ref[d]
            cur[0] = jnp.where(done, d + 1, d)
            cur[1] = jnp.where(done, first_ref[jnp.minimum(d + 1, last_dec)], p + 1)

    @pl.when(b == 0)
    def _start():
        cur[0] = 0
        cur[1] = first_ref[0]
        cur[2] = 0
        cur[3] = 0
        for _ in range(nbuf):
            fetch_next()

    def page_step(p, carry):
        j, d = carry
        slot = jax.lax.rem(cur[3], nbuf)
        for c in copies(0, slot):          # a wait needs only the semaphore and the size
            c.wait()
        for h in range(kvh):
            q = q_ref[j, :, h * group:(h + 1) * group, :].reshape(r, hd)                  # [r, hd]
            q = online_softmax.prepare_q(q.astype(jnp.float32), mxu8=mxu8, cdt=cdt, buf=split_bufs[0])
            if lanes:   # rows [K | V]: q's lanes past hd are zero; out takes the V lanes
                k = v = kv_buf[slot, h]                                                  # [ps, 2hd]
            else:
                k, v = kv_buf[slot, h, 0], kv_buf[slot, h, 1]                            # [ps, hd]
            scales = (sc_buf[slot, h, 0:1, :], sc_buf[slot, h, 1:2, :]) if int8 else None
            online_softmax.update(q, k, v, scales, m_ref, l_ref, acc_ref, h, q_pos0=base_ref[d], group=group,
                                  first_key=p * ps, sm_scale=sm_scale, sliding_window=sliding_window,
                                  soft_cap=soft_cap, cdt=cdt, mxu8=mxu8, p_buf=split_bufs[1])
        cur[3] = cur[3] + 1
        fetch_next()                       # into the slot just consumed
        return carry

    def sequence(j, _):
        d = b * batch + j

        @pl.when(d < n_dec)
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)
            m_ref[...] = jnp.full_like(m_ref, MASK_VALUE)
            l_ref[...] = jnp.zeros_like(l_ref)
            jax.lax.fori_loop(first_ref[d], end_ref[d], page_step, (j, d))
            for h in range(kvh):
                out = online_softmax.finish(l_ref, acc_ref, h)                           # [r, hd]
                o_ref[j, :, h * group:(h + 1) * group, :] = out.reshape(rows, group, hd).astype(o_ref.dtype)
        return 0

    jax.lax.fori_loop(0, batch, sequence, 0)


def decode_attention(q_dec, kv_cache, count, seq, first, end, base, pages_flat, layer, *, pages_per_seq: int,
                     group: int, batch: int, buffers: int, sm_scale: float, sliding_window: int | None,
                     soft_cap: float | None, cdt, int8_mxu: bool, dynamic_grid: bool,
                     vmem_limit_bytes: int, interpret: bool):
    """q_dec [D, rows, H, hd]: the query rows of decode d (seq[d], keys in pages [first[d], end[d]),
    query row 0 at position base[d]), d < count[0]; D a multiple of batch. Returns out [D, rows, H, hd]
    f32 (rows of d >= count[0] undefined)."""
    kv = kv_cache["kv"]
    int8 = "kv_scale" in kv_cache
    d_max, rows, h, hd = q_dec.shape
    kvh = kv.shape[2]
    r = rows * group
    scratch = [pltpu.VMEM((buffers,) + kv.shape[2:], kv.dtype)]
    if int8:
        scratch.append(pltpu.VMEM((buffers,) + kv_cache["kv_scale"].shape[2:], jnp.float32))
    scratch += [pltpu.VMEM((kvh, r, hd), jnp.float32), pltpu.VMEM((kvh, r, LANES), jnp.float32),
                pltpu.VMEM((kvh, r, LANES), jnp.float32), pltpu.SemaphoreType.DMA((2, buffers)),
                pltpu.SMEM((4,), jnp.int32)]
    if int8 and int8_mxu:
        sr = online_softmax.split_rows(r)
        scratch += [pltpu.VMEM((sr, hd), jnp.float32), pltpu.VMEM((sr, kv.shape[-2]), jnp.float32)]
    block = pl.BlockSpec((batch, rows, h, hd), lambda i, *_: (i, 0, 0, 0))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(
        _kernel, batch=batch, group=group, pages_per_seq=pages_per_seq, sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=soft_cap, int8=int8, cdt=cdt,
        int8_mxu=int8_mxu)
    steps = (count[0] + batch - 1) // batch if dynamic_grid else d_max // batch
    call = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=7, grid=(steps,),
            in_specs=[block] + [any_spec] * (2 if int8 else 1), out_specs=block, scratch_shapes=scratch),
        out_shape=jax.ShapeDtypeStruct(q_dec.shape, jnp.float32),
        # the grid walks the decodes in order: the page ring and its cursor carry over between steps
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                             vmem_limit_bytes=vmem_limit_bytes),
        interpret=pltpu.InterpretParams() if interpret else False, name="rpa_decode_ring")
    operands = (q_dec, kv) + ((kv_cache["kv_scale"],) if int8 else ())
    return call(count, seq, first, end, base, pages_flat, layer, *operands)
