"""Runtime matmul for float or int8 weights: `linear` is the only matmul the model calls.

The model passes whatever params holds (array or QuantizedWeight) and never branches on it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels.q8_matmul import q8_matmul
from quantization.weights import INT8_MAX, QuantizedWeight

# XLA:CPU does not fuse an int8->float convert into a matrix-matrix dot: it writes the whole
# float weight (113 MB for the 576x49152 LM head) to memory and the dot reads it back.
# Converting one column tile at a time keeps the float copy in L2 between the convert and the
# dot. Measured on a 2-core Xeon (benchmarks/int8_matmul_bench.py): LM head at m=16, 60-80 ms
# untiled vs ~15 ms tiled; at m <= 16, 512 KiB tiles beat 1-16 MiB ones on every default-model
# shape. With more rows the convert is amortized and narrow dots cost more (576x1536 at m=128:
# 2.0 ms with 512 KiB tiles vs 1.3 ms untiled), so the budget grows with the row count.
CPU_TILE_BYTES = 512 * 1024
CPU_TILE_ROWS = 16
# XLA:CPU's int8 x int8 -> int32 dot is ~20x slower for a single row (LM head: ~30 ms at m=1
# vs ~1.5 ms at m=2..8) while m >= 2 is fine; zero rows are cheaper than the slow kernel.
W8A8_MIN_ROWS = 8


def linear(x: jax.Array, w: jax.Array | QuantizedWeight) -> jax.Array:
    """x[..., in] @ w[in, out] -> [..., out] in x.dtype, accumulating in f32 (int32 for w8a8 and,
    per group of 32 inputs, for q8_0 / q8_0-a16: kernels.q8_matmul, native on CPU)."""
    if w.ndim != 2:
        raise ValueError(
            f"linear expects a 2-D weight [in, out], got shape {tuple(w.shape)}; "
            "slice stacked layer weights (e.g. with lax.scan) first"
        )
    if x.shape[-1] != w.shape[0]:
        raise ValueError(
            f"linear: input feature size {x.shape[-1]} does not match weight shape {tuple(w.shape)}"
        )
    if not isinstance(w, QuantizedWeight):
        y = jnp.einsum("...i,io->...o", x, w, preferred_element_type=jnp.float32)
        return y.astype(x.dtype)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # [M, in]
    if w.mode in ("q8_0", "q8_0-a16"):
        y = q8_matmul(x2, w.q, w.scale, w.offset, n=w.shape[1], parts=1 if w.mode == "q8_0" else 2)
    elif w.mode == "w8a16":
        y = _w8a16(x2, w.q, w.scale)
    elif w.keep_a16 is None:
        y = _w8a8(x2, w.q, w.scale)
    else:  # a per-layer choice, traced under the layer scan / switch
        y = jax.lax.cond(w.keep_a16, _w8a16, _w8a8, x2, w.q, w.scale)
    return y.reshape(*lead, w.shape[1]).astype(x.dtype)


def _w8a16(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """[M, in] x int8[in, out] -> f32[M, out]; the per-column scale is applied to the output."""
    budget = CPU_TILE_BYTES * max(1, x.shape[0] // CPU_TILE_ROWS)
    tile = _cpu_tile(*q.shape, x.dtype.itemsize, budget)
    if tile >= q.shape[1]:
        return _w8a16_fused(x, q, scale)
    # Both branches compute the same product; only how XLA:CPU schedules it differs.
    return jax.lax.platform_dependent(
        x, q, scale, cpu=functools.partial(_w8a16_tiled, tile=tile), default=_w8a16_fused
    )


def _w8a16_fused(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    # GPU/TPU fuse this convert into the matmul's operand load.
    y = jnp.dot(x, q.astype(x.dtype), preferred_element_type=jnp.float32)  # [M, out]
    return y * scale


def _w8a16_tiled(x: jax.Array, q: jax.Array, scale: jax.Array, *, tile: int) -> jax.Array:
    n_out = q.shape[1]

    def tile_dot(qt: jax.Array) -> jax.Array:
        return jnp.dot(x, qt.astype(x.dtype), preferred_element_type=jnp.float32)  # [M, tile]

    def body(j: jax.Array, out: jax.Array) -> jax.Array:
        qt = jax.lax.dynamic_slice_in_dim(q, j * tile, tile, axis=1)  # [in, tile]
        return jax.lax.dynamic_update_slice_in_dim(out, tile_dot(qt), j * tile, axis=1)

    n_full = n_out // tile
    out = jax.lax.fori_loop(0, n_full, body, jnp.zeros((x.shape[0], n_out), jnp.float32))
    if n_out % tile:
        out = out.at[:, n_full * tile :].set(tile_dot(q[:, n_full * tile :]))
    return out * scale


def _cpu_tile(n_in: int, n_out: int, itemsize: int, budget: int) -> int:
    """Widest power-of-two column count (>= 128) whose float copy fits `budget` bytes."""
    if n_in * n_out * itemsize <= budget:
        return n_out
    tile = 128
    while (tile * 2) * n_in * itemsize <= budget:
        tile *= 2
    return tile


def _w8a8(x: jax.Array, q: jax.Array, w_scale: jax.Array) -> jax.Array:
    """[M, in] x int8[in, out] -> f32[M, out] with dynamic per-row int8 activation scales."""
    x32 = x.astype(jnp.float32)
    x_scale = jnp.max(jnp.abs(x32), axis=-1) / INT8_MAX  # [M]
    safe = jnp.where(x_scale > 0, x_scale, 1.0)
    xq = jnp.clip(jnp.round(x32 / safe[:, None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    rows = xq.shape[0]
    if rows < W8A8_MIN_ROWS:
        # Zero rows contribute nothing and are sliced off; the row count is static.
        xq = jnp.pad(xq, ((0, W8A8_MIN_ROWS - rows), (0, 0)))
    acc = jax.lax.dot_general(
        xq, q, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32
    )[:rows]  # [M, out]
    return acc.astype(jnp.float32) * x_scale[:, None] * w_scale
