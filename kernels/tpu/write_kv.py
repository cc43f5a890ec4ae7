"""The step's new K/V written into the TPU page layout (layout.py) by DMA, in place: one strided DMA per token
(all KV heads' K and V rows at the token's page offset), HBM to HBM, at most `WINDOW` in flight.

XLA's scatter into the flat row view (layout.write_kv) is in place too, but it updates rows one after
another: a 512-token prefill chunk's write took 565 us per layer on the v5e, 8x the attention kernel.
The cache goes in and comes out aliased (input_output_aliases), so a donated cache is never copied.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from slipstream.kernels.tpu import layout

WINDOW = 32   # DMAs in flight


def _kernel(page_ref, off_ref, layer_ref, new_hbm, *rest, num_pages: int, lanes: bool, int8: bool):
    if int8:
        sc_new_hbm, _kv_in, _sc_in, kv_out, sc_out, sems = rest
    else:
        _kv_in, kv_out, sems = rest
    t_len = page_ref.shape[0]
    layer = layer_ref[0]

    def copies(t, page, off):
        row = pl.ds(off, 1)
        dst = kv_out.at[layer, page, :, row, :] if lanes else kv_out.at[layer, page, :, :, row, :]
        out = [pltpu.make_async_copy(new_hbm.at[t], dst, sems.at[0])]
        if int8:
            out.append(pltpu.make_async_copy(sc_new_hbm.at[t], sc_out.at[layer, page, :, :, row], sems.at[1]))
        return out

    def valid(t):
        return page_ref[t] < num_pages

    def wait(t):
        @pl.when(valid(t))
        def _():
            for c in copies(t, 0, 0):     # a wait needs only the semaphore and the size
                c.wait()

    def issue(t, _):
        @pl.when(valid(t))
        def _():
            for c in copies(t, page_ref[t], off_ref[t]):
                c.start()

        @pl.when(t >= WINDOW)
        def _():
            wait(t - WINDOW)
        return 0

    jax.lax.fori_loop(0, t_len, issue, 0)
    jax.lax.fori_loop(max(t_len - WINDOW, 0), t_len, lambda t, c: (wait(t), c)[1], 0)


def write_kv(kv_cache: dict, layer: jax.Array, k_new: jax.Array, v_new: jax.Array, page: jax.Array,
             offset: jax.Array, quantize, *, interpret: bool = False) -> dict:
    """layout.write_kv by DMA: the step's K/V [T, KV, hd] at (page [T], offset [T]); a page past the cache
    (num_pages) writes nothing."""
    buf = kv_cache["kv"]
    lanes = layout.is_lanes(kv_cache)
    int8 = "kv_scale" in kv_cache
    t_len, kvh = k_new.shape[:2]
    num_pages = buf.shape[1]
    operands = []
    if int8:
        (k_new, ks), (v_new, vs) = quantize(k_new), quantize(v_new)
    # one token's rows as they lie at its page offset: lanes [KV, 1, 2hd]; split [KV, 2, 1, hd]
    if lanes:
        new = jnp.concatenate([k_new, v_new], axis=-1)[:, :, None, :]
    else:
        new = jnp.stack([k_new, v_new], axis=2)[:, :, :, None, :]
    operands.append(new.astype(buf.dtype))
    if int8:
        operands.append(jnp.stack([ks, vs], axis=2)[..., None].astype(jnp.float32))      # [T, KV, 2, 1]
    caches = [buf] + ([kv_cache["kv_scale"]] if int8 else [])
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    n_in = len(operands) + len(caches)
    call = pl.pallas_call(
        functools.partial(_kernel, num_pages=num_pages, lanes=lanes, int8=int8),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(1,), in_specs=[any_spec] * n_in,
            out_specs=[any_spec] * len(caches), scratch_shapes=[pltpu.SemaphoreType.DMA((2,))]),
        out_shape=[jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches],
        # operand numbering counts the 3 scalar-prefetch arrays
        input_output_aliases={3 + len(operands) + i: i for i in range(len(caches))},
        interpret=pltpu.InterpretParams() if interpret else False, name="rpa_write_kv")
    outs = call(page.astype(jnp.int32), offset.astype(jnp.int32), jnp.asarray(layer, jnp.int32).reshape(1),
                *operands, *caches)
    out = dict(kv_cache)
    out["kv"] = outs[0]
    if int8:
        out["kv_scale"] = outs[1]
    return out
