"""Grouped int8 expert matmul on TPU (Pallas/Mosaic) for sparse-MoE layers (models/moe.py): rows sorted by expert
and padded to whole blocks of `rows` rows, each block one expert's (block_expert [C]), times that expert's
per-output-channel int8 weight q [L, E, K, N] (scale f32 [L, E, N]) at a traced layer -> f32 [C * rows, N]. With a
second weight of the same shape (gate and up): silu(x @ gate) * (x @ up) in x's dtype, both from one read of x.

XLA's grouped matmul (ragged_dot) takes float weights, so it converts a layer's whole int8 stack to bf16 in HBM
every call, and a loop over blocks pays a dynamic while's per-iteration cost. Here the grid is (C blocks of rows,
N / bn, K / bk); the scalar-prefetched block_expert picks each block's expert in the weight's index map, so a step
reads only the experts its rows use, once per block of their rows, and converts each int8 block to x's dtype in
VMEM. The f32 accumulator stays in VMEM across the K axis; the column scales apply once at the last K block.
C is a static upper bound: blocks at or past `used` (scalar-prefetched) map to the last used block's indices,
so the pipeline fetches nothing for them, and write zeros.

Blocks (`blocks`): bk all of K up to MAX_BK, else the largest multiple of 256 dividing K up to it; bn the largest
multiple of 128 dividing N with bk * bn <= MAX_BLOCK_BYTES (one weight's int8 block). rows: a multiple of 16 (a
bf16 sublane tile). Shapes that do not tile return None: callers keep XLA's path.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from slipstream.kernels.tpu.int8_matmul import _largest_divisor

ROW_ALIGN = 16             # rows per block: a multiple of this (bf16 sublane tile)
K_ALIGN = 256
N_ALIGN = 128              # the lane width
MAX_BK = 2048
MAX_BLOCK_BYTES = 1 << 20  # one weight's int8 block [bk, bn]
VMEM_LIMIT = 64 << 20      # v5e has 128 MiB; the estimate below stays well under this for rows <= 512


def blocks(k: int, n: int) -> tuple[int, int] | None:
    """(bk, bn) for experts [K, N], or None where they do not tile (K not a multiple of 256 nor at most MAX_BK and
    of 128, N not a multiple of 128)."""
    if n % N_ALIGN or k % N_ALIGN:
        return None
    bk = k if k <= MAX_BK else _largest_divisor(k, K_ALIGN, MAX_BK)
    if bk is None:
        return None
    bn = _largest_divisor(n, N_ALIGN, max(N_ALIGN, MAX_BLOCK_BYTES // bk))
    return bk, bn


def vmem_estimate(rows: int, bk: int, bn: int, x_bytes: int, gated: bool) -> int:
    """Bytes of VMEM for one grid step: double-buffered x, weight, scale and out blocks, the converted weight and
    its f32 temporary, the accumulators."""
    w = 1 + gated
    return (2 * rows * bk * x_bytes + w * (2 * bk * bn + 2 * 8 * bn * 4 + bk * bn * (4 + x_bytes))
            + w * rows * bn * 4 + 2 * rows * bn * 4)


def _kernel(layer_ref, expert_ref, used_ref, x_ref, *refs, gated: bool, nk: int):
    del layer_ref, expert_ref  # index maps only
    if gated:
        w_ref, s_ref, w2_ref, s2_ref, out_ref, acc_ref, acc2_ref = refs
    else:
        (w_ref, s_ref, out_ref, acc_ref), w2_ref = refs, None
    live = pl.program_id(0) < used_ref[0]
    k = pl.program_id(2)
    x = x_ref[...]                                                                  # [rows, bk]

    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else jax.lax.Precision.DEFAULT

    def dot(w_ref):  # int8 block -> x's dtype (through f32) in VMEM, one MXU dot
        return jnp.dot(x, w_ref[...].astype(jnp.float32).astype(x.dtype), precision=precision,
                       preferred_element_type=jnp.float32)

    @pl.when(live & (k == 0))
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)
        if gated:
            acc2_ref[...] = jnp.zeros_like(acc2_ref)

    @pl.when(live)
    def _accumulate():
        acc_ref[...] += dot(w_ref)
        if gated:
            acc2_ref[...] += dot(w2_ref)

    @pl.when(live & (k == nk - 1))
    def _finish():
        y = acc_ref[...] * s_ref[...]                                               # [rows, bn] * [1, bn]
        if gated:
            y = jax.nn.silu(y) * (acc2_ref[...] * s2_ref[...])
        out_ref[...] = y.astype(out_ref.dtype)

    @pl.when(jnp.logical_not(live))
    def _dead():
        out_ref[...] = jnp.zeros_like(out_ref)


@functools.partial(jax.jit, static_argnames=("rows", "block_k", "block_n", "interpret"))
def expert_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, layer: jax.Array, block_expert: jax.Array,
                  used: jax.Array, q2: jax.Array | None = None, scale2: jax.Array | None = None, *, rows: int,
                  block_k: int | None = None, block_n: int | None = None, interpret: bool = False) -> jax.Array:
    """x [C * rows, K] (bf16 or f32; block i = rows i*rows.. of expert block_expert[i], blocks >= used ignored)
    times q int8 [L, E, K, N] * scale f32 [L, E, N] at `layer` -> f32 [C * rows, N] (dead blocks 0). With q2 and
    scale2 (same shapes): silu(x @ w) * (x @ w2) in x's dtype. block_k / block_n: override `blocks`' choice;
    interpret: Pallas' TPU interpreter (tests on CPU). Raises ValueError for shapes that do not tile."""
    if x.ndim != 2 or x.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"x must be bf16 or f32 [C * rows, K], got {x.dtype} {tuple(x.shape)}")
    if q.ndim != 4 or q.dtype != jnp.int8:
        raise ValueError(f"q must be int8 [L, E, K, N], got {q.dtype} {tuple(q.shape)}")
    gated = q2 is not None
    if gated != (scale2 is not None) or (gated and (q2.shape != q.shape or scale2.shape != scale.shape)):
        raise ValueError("pass q2 and scale2 together, shaped as q and scale")
    layers, experts, k, n = q.shape
    if tuple(scale.shape) != (layers, experts, n):
        raise ValueError(f"scale must be {(layers, experts, n)}, got {tuple(scale.shape)}")
    if rows % ROW_ALIGN or x.shape[0] % rows or x.shape[1] != k:
        raise ValueError(f"x {tuple(x.shape)} must be whole blocks of rows ({rows}, a multiple of {ROW_ALIGN}) of "
                         f"{k} inputs")
    chosen = blocks(k, n)
    if chosen is None and not (block_k and block_n):
        raise ValueError(f"no blocks for experts [{k}, {n}] (K and N multiples of {N_ALIGN})")
    bk, bn = block_k or chosen[0], block_n or chosen[1]
    # a block a whole dimension wide need not be lane-aligned (Pallas' rule): e.g. a tensor-parallel device's slice
    # of narrow experts (Qwen3-30B-A3B's 768 hidden units over 4 devices: 192); `blocks` does not choose such
    # blocks until a TPU has compiled them (.devrun/expert_matmul_narrow.py)
    if k % bk or n % bn or (bk % N_ALIGN and bk != k) or (bn % N_ALIGN and bn != n):
        raise ValueError(f"blocks ({bk}, {bn}) do not tile [{k}, {n}] (multiples of {N_ALIGN}, or the whole "
                         "dimension)")
    c, nn, nk = x.shape[0] // rows, n // bn, k // bk

    def live(i, j, kk, used):  # a dead block's indices: the last used block's last step (nothing new to fetch)
        dead = i >= used[0]
        return (jnp.where(dead, jnp.maximum(used[0] - 1, 0), i), jnp.where(dead, nn - 1, j),
                jnp.where(dead, nk - 1, kk))

    def x_map(i, j, kk, layer, expert, used):
        i, j, kk = live(i, j, kk, used)
        return i, kk

    def w_map(i, j, kk, layer, expert, used):
        i, j, kk = live(i, j, kk, used)
        return layer[0], expert[i], kk, j

    def s_map(i, j, kk, layer, expert, used):
        i, j, kk = live(i, j, kk, used)
        return layer[0], expert[i], 0, j

    w_spec = pl.BlockSpec((None, None, bk, bn), w_map)
    s_spec = pl.BlockSpec((None, None, 1, bn), s_map)
    scales = [s.reshape(layers, experts, 1, n) for s in (scale, scale2) if s is not None]
    operands = [x, q, scales[0]] + ([q2, scales[1]] if gated else [])
    in_specs = [pl.BlockSpec((rows, bk), x_map), w_spec, s_spec] + ([w_spec, s_spec] if gated else [])
    scratch = [pltpu.VMEM((rows, bn), jnp.float32)] * (2 if gated else 1)
    need = vmem_estimate(rows, bk, bn, x.dtype.itemsize, gated)
    prefetch = (jnp.asarray(layer, jnp.int32).reshape(1), block_expert.astype(jnp.int32),
                jnp.asarray(used, jnp.int32).reshape(1))
    return pl.pallas_call(
        functools.partial(_kernel, gated=gated, nk=nk),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(c, nn, nk), in_specs=in_specs,
            out_specs=pl.BlockSpec((rows, bn), lambda i, j, kk, *_: (i, j)), scratch_shapes=scratch),
        out_shape=jax.ShapeDtypeStruct((x.shape[0], n), x.dtype if gated else jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary", "arbitrary"),
                                             vmem_limit_bytes=max(VMEM_LIMIT, need + (16 << 20))),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(*prefetch, *operands)
