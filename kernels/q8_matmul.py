"""Group-wise int8 matmul in llama.cpp's Q8_0 layout: weights int8 with one f32 scale per 32 input
channels per output column, activations quantized per row and group of 32 at run time.

`q8_matmul` is the one entry point. On CPU it runs the native kernel (kernels/csrc/q8_matmul.cc,
through XLA's FFI); elsewhere, or with SLIPSTREAM_KERNELS=reference, `reference` does the same
math in JAX. `pack` lays weights out for the kernel once, at load time. Imports none of our packages.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels import native

GROUP = 32  # input channels per scale (a Q8_0 block)
TILE = 16   # output columns per packed tile: 16 int32 lanes of one AVX-512 vector
SHIFT = 128  # the packed weights are w + 128 (the unsigned operand of vpdpbusd)
TARGET = "slipstream_q8_matmul"
INT8_MAX = 127.0


def padded(k: int, n: int) -> tuple[int, int]:
    """(Kp, Np): the packed sizes, K rounded up to a group and N to a tile."""
    return -(-k // GROUP) * GROUP, -(-n // TILE) * TILE


def pack(q: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weights q int8 [N, K] (row n: output column n, as GGUF stores them) with scales d f32
    [N, ceil(K/32)] -> (packed u8 [Np/16, Kp*16], scales f32 [Np/16, Kp/32*16]).

    packed[t] holds tile t (columns 16t..16t+15) as [Kp/4][16][4]: 4 consecutive inputs of one column
    per int32 lane, 16 columns per 64 bytes, q + 128 stored unsigned. Padding is q = 0, d = 0.
    """
    n, k = q.shape
    kp, np_ = padded(k, n)
    if q.dtype != np.int8 or d.shape != (n, kp // GROUP):
        raise ValueError(f"pack expects int8 q [N, K] and f32 d [N, ceil(K/32)]; got q {q.dtype} "
                         f"{q.shape}, d {d.shape}")
    full = np.zeros((np_, kp), np.uint8)
    full[:n, :k] = (q.astype(np.int16) + SHIFT).astype(np.uint8)
    full[:n, k:] = SHIFT
    full[n:] = SHIFT
    packed = full.reshape(np_ // TILE, TILE, kp // 4, 4).transpose(0, 2, 1, 3).reshape(np_ // TILE, kp * TILE)
    s = np.zeros((np_, kp // GROUP), np.float32)
    s[:n] = d
    scales = s.reshape(np_ // TILE, TILE, kp // GROUP).transpose(0, 2, 1).reshape(np_ // TILE, kp // GROUP * TILE)
    return np.ascontiguousarray(packed), np.ascontiguousarray(scales)


def unpack(packed: jax.Array, scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inverse of pack, padding kept: (q int32 [Np, Kp], d f32 [Np, Kp/32])."""
    tiles, width = packed.shape[-2:]
    kp = width // TILE
    lead = packed.shape[:-2]
    q = packed.reshape(*lead, tiles, kp // 4, TILE, 4)
    q = jnp.swapaxes(q, -3, -2).reshape(*lead, tiles * TILE, kp).astype(jnp.int32) - SHIFT
    d = jnp.swapaxes(scales.reshape(*lead, tiles, kp // GROUP, TILE), -2, -1)
    return q, d.reshape(*lead, tiles * TILE, kp // GROUP)


def quantize_activations(x: jax.Array, kp: int) -> tuple[jax.Array, jax.Array]:
    """x f32 [M, K] -> (xq int8 [M, Kp/32, 32], xs f32 [M, Kp/32]), as llama.cpp's
    quantize_row_q8_0: xs = max|x| / 127, xq = round-half-even(x * (1 / xs)); the kernel matches."""
    m, k = x.shape
    xg = jnp.pad(x, ((0, 0), (0, kp - k))).reshape(m, kp // GROUP, GROUP)
    xs = jnp.max(jnp.abs(xg), axis=-1) / INT8_MAX
    inv = jnp.where(xs > 0, 1.0 / jnp.where(xs > 0, xs, 1.0), 0.0)
    xq = jnp.clip(jnp.round(xg * inv[..., None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return xq, xs


def reference(x: jax.Array, packed: jax.Array, scales: jax.Array, *, n: int) -> jax.Array:
    """x f32 [M, K] -> f32 [M, n]: per group g, the exact int32 dot of xq and q, times xs * d,
    summed over groups in order (the kernel's math; only float rounding may differ)."""
    m = x.shape[0]
    q, d = unpack(packed, scales)                                   # [Np, Kp], [Np, G]
    kp = q.shape[1]
    xq, xs = quantize_activations(x, kp)                            # [M, G, 32], [M, G]
    qg = jnp.moveaxis(q.reshape(q.shape[0], kp // GROUP, GROUP), 1, 0)  # [G, Np, 32]

    def group(y, g):
        xq_g, xs_g, q_g, d_g = g                                    # [M,32], [M], [Np,32], [Np]
        dot = jax.lax.dot_general(xq_g.astype(jnp.int32), q_g, (((1,), (1,)), ((), ())))  # [M, Np]
        return y + dot.astype(jnp.float32) * (d_g[None, :] * xs_g[:, None]), None

    y0 = jnp.zeros((m, q.shape[0]), jnp.float32)
    y, _ = jax.lax.scan(group, y0, (jnp.moveaxis(xq, 1, 0), xs.T, qg, d.T))
    return y[:, :n]


def _native(x: jax.Array, packed: jax.Array, scales: jax.Array, *, n: int) -> jax.Array:
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(x, packed, scales)


def q8_matmul(x: jax.Array, packed: jax.Array, scales: jax.Array, *, n: int) -> jax.Array:
    """x [..., K] (any float dtype) times a packed Q8_0 weight -> f32 [..., n]."""
    k = x.shape[-1]
    kp, np_ = padded(k, n)
    if packed.shape != (np_ // TILE, kp * TILE) or scales.shape != (np_ // TILE, kp // GROUP * TILE):
        raise ValueError(f"q8_matmul: packed {packed.shape} / scales {scales.shape} do not hold a "
                         f"[{k}, {n}] weight (expected {(np_ // TILE, kp * TILE)} / "
                         f"{(np_ // TILE, kp // GROUP * TILE)}); build them with kernels.q8_matmul.pack")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).astype(jnp.float32)
    ref = functools.partial(reference, n=n)
    if native.load("q8_matmul", "q8_matmul"):
        y = jax.lax.platform_dependent(x2, packed, scales, cpu=functools.partial(_native, n=n), default=ref)
    else:
        y = ref(x2, packed, scales)
    return y.reshape(*lead, n)


def read_probe(data: jax.Array) -> jax.Array:
    """Reads a u8 buffer once with the kernel's threads and vectors (a read-bandwidth yardstick for
    benchmarks); returns one checksum per 64 KiB so the read cannot be skipped. CPU, native only."""
    if not native.load("q8_matmul", "q8_matmul"):
        raise RuntimeError("read_probe needs the native kernels._q8_matmul module")
    lanes = -(-data.size // (1 << 16))
    return jax.ffi.ffi_call("slipstream_read_probe", jax.ShapeDtypeStruct((lanes,), jnp.uint32))(data.reshape(-1))
