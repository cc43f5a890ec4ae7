"""Group-wise int8 and int4 matmul on TPU (Pallas/Mosaic): y [M, N] f32 = x [M, K] @ (q * scale + offset), the
weight q int8 [K, N] (or a stack [L, K, N] read in place at a layer index) with one scale and offset per
`GROUP` = 32 inputs per output channel (scale, offset [G, N], G = K / 32, f32 or bf16; offset optional).
With `bits=4` q holds two 4-bit values a byte, [K / 2, N], in kernels/tpu/nibbles.py's layout: one 32-row int8
slice unpacks into two whole groups.

XLA's form of this (dequantize, then dot) writes the whole float weight to HBM and reads it back every
call. Here each grid step (n, k) DMAs one int8 block q [bk, bn] and its scales/offsets [bk/32, bn] into
VMEM, dequantizes it there in f32 (to x's dtype), and does one MXU dot over bk into the f32 output block,
which stays in VMEM across the k axis ("arbitrary") and is the accumulator. All M rows are one block
(padded to a multiple of 16), so each weight block is read and dequantized once whatever M is.

Blocks (`blocks`): bn the largest multiple of 128 dividing N up to 1024; bk the largest multiple of 256
dividing K (a scale block of >= 8 rows; with bf16 scales of 512, >= 16 rows, else all of a K up to 2048 in
one block) up to 2048 and to 2 MiB of weight bytes per block, halved (then bn halved) while the VMEM
estimate for M rows is over 56 MiB. x lies whole in VMEM when it is small (decode), else it streams in
[M, bk] blocks (read once per column block). Shapes that do not tile (K not a multiple of 256, N not a
multiple of 128, a block size other than 32) return None from `blocks`: callers (quantization/int8.matmul)
keep XLA's dequantize-then-dot for them.

Two ways to dequantize a block (`dequant`): "groups" (default): per group of 32 rows a [32, bn] slice of q
times its scale row (a sublane broadcast) plus its offset row, stored into a VMEM scratch the dot reads
(4-bit: a [32, bn] int8 slice widened to int32, its nibbles shifted out, two groups' rows);
"reshape": the block as [bk/32, 32, bn] times the scales as [bk/32, 1, bn], reshaped back (8-bit only).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

GROUP = 32                 # inputs per scale/offset: quantization/int8.GROUP
ROW_ALIGN = 16             # M padded to this (bf16 sublane tile)
K_ALIGN = 256              # bk multiple: a scale block of bk / 32 >= 8 rows (f32 sublane tile); bf16 scales: 512
N_ALIGN = 128              # bn multiple: the lane width
MAX_BN = 1024
MAX_BK = 2048
MAX_BLOCK_BYTES = 2 << 20  # bytes of one q block
X_RESIDENT_BYTES = 8 << 20  # x kept whole in VMEM up to this (double-buffered by the pipeline)
VMEM_BUDGET = 56 << 20     # the blocks' estimate must fit this; vmem_limit_bytes adds headroom
VMEM_CAP = 100 << 20       # v5e/v6e have 128 MiB of VMEM
DEQUANT = ("groups", "reshape")
BITS = (8, 4)


def _largest_divisor(total: int, align: int, cap: int) -> int | None:
    best = None
    for b in range(align, min(total, cap) + 1, align):
        if total % b == 0:
            best = b
    return best


def _pad_rows(m: int) -> int:
    return -(-m // ROW_ALIGN) * ROW_ALIGN


def vmem_estimate(m: int, k: int, bk: int, bn: int, x_bytes: int, offset: bool, *, bits: int = 8,
                  scale_bytes: int = 4) -> int:
    """Bytes of VMEM the call uses for m rows: double-buffered x, q, scales, offsets and out blocks, the
    dequantized weight (scratch) and the dot's f32 result before it is added."""
    mp = _pad_rows(m)
    x = 2 * mp * (k if mp * k * x_bytes <= X_RESIDENT_BYTES else bk) * x_bytes
    q = 2 * bk * bn * bits // 8
    sc = 2 * (bk // GROUP) * bn * scale_bytes * (2 if offset else 1)
    out = 2 * mp * bn * 4
    work = bk * bn * (x_bytes + 8) + mp * bn * 4   # dequantized block, its f32 temporaries, the dot's result
    return x + q + sc + out + work


def k_align(k: int, scale_bytes: int = 4) -> int | None:
    """bk's multiple for K inputs and scales of this many bytes: a scale block of whole sublane tiles (8 rows of
    f32, 16 of bf16), or all of K in one block where K is a multiple of 256 up to MAX_BK (a block the size of the
    whole scale array's axis); None where neither applies."""
    align = K_ALIGN * 4 // scale_bytes
    if k % align == 0:
        return align
    return k if k % K_ALIGN == 0 and k <= MAX_BK else None


def blocks(m: int, k: int, n: int, *, group: int = GROUP, x_bytes: int = 2, offset: bool = True, bits: int = 8,
           scale_bytes: int = 4) -> tuple[int, int] | None:
    """(bk, bn) for an [m, k] x [k, n] product with `group`-input scales of `scale_bytes` (4: f32, 2: bf16) and
    `bits`-bit weights, or None where the kernel does not apply (no k_align for k, n not a multiple of 128,
    group != 32)."""
    align = k_align(k, scale_bytes)
    if group != GROUP or bits not in BITS or align is None or n % N_ALIGN or m < 1:
        return None
    cap = MAX_BLOCK_BYTES * 8 // bits  # weights of one block
    bn = _largest_divisor(n, N_ALIGN, MAX_BN)
    bk = _largest_divisor(k, align, min(MAX_BK, cap // bn))
    if bk is None:  # bn so wide that no multiple of the alignment fits the block bytes: narrow bn
        bn = _largest_divisor(n, N_ALIGN, cap // align)
        bk = _largest_divisor(k, align, min(MAX_BK, cap // bn))
    while vmem_estimate(m, k, bk, bn, x_bytes, offset, bits=bits, scale_bytes=scale_bytes) > VMEM_BUDGET:
        if bk > align:
            bk = _largest_divisor(k, align, bk - align)
        elif bn > N_ALIGN:
            bn = _largest_divisor(n, N_ALIGN, bn - N_ALIGN)
        else:
            return None  # m too large for one block of rows
    return bk, bn


def _kernel(layer_ref, x_ref, q_ref, s_ref, *rest, offset: bool, resident: bool, dequant: str, via_int32: bool,
            bits: int, cdt, precision):
    del layer_ref  # used by the index maps only
    if offset:
        o_ref, out_ref, *scratch = rest
    else:
        out_ref, *scratch = rest
        o_ref = None
    k = pl.program_id(1)
    bk, bn = q_ref.shape[0] * 8 // bits, q_ref.shape[1]
    groups = bk // GROUP

    def widen(q):  # int8 -> f32, directly or through int32
        return (q.astype(jnp.int32) if via_int32 else q).astype(jnp.float32)

    def rows_of(ref):  # g -> that group's [1, bn] f32 row: f32 refs sliced as they lie, bf16 widened once
        if ref is None:
            return None
        if ref.dtype == jnp.float32:
            return lambda g: ref[g:g + 1, :]
        whole = ref[...].astype(jnp.float32)
        return lambda g: whole[g:g + 1, :]

    scale_row, offset_row = rows_of(s_ref), rows_of(o_ref)

    def group(g, q):  # one group's [32, bn] f32 values -> its dequantized rows in the scratch
        w = q * scale_row(g)
        if offset:
            w = w + offset_row(g)
        w_ref[g * GROUP:(g + 1) * GROUP, :] = w.astype(cdt)

    @pl.when(k == 0)
    def _init():
        out_ref[...] = jnp.zeros_like(out_ref)

    if dequant == "groups":
        (w_ref,) = scratch
        if bits == 4:
            for j in range(groups // 2):
                p = q_ref[j * GROUP:(j + 1) * GROUP, :].astype(jnp.int32)                 # [32, bn]: 2 groups
                group(2 * j, jax.lax.shift_right_arithmetic(jax.lax.shift_left(p, 28), 28).astype(jnp.float32))
                group(2 * j + 1, jax.lax.shift_right_arithmetic(p, 4).astype(jnp.float32))
        else:
            for g in range(groups):
                group(g, widen(q_ref[g * GROUP:(g + 1) * GROUP, :]))
        w = w_ref[...]
    else:
        w = widen(q_ref[...]).reshape(groups, GROUP, bn) * s_ref[...].astype(jnp.float32)[:, None, :]
        if offset:
            w = w + o_ref[...].astype(jnp.float32)[:, None, :]
        w = w.reshape(bk, bn).astype(cdt)
    xb = x_ref[k] if resident else x_ref[...]                                               # [Mp, bk]
    out_ref[...] += jnp.dot(xb.astype(cdt), w, precision=precision, preferred_element_type=jnp.float32)


@functools.partial(jax.jit, static_argnames=("block_k", "block_n", "dequant", "via_int32", "bits", "interpret",
                                                     "vmem_limit_bytes"))
def int8_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, offset: jax.Array | None = None,
                layer: jax.Array | int | None = None, *, block_k: int | None = None, block_n: int | None = None,
                dequant: str = "groups", via_int32: bool = False, bits: int = 8, interpret: bool = False,
                vmem_limit_bytes: int | None = None) -> jax.Array:
    """x [M, K] (bf16 or f32) @ (q * scale + offset) -> f32 [M, N]. q int8 [K, N] (bits=4: [K / 2, N], packed
    by pack4) with scale/offset f32 or bf16 [K / 32, N], or stacks [L, ...] of which layer `layer` (traced) is
    read in place. The weight is dequantized to x's dtype (f32 math), as int8.Int8Weight.dequantize(x.dtype)
    does. block_k / block_n: override `blocks`' choice; via_int32: widen q to int32 before converting to f32
    (the same values; another lowering); interpret: Pallas' TPU interpreter (tests on CPU).
    Raises ValueError for shapes `blocks` rejects (check it first)."""
    if dequant not in DEQUANT:
        raise ValueError(f"dequant must be one of {DEQUANT}, got {dequant!r}")
    if bits not in BITS or (bits == 4 and dequant != "groups"):
        raise ValueError(f"bits must be one of {BITS} (4 with dequant 'groups'), got {bits} with {dequant!r}")
    if x.ndim != 2 or x.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"x must be bf16 or f32 [M, K], got {x.dtype} {tuple(x.shape)}")
    stacked = q.ndim == 3
    if q.ndim not in (2, 3) or q.dtype != jnp.int8:
        raise ValueError(f"q must be int8 [K, N] or [L, K, N], got {q.dtype} {tuple(q.shape)}")
    if stacked != (layer is not None):
        raise ValueError("pass `layer` exactly when q is a stack [L, K, N]")
    m, kx = x.shape
    k, n = q.shape[-2] * 8 // bits, q.shape[-1]
    if kx != k:
        raise ValueError(f"x has {kx} inputs, the weight {k}")
    g = -(-k // GROUP)
    for name, a in (("scale", scale), ("offset", offset)):
        if a is not None and tuple(a.shape) != q.shape[:-2] + (g, n):
            raise ValueError(f"{name} must be {q.shape[:-2] + (g, n)} (one per {GROUP} inputs), got {tuple(a.shape)}")
        if a is not None and a.dtype not in (jnp.float32, jnp.bfloat16):
            raise ValueError(f"{name} must be f32 or bf16, got {a.dtype}")
    has_offset = offset is not None
    if has_offset and offset.dtype != scale.dtype:
        raise ValueError(f"scale and offset must share a dtype, got {scale.dtype} and {offset.dtype}")
    sb = scale.dtype.itemsize
    chosen = blocks(m, k, n, x_bytes=x.dtype.itemsize, offset=has_offset, bits=bits, scale_bytes=sb)
    if chosen is None:
        raise ValueError(f"no blocks for [{m}, {k}] x [{k}, {n}] (K a multiple of {K_ALIGN * 4 // sb} or of "
                         f"{K_ALIGN} up to {MAX_BK}, N of {N_ALIGN})")
    align = k_align(k, sb)
    bk, bn = block_k or chosen[0], block_n or chosen[1]
    if k % bk or bk % align or n % bn or bn % N_ALIGN:
        raise ValueError(f"blocks ({bk}, {bn}) do not tile [{k}, {n}] (multiples of {align} and {N_ALIGN})")
    nk = k // bk
    cdt = x.dtype
    precision = jax.lax.Precision.HIGHEST if cdt == jnp.float32 else jax.lax.Precision.DEFAULT

    mp = _pad_rows(m)
    xp = jnp.pad(x, ((0, mp - m), (0, 0))) if mp != m else x
    resident = mp * k * x.dtype.itemsize <= X_RESIDENT_BYTES
    if resident:  # whole x in VMEM, [nk, Mp, bk]: the kernel picks block k on the leading axis
        xp = xp.reshape(mp, nk, bk).transpose(1, 0, 2)
        x_spec = pl.BlockSpec((nk, mp, bk), lambda j, kk, lay: (0, 0, 0))
    else:
        x_spec = pl.BlockSpec((mp, bk), lambda j, kk, lay: (0, kk))
    if not stacked:
        q, scale = q[None], scale[None]
        offset = None if offset is None else offset[None]
    w_spec = pl.BlockSpec((None, bk * bits // 8, bn), lambda j, kk, lay: (lay[0], kk, j))
    s_spec = pl.BlockSpec((None, bk // GROUP, bn), lambda j, kk, lay: (lay[0], kk, j))
    in_specs = [x_spec, w_spec, s_spec] + ([s_spec] if has_offset else [])
    operands = [xp, q, scale] + ([offset] if has_offset else [])
    scratch = [pltpu.VMEM((bk, bn), cdt)] if dequant == "groups" else []
    if vmem_limit_bytes is None:
        need = vmem_estimate(m, k, bk, bn, x.dtype.itemsize, has_offset, bits=bits, scale_bytes=sb)
        vmem_limit_bytes = min(VMEM_CAP, max(32 << 20, need + need // 2 + (8 << 20)))
    kernel = functools.partial(_kernel, offset=has_offset, resident=resident, dequant=dequant,
                               via_int32=via_int32, bits=bits, cdt=cdt, precision=precision)
    lay = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1)
    y = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(n // bn, nk), in_specs=in_specs,
            out_specs=pl.BlockSpec((mp, bn), lambda j, kk, lay: (0, j)), scratch_shapes=scratch),
        out_shape=jax.ShapeDtypeStruct((mp, n), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=vmem_limit_bytes),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(lay, *operands)
    return y[:m] if mp != m else y
