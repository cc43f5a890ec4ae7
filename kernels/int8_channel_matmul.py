"""Per-output-channel int8 matmul: symmetric int8 weights (q in -127..127, one f32 scale per output column) times
activations quantized per row (token) over the whole K, in one int8 part or two (the rounding residual as a second
int8 row: ~15-bit activations), summed in int32 over all of K and scaled once per output. Optionally a residual
weight (int8-channel-w16: the weight's rounding residual as a second int8 weight with its own scales) is multiplied
by the activations' first part in the same call and added: `(f32(acc_0) * xs_0 + f32(acc_1) * xs_1) * ws +
(f32(acc_r) * xs_0) * ws_r`, one fixed float sequence on every path.

`int8_channel_matmul` is the entry point, and `grouped_matmul` for rows in groups, each group times its own weight of a
stack (a sparse MoE layer's experts, one call for all of them). On CPU it runs the native kernel (kernels/cpu/csrc/
int8_channel_matmul.cc, through XLA's FFI: AVX-512 VNNI, AMX-INT8 for calls of many rows, bit for bit the same
outputs at every row count); elsewhere, or with SLIPSTREAM_KERNELS=reference, `reference` does the same math in
JAX. `pack` lays a weight out for the kernel once, at load time; `reference_numpy` is the kernel's arithmetic in
numpy, operation for operation (its outputs equal the kernel's exactly: the tests' oracle). Imports none of our
packages.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from slipstream.kernels import native
from slipstream.kernels.q8_matmul import in_rows, row_range

TILE = 16    # output columns per packed tile (16 int32 lanes; an AMX B tile's width)
STEP = 64    # K is padded to this: one AMX tile's inputs
SHIFT = 128  # the activations are stored xq + 128 (the unsigned operand of vpdpbusd / tdpbusd)
TARGET = "slipstream_int8_channel_matmul"
TARGET_RESIDUAL = "slipstream_int8_channel_matmul_residual"
TARGET_RESIDUAL_ROWS = "slipstream_int8_channel_matmul_residual_rows"  # on a range of x's rows (into another's output)
TARGET_GROUPED = "slipstream_int8_channel_matmul_grouped"  # rows in groups, each group times its own weight
INT8_MAX = np.float32(127.0)
LO_STEPS = np.float32(254.0)  # the second part's scale: the first's / 254


def native_available() -> bool:
    """True when the native CPU kernel is built and registered (logged once either way)."""
    return native.load("int8_channel_matmul", "int8_channel_matmul")


def padded(k: int, n: int) -> tuple[int, int]:
    """(Kp, Np): K rounded up to 64 and N to 16."""
    return -(-k // STEP) * STEP, -(-n // TILE) * TILE


def pack(q: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Weights q int8 [K, N] (in, out; every value in -127..127) and scale [N] -> (packed int8 [Np/16, Kp*16],
    scales f32 [Np], colsum int32 [Np]). packed[t] holds columns 16t..16t+15 as [Kp/4][16][4]: 4 consecutive
    inputs of one column per int32 lane, 16 columns per 64 bytes. colsum[n] = sum_k q[k, n] (the +128 shift's
    correction). Padding is q = 0, scale 0."""
    q, scale = np.asarray(q), np.asarray(scale, np.float32).reshape(-1)
    if q.dtype != np.int8 or q.ndim != 2 or scale.shape != (q.shape[1],):
        raise ValueError(f"int8_channel_matmul.pack expects int8 q [K, N] and scale [N]; got q {q.dtype} {q.shape}, "
                         f"scale {scale.shape}")
    if q.size and q.min() < -127:
        raise ValueError("int8_channel_matmul.pack: q must lie in -127..127 (symmetric), found -128")
    k, n = q.shape
    kp, np_ = padded(k, n)
    full = np.zeros((np_, kp), np.int8)
    full[:n, :k] = q.T
    packed = full.reshape(np_ // TILE, TILE, kp // 4, 4).transpose(0, 2, 1, 3).reshape(np_ // TILE, kp * TILE)
    scales = np.zeros(np_, np.float32)
    scales[:n] = scale
    colsum = full.sum(axis=1, dtype=np.int32)
    return np.ascontiguousarray(packed), scales, colsum


def pack_jax(q: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """pack in JAX (inside a traced program: a weight not packed at load), q int8 [K, N] in -127..127, scale [N]."""
    k, n = q.shape
    kp, np_ = padded(k, n)
    full = jnp.pad(q.T, ((0, np_ - n), (0, kp - k)))                                     # [Np, Kp]
    packed = full.reshape(np_ // TILE, TILE, kp // 4, 4).transpose(0, 2, 1, 3).reshape(np_ // TILE, kp * TILE)
    scales = jnp.pad(scale.astype(jnp.float32).reshape(-1), (0, np_ - n))
    return packed, scales, full.astype(jnp.int32).sum(axis=1)


def unpack(packed: np.ndarray) -> np.ndarray:
    """Inverse of pack's layout: int8 [Np/16, Kp*16] -> q int8 [Kp, Np] (padding kept)."""
    tiles, width = packed.shape
    kp = width // TILE
    return np.asarray(packed).reshape(tiles, kp // 4, TILE, 4).transpose(1, 3, 0, 2).reshape(kp, tiles * TILE)


def quantize_rows_numpy(x: np.ndarray, parts: int) -> tuple[np.ndarray, np.ndarray]:
    """x f32 [M, K] -> (xq int8 [parts, M, K], xs f32 [parts, M]): the kernel's quantization, operation for
    operation in f32: xs = max|x| / 127, xq = round-half-even(x * (1 / xs)) in [-127, 127]; part 1 the residual
    x - xq * xs with scale xs / 254."""
    x = np.asarray(x, np.float32)
    s = np.abs(x).max(axis=1, initial=np.float32(0)) / INT8_MAX
    v, qs, ss = x, [], []
    for part in range(parts):
        inv = np.divide(np.float32(1), s, out=np.zeros_like(s), where=s > 0)
        q = np.clip(np.round(v * inv[:, None]), -127, 127).astype(np.int8)
        qs.append(q)
        ss.append(s)
        v = x - q.astype(np.float32) * s[:, None]
        s = s / LO_STEPS
    return np.stack(qs), np.stack(ss)


def reference_numpy(x: np.ndarray, q: np.ndarray, scale: np.ndarray, parts: int = 1,
                    residual: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """The kernel's outputs, bit for bit: x f32 [M, K], q int8 [K, N], scale [N] -> f32 [M, N]. The int32 sums
    exactly (in int64, then checked to fit), then (f32(acc_0) * xs_0 (+ f32(acc_1) * xs_1)) * scale in f32.
    residual: (r int8 [K, N], its scale [N]) with parts = 2: plus (f32(acc_r) * xs_0) * scale_r, acc_r the sums of
    r with the first part (the one-part quantization's rows: the same operations)."""
    xq, xs = quantize_rows_numpy(x, parts)

    def sums(xq_p, w):
        acc = np.asarray(xq_p).astype(np.int64) @ np.asarray(w).astype(np.int64)
        if np.abs(acc).max(initial=0) >= 2 ** 31:
            raise ValueError("int8_channel_matmul: int32 sums overflow (K too large)")
        return acc.astype(np.int32).astype(np.float32)

    f = sums(xq[0], q) * xs[0][:, None]
    if parts == 2:
        f = f + sums(xq[1], q) * xs[1][:, None]
    f = f * np.asarray(scale, np.float32).reshape(1, -1)
    if residual is not None:
        if parts != 2:
            raise ValueError("int8_channel_matmul: a residual weight needs parts = 2")
        r, scale_r = residual
        f = f + (sums(xq[0], r) * xs[0][:, None]) * np.asarray(scale_r, np.float32).reshape(1, -1)
    return f


def reference(x: jax.Array, packed: jax.Array, scales: jax.Array, *, n: int, parts: int = 1,
              residual: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """The same math in JAX (the path off CPU and with SLIPSTREAM_KERNELS=reference): x f32 [M, K] -> f32 [M, n].
    residual: (packed_lo, scales_lo) of the residual weight, times the first part (parts = 2)."""
    m, k = x.shape
    tiles, width = packed.shape
    kp = width // TILE

    def weight(p):
        return p.reshape(tiles, kp // 4, TILE, 4).transpose(1, 3, 0, 2).reshape(kp, tiles * TILE)[:k, :n]

    def sums(xq, w):
        return jax.lax.dot_general(xq.astype(jnp.int8), w, (((1,), (0,)), ((), ())),
                                   preferred_element_type=jnp.int32).astype(jnp.float32)

    q = weight(packed)
    s = jnp.max(jnp.abs(x), axis=1) / INT8_MAX
    v, y, first = x, None, None
    for _ in range(parts):
        inv = jnp.where(s > 0, 1.0 / jnp.where(s > 0, s, 1.0), 0.0)
        xq = jnp.clip(jnp.round(v * inv[:, None]), -127, 127)
        term = sums(xq, q) * s[:, None]
        y = term if y is None else y + term
        if first is None:
            first = (xq, s)
        v = x - xq * s[:, None]
        s = s / LO_STEPS
    y = y * scales[:n]
    if residual is not None:
        xq0, s0 = first
        y = y + (sums(xq0, weight(residual[0])) * s0[:, None]) * residual[1][:n]
    return y


def _native(x, packed, scales, colsum, *rest, n: int, parts: int, ranged: bool = False) -> jax.Array:
    """rest: (layer,) or, with a residual weight, (packed_lo, scales_lo, colsum_lo, layer); ranged: then
    (rows i32[2], into f32 [M, n] or None) after them (the rows target, writing into `into` in place)."""
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    if ranged:
        *rest, rows, into = rest
        aliases = {} if into is None else {len(rest) + 5: 0}
        into = jnp.zeros((0,), jnp.float32) if into is None else into
        return jax.ffi.ffi_call(TARGET_RESIDUAL_ROWS, out, input_output_aliases=aliases)(
            x, packed, scales, colsum, *rest, rows, into, parts=np.int32(parts))
    target = TARGET if len(rest) == 1 else TARGET_RESIDUAL
    return jax.ffi.ffi_call(target, out)(x, packed, scales, colsum, *rest, parts=np.int32(parts))


def _reference_at(x, packed, scales, colsum, *rest, n: int, parts: int, ranged: bool = False) -> jax.Array:
    rows_into = rest[-2:] if ranged else ()
    *lo, layer = rest[:-2] if ranged else rest
    weights = [packed, scales] + lo[:2]
    if packed.ndim == 3:  # a stack: the reference slices the layer's weight out of it
        weights = [jax.lax.dynamic_index_in_dim(a, layer, keepdims=False) for a in weights]
    y = reference(x, weights[0], weights[1], n=n, parts=parts, residual=tuple(weights[2:]) if lo else None)
    return in_rows(y, *rows_into)


def _check_weight(what: str, k: int, n: int, lead_w: tuple, packed, scales, colsum) -> None:
    kp, np_ = padded(k, n)
    if (packed.ndim != 2 + len(lead_w) or packed.shape != (*lead_w, np_ // TILE, kp * TILE)
            or scales.shape != (*lead_w, np_) or colsum.shape != (*lead_w, np_)):
        raise ValueError(f"int8_channel_matmul: {what} {packed.shape} / scales {scales.shape} / colsum {colsum.shape} "
                         f"do not hold a [{k}, {n}] weight{'' if not lead_w else ' stack [L, ...]'} (expected "
                         f"{(*lead_w, np_ // TILE, kp * TILE)} / {(*lead_w, np_)} twice); build them with "
                         "kernels.int8_channel_matmul.pack")
    if packed.dtype != jnp.int8 or scales.dtype != jnp.float32 or colsum.dtype != jnp.int32:
        raise ValueError(f"int8_channel_matmul: {what} int8, scales f32, colsum int32 (pack's); got {packed.dtype}, "
                         f"{scales.dtype}, {colsum.dtype}")


def int8_channel_matmul(x: jax.Array, packed: jax.Array, scales: jax.Array, colsum: jax.Array, *, n: int,
                        parts: int = 1, layer: jax.Array | int | None = None,
                        residual: tuple[jax.Array, jax.Array, jax.Array] | None = None, rows: tuple | None = None,
                        into: jax.Array | None = None) -> jax.Array:
    """x [..., K] (any float dtype) times a packed weight (pack's outputs) -> f32 [..., n]. parts: 1 (int8
    activations per row) or 2 (plus their int8 residual). With `layer` (an int32 scalar, traced or not), packed /
    scales / colsum are stacks [L, ...] and weight `layer` is used, read where it lies (no slice is copied).
    residual: a second weight packed alike (packed_lo, scales_lo, colsum_lo; stacks with `layer`), parts = 2:
    its product with the activations' first part is added in the same call (see the module's sequence).
    rows: (begin, end), int32 scalars (traced or not), with a residual weight: only x's rows [begin, end) (of x as
    [M, K]) are multiplied, each to what a call over every row gives it; the output's other rows are `into`'s (f32
    [M, n], another call's output, updated in place), or unspecified without it."""
    k = x.shape[-1]
    kp, _ = padded(k, n)
    lead_w = () if layer is None else packed.shape[:1]
    _check_weight("packed", k, n, lead_w, packed, scales, colsum)
    if parts not in (1, 2):
        raise ValueError(f"int8_channel_matmul: parts must be 1 or 2, got {parts}")
    if residual is not None:
        if parts != 2:
            raise ValueError(f"int8_channel_matmul: a residual weight needs parts = 2, got {parts}")
        if len(residual) != 3:
            raise ValueError("int8_channel_matmul: residual is (packed, scales, colsum) of a second weight")
        _check_weight("residual packed", k, n, lead_w, *residual)
    if kp > 65536:
        raise ValueError(f"int8_channel_matmul: K {k} is over 65536 (the int32 sums could overflow)")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).astype(jnp.float32)
    index = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(())
    if rows is not None and residual is None:
        raise ValueError("int8_channel_matmul: a row range is for a weight with its residual (int8-channel-w16)")
    args = (x2, packed, scales, colsum, *(residual or ()), index)
    if rows is not None:
        args += row_range(rows, into, x2.shape[0], n)
    ref = functools.partial(_reference_at, n=n, parts=parts, ranged=rows is not None)
    if native_available():
        y = jax.lax.platform_dependent(*args, cpu=functools.partial(_native, n=n, parts=parts, ranged=rows is not None),
                                       default=ref)
    else:
        y = ref(*args)
    return y.reshape(*lead, n)


def _grouped_reference(x, packed, scales, colsum, sizes, first, *, n: int, parts: int) -> jax.Array:
    """grouped_matmul in JAX: every group's weight times every row, each row keeping its own group's product."""
    m = x.shape[0]
    row_group = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(m), side="right")        # [M]; past the groups: G

    def body(g, y):
        w, s = (jax.lax.dynamic_index_in_dim(a, first + g, keepdims=False) for a in (packed, scales))
        return jnp.where((row_group == g)[:, None], reference(x, w, s, n=n, parts=parts), y)

    return jax.lax.fori_loop(0, sizes.shape[0], body, jnp.zeros((m, n), jnp.float32))


def _grouped_native(x, packed, scales, colsum, sizes, first, *, n: int, parts: int) -> jax.Array:
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    return jax.ffi.ffi_call(TARGET_GROUPED, out)(x, packed, scales, colsum, sizes, first, parts=np.int32(parts))


def grouped_matmul(x: jax.Array, packed: jax.Array, scales: jax.Array, colsum: jax.Array, sizes: jax.Array,
                   first: jax.Array | int, *, n: int, parts: int = 1) -> jax.Array:
    """Rows in groups times each group's weight: x [M, K] (any float dtype), its rows group after group (sizes
    int32 [G], sum(sizes) <= M), times weights first .. first + G - 1 of a packed stack [L, ...] (pack's outputs
    stacked) -> f32 [M, n]; each row's output is what int8_channel_matmul at its group's weight gives it, and rows
    past the groups' are 0. One native call whatever the groups (a sparse MoE layer's experts: models/moe.py)."""
    k = x.shape[-1]
    _check_weight("packed", k, n, packed.shape[:1], packed, scales, colsum)
    if parts not in (1, 2):
        raise ValueError(f"int8_channel_matmul: parts must be 1 or 2, got {parts}")
    if x.ndim != 2 or sizes.ndim != 1:
        raise ValueError(f"grouped_matmul: x [M, K] and sizes [G]; got x {x.shape}, sizes {sizes.shape}")
    args = (x.astype(jnp.float32), packed, scales, colsum, sizes.astype(jnp.int32),
            jnp.asarray(first, jnp.int32).reshape(()))
    ref = functools.partial(_grouped_reference, n=n, parts=parts)
    if native_available():
        return jax.lax.platform_dependent(*args, cpu=functools.partial(_grouped_native, n=n, parts=parts), default=ref)
    return ref(*args)
