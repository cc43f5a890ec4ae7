"""Group-wise int8 matmul in llama.cpp's Q8_0 layout: weights int8 with one f16 scale (and, for
asymmetric sources such as GGUF Q4_1, one f16 offset) per 32 input channels per output column;
activations quantized per row and group of 32 at run time, in one int8 part (as llama.cpp does) or
two (the rounding residual as a second int8 row: ~15-bit activations for twice the multiplies).

`q8_matmul` is the one entry point. On CPU it runs the native kernel (kernels/cpu/csrc/q8_matmul.cc,
through XLA's FFI); elsewhere, or with SLIPSTREAM_KERNELS=reference, `reference` does the same
math in JAX. `pack` lays weights out for the kernel once, at load time. Weights whose values all lie
in 0..15 (GGUF's 4-bit blocks) may be packed two to a byte (`bits=4`): the same products from half
the bytes; the packed array's width tells the two apart. Imports none of our packages.
"""
from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from slipstream.kernels import native, settings

GROUP = 32  # input channels per scale (a Q8_0 block)
TILE = 16   # output columns per packed tile: 16 int32 lanes of one AVX-512 vector
SHIFT = 128  # the packed weights are w + 128 (the unsigned operand of vpdpbusd)
TARGET = "slipstream_q8_matmul"
TARGET_ROWS = "slipstream_q8_matmul_rows"  # the same on a range of x's rows (into another call's output)
INT8_MAX = 127.0


def native_available() -> bool:
    """True when the native CPU kernel is built and registered (logged once either way): a CPU
    default of a q8_0 mode should depend on it, since the reference is several times slower."""
    return native.load("q8_matmul", "q8_matmul")


def gated_native() -> bool:
    """True when a gated q8_matmul runs natively with the AVX-512 path's vector silu: where it does
    not, a model should form silu(gate) * up itself (XLA's fusion beats the portable loop)."""
    return native_available() and importlib.import_module("slipstream.kernels._q8_matmul").isa() in ("avx512_vnni", "amx")


def padded(k: int, n: int) -> tuple[int, int]:
    """(Kp, Np): the packed sizes, K rounded up to a group and N to a tile."""
    return -(-k // GROUP) * GROUP, -(-n // TILE) * TILE


def packed_bits(packed_width: int, scales_width: int) -> int:
    """8 or 4: the bits per weight of a packed weight, from its packed and scales widths (Kp*16 or
    Kp*8 bytes against Kp/32*16 scales)."""
    ratio, rest = divmod(packed_width, scales_width) if scales_width else (0, 1)
    if rest or ratio not in (GROUP, GROUP // 2):
        raise ValueError(f"q8_matmul: packed width {packed_width} against scales width {scales_width} is "
                         "neither 8 nor 4 bits per weight (kernels.q8_matmul.pack)")
    return 8 if ratio == GROUP else 4


def pack(q: np.ndarray, d: np.ndarray, m: np.ndarray | None = None, *, bits: int = 8) -> tuple[np.ndarray, ...]:
    """Weights q int8 [N, K] (row n: output column n, as GGUF stores them) with scales d
    [N, ceil(K/32)] and optional offsets m like d (w = q * d + m per group) -> (packed u8
    [Np/16, Kp*16], scales f16 [Np/16, Kp/32*16]) plus offsets laid out like scales when m is given.

    packed[t] holds tile t (columns 16t..16t+15) as [Kp/4][16][4]: 4 consecutive inputs of one column
    per int32 lane, 16 columns per 64 bytes, q + 128 stored unsigned. Padding is q = 0, d = m = 0.
    d and m are stored in f16, as GGUF stores its block scales (so those load exactly; the one-row
    kernel streams 36 bytes per group and column instead of 40 with f32): pass d already rounded to
    f16 when q was computed from it (quantization.groupwise.quantize_rows does).

    bits=4 (every q in 0..15): packed [Np/16, Kp*8], each 64 bytes two of the 64-byte vectors above,
    byte b = q of vector 2i's byte b | q of vector 2i+1's byte b << 4.
    """
    n, k = q.shape
    kp, np_ = padded(k, n)
    if q.dtype != np.int8 or d.shape != (n, kp // GROUP) or (m is not None and m.shape != d.shape):
        raise ValueError(f"pack expects int8 q [N, K] and f32 d (and m) [N, ceil(K/32)]; got q {q.dtype} "
                         f"{q.shape}, d {d.shape}" + ("" if m is None else f", m {m.shape}"))
    if bits not in (8, 4):
        raise ValueError(f"pack: bits must be 8 or 4, got {bits}")
    if bits == 4 and pack_bits(q) != 4:
        raise ValueError(f"pack: 4-bit packing needs every q in 0..15 (got {q.min()}..{q.max()})")
    full = np.full((np_, kp), SHIFT, np.uint8)
    full[:n, :k] = (q.astype(np.int16) + SHIFT).astype(np.uint8)
    packed = full.reshape(np_ // TILE, TILE, kp // 4, 4).transpose(0, 2, 1, 3).reshape(np_ // TILE, kp * TILE)
    if bits == 4:
        pairs = (packed - np.uint8(SHIFT)).reshape(np_ // TILE, kp // 8, 2, 64)
        packed = (pairs[:, :, 0] | (pairs[:, :, 1] << np.uint8(4))).reshape(np_ // TILE, kp * TILE // 2)

    def per_group(v: np.ndarray) -> np.ndarray:
        if not np.all(np.isfinite(v)) or np.abs(v).max(initial=0) > np.finfo(np.float16).max:
            raise ValueError(f"pack: a weight group's scale or offset is not a finite f16 (max |value| "
                             f"{np.abs(v).max(initial=0):.3g}, f16 holds up to {np.finfo(np.float16).max:g})")
        s = np.zeros((np_, kp // GROUP), np.float16)
        s[:n] = v
        return np.ascontiguousarray(s.reshape(np_ // TILE, TILE, kp // GROUP).transpose(0, 2, 1)
                                    .reshape(np_ // TILE, kp // GROUP * TILE))

    out = (np.ascontiguousarray(packed), per_group(d))
    return out if m is None else (*out, per_group(m))


def amx_tiles_wanted() -> bool:
    """True when the native kernel runs on the AMX tile unit here (an Intel CPU and OS that grant it) and
    SLIPSTREAM_AMX_BF16=1 asks for the bf16 path: then a two-part (q8_0-a16) weight that serves many-row calls gets
    its pack_tiles copy. Without it the tile unit runs the int8 path, which needs no copy."""
    return (settings.AMX_BF16.get() and native_available()
            and importlib.import_module("slipstream.kernels._q8_matmul").isa() == "amx")


def pack_tiles(packed: np.ndarray, scales: np.ndarray, offsets: np.ndarray | None = None) -> np.ndarray:
    """A packed weight (pack's outputs, 8 or 4 bits) -> its bf16 B tiles for the AMX path, uint16 bits
    [Np/16, Kp*32]: w = q * d (+ m) rounded once to f32 (q * d is exact in f32), w_hi = bf16(w), w_lo = bf16(w -
    w_hi) (nearest even); per 16-column tile and group of 32 inputs w_hi's tile, then w_lo's, each 16 rows
    [input pair j][column][2]. 4 bytes per weight, made once at load (kernels/cpu/csrc/q8_matmul.cc, TileBf16)."""
    packed, scales = np.asarray(packed), np.asarray(scales)
    if packed_bits(packed.shape[-1], scales.shape[-1]) == 4:
        packed = widen(packed)
    tiles, width = packed.shape
    kp, g = width // TILE, width // TILE // GROUP
    q = packed.reshape(tiles, kp // 4, TILE, 4).transpose(0, 2, 1, 3).reshape(tiles, TILE, kp)  # [T, 16, Kp] + 128
    per_input = lambda v: np.repeat(np.asarray(v).reshape(tiles, g, TILE).transpose(0, 2, 1).astype(np.float32),  # noqa: E731
                                    GROUP, axis=-1)  # [T, 16, Kp]
    w = (q.astype(np.float32) - SHIFT) * per_input(scales)
    if offsets is not None:
        w += per_input(offsets)
    hi = w.astype(ml_dtypes.bfloat16)
    lo = (w - hi.astype(np.float32)).astype(ml_dtypes.bfloat16)
    split = np.stack([hi.view(np.uint16), lo.view(np.uint16)], axis=2)           # [T, 16, 2, Kp]
    out = split.reshape(tiles, TILE, 2, g, TILE, 2).transpose(0, 3, 2, 4, 1, 5)  # [T, G, hi/lo, pair, col, 2]
    return np.ascontiguousarray(out).reshape(tiles, kp * 32)


def _widened(xp, packed):
    """4-bit packed bytes [..., W] -> the same weights' 8-bit packing [..., 2W] (u8, q + 128), with
    xp = numpy or jax.numpy: each 64 bytes become their low nibbles' vector, then their high ones'."""
    pairs = packed.reshape(*packed.shape[:-1], packed.shape[-1] // 64, 1, 64)
    out = xp.concatenate([pairs & xp.uint8(0x0F), pairs >> xp.uint8(4)], axis=-2) + xp.uint8(SHIFT)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def widen(packed: np.ndarray) -> np.ndarray:
    """A 4-bit packed weight (or stack of them) [..., Np/16, Kp*8] -> the same weight at 8 bits
    [..., Np/16, Kp*16], in numpy (to stack or fuse it with 8-bit weights)."""
    return _widened(np, np.asarray(packed))


def pack_bits(q: np.ndarray) -> int:
    """4 when every value of q lies in 0..15 (it packs two to a byte), else 8."""
    return 4 if q.size and q.min() >= 0 and q.max() <= 15 else 8


def unpack(packed: jax.Array, scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inverse of pack (8 or 4 bits), padding kept: (q int32 [..., Np, Kp], d f32 [..., Np, Kp/32]);
    offsets unpack like scales (unpack_groups)."""
    tiles, width = packed.shape[-2:]
    lead = packed.shape[:-2]
    if packed_bits(width, scales.shape[-1]) == 4:
        packed = _widened(jnp, jnp.asarray(packed))
        width *= 2
    kp = width // TILE
    q = packed.reshape(*lead, tiles, kp // 4, TILE, 4)
    q = jnp.swapaxes(q, -3, -2).reshape(*lead, tiles * TILE, kp).astype(jnp.int32) - SHIFT
    return q, unpack_groups(scales)


def unpack_groups(v: jax.Array) -> jax.Array:
    """Scales or offsets f16 [..., Np/16, G*16] -> f32 [..., Np, G]."""
    tiles, width = v.shape[-2:]
    lead = v.shape[:-2]
    g = width // TILE
    return jnp.swapaxes(v.reshape(*lead, tiles, g, TILE), -2, -1).reshape(*lead, tiles * TILE, g).astype(jnp.float32)


def quantize_activations(x: jax.Array, kp: int, parts: int = 1) -> tuple[jax.Array, jax.Array]:
    """x f32 [M, K] -> (xq int8 [parts, M, Kp/32, 32], xs f32 [parts, M, Kp/32]), as llama.cpp's
    quantize_row_q8_0: xs = max|x| / 127, xq = round-half-even(x * (1 / xs)); with parts = 2 the
    residual x - xq * xs again, with scale xs / 254. The kernel does the same operations."""
    m, k = x.shape
    v = jnp.pad(x, ((0, 0), (0, kp - k))).reshape(m, kp // GROUP, GROUP)
    d = jnp.max(jnp.abs(v), axis=-1) / INT8_MAX
    qs, ds = [], []
    for part in range(parts):
        inv = jnp.where(d > 0, 1.0 / jnp.where(d > 0, d, 1.0), 0.0)
        q = jnp.clip(jnp.round(v * inv[..., None]), -INT8_MAX, INT8_MAX)
        qs.append(q.astype(jnp.int8))
        ds.append(d)
        v = v - q * d[..., None]
        d = d / 254.0
    return jnp.stack(qs), jnp.stack(ds)


def reference(x: jax.Array, packed: jax.Array, scales: jax.Array, offsets: jax.Array | None = None, *,
              n: int, parts: int = 1) -> jax.Array:
    """x f32 [M, K] -> f32 [M, n]: per group g and part, the exact int32 dot of xq and q times
    xs * d, summed over groups in order; plus offsets times each group's sum of x (the kernel's
    math; only float rounding may differ)."""
    m, k = x.shape
    q, d = unpack(packed, scales)                                   # [Np, Kp], [Np, G]
    kp = q.shape[1]
    xq, xs = quantize_activations(x, kp, parts)                     # [P, M, G, 32], [P, M, G]
    qg = jnp.moveaxis(q.reshape(q.shape[0], kp // GROUP, GROUP), 1, 0)  # [G, Np, 32]
    xq = xq.reshape(parts * m, kp // GROUP, GROUP)
    xs = xs.reshape(parts * m, kp // GROUP)

    def group(y, g):
        xq_g, xs_g, q_g, d_g = g                                    # [PM,32], [PM], [Np,32], [Np]
        dot = jax.lax.dot_general(xq_g.astype(jnp.int32), q_g, (((1,), (1,)), ((), ())))  # [PM, Np]
        return y + dot.astype(jnp.float32) * (d_g[None, :] * xs_g[:, None]), None

    y0 = jnp.zeros((parts * m, q.shape[0]), jnp.float32)
    y, _ = jax.lax.scan(group, y0, (jnp.moveaxis(xq, 1, 0), xs.T, qg, d.T))
    y = y.reshape(parts, m, -1).sum(axis=0)
    if offsets is not None:
        sums = jnp.pad(x, ((0, 0), (0, kp - k))).reshape(m, kp // GROUP, GROUP).sum(-1)  # [M, G]
        y = y + jnp.dot(sums, unpack_groups(offsets).T, precision=jax.lax.Precision.HIGHEST)
    return y[:, :n]


def _native(x: jax.Array, packed: jax.Array, scales: jax.Array, offsets: jax.Array | None, tiles: jax.Array | None,
            layer: jax.Array, *rows_into, n: int, parts: int, gated: bool = False) -> jax.Array:
    """rows_into: () or (rows i32[2], into f32 [M, n] or None): the rows target, writing into `into` in place."""
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    if offsets is None:
        offsets = jnp.zeros((0,), jnp.float16)
    if tiles is None:
        tiles = jnp.zeros((0,), jnp.uint16)
    attrs = dict(parts=np.int32(parts), gated=np.int32(gated),
                 bits=np.int32(packed_bits(packed.shape[-1], scales.shape[-1])))
    if not rows_into:
        return jax.ffi.ffi_call(TARGET, out)(x, packed, scales, offsets, tiles, layer, **attrs)
    rows, into = rows_into
    aliases = {} if into is None else {7: 0}
    into = jnp.zeros((0,), jnp.float32) if into is None else into
    return jax.ffi.ffi_call(TARGET_ROWS, out, input_output_aliases=aliases)(x, packed, scales, offsets, tiles, layer,
                                                                             rows, into, **attrs)


def gated_input(x: jax.Array) -> jax.Array:
    """silu(gate) * up of x = gate | up [..., 2K]: what a gated q8_matmul multiplies."""
    k = x.shape[-1] // 2
    return jax.nn.silu(x[..., :k]) * x[..., k:]


def _reference_at(x: jax.Array, packed: jax.Array, scales: jax.Array, offsets: jax.Array | None, tiles,
                  layer: jax.Array, *rows_into, n: int, parts: int, gated: bool = False) -> jax.Array:
    if packed.ndim == 3:  # a stack: the reference slices the layer's weight out of it
        pick = lambda a: None if a is None else jax.lax.dynamic_index_in_dim(a, layer, keepdims=False)  # noqa: E731
        packed, scales, offsets = pick(packed), pick(scales), pick(offsets)
    y = reference(gated_input(x) if gated else x, packed, scales, offsets, n=n, parts=parts)
    return in_rows(y, *rows_into)


def in_rows(y: jax.Array, rows: jax.Array | None = None, into: jax.Array | None = None) -> jax.Array:
    """y [M, N] on rows [rows[0], rows[1]) and `into` on the others (y itself without `into`): a row-range call's
    result from a product over every row (the reference paths)."""
    if rows is None or into is None:
        return y
    r = jnp.arange(y.shape[0], dtype=jnp.int32)[:, None]
    return jnp.where((r >= rows[0]) & (r < rows[1]), y, into)


def row_range(rows, into: jax.Array | None, m: int, n: int) -> tuple[jax.Array, jax.Array | None]:
    """A call's rows (begin, end: two scalars or an i32[2]) as i32[2] and its `into` checked against its output
    [m, n]. The kernels clamp the range to [0, m]."""
    if into is not None and (into.shape != (m, n) or into.dtype != jnp.float32):
        raise ValueError(f"into must be the call's f32 output [{m}, {n}], got {into.dtype} {tuple(into.shape)}")
    if isinstance(rows, jax.Array) and rows.shape == (2,) and rows.dtype == jnp.int32:
        return rows, into
    if len(rows) != 2:
        raise ValueError(f"rows is (begin, end), got {rows!r}")
    return jnp.stack([jnp.asarray(r, jnp.int32).reshape(()) for r in rows]), into


def q8_matmul(x: jax.Array, packed: jax.Array, scales: jax.Array, offsets: jax.Array | None = None, *,
              n: int, parts: int = 1, layer: jax.Array | int | None = None, gated: bool = False,
              tiles: jax.Array | None = None, rows: tuple | None = None, into: jax.Array | None = None) -> jax.Array:
    """x [..., K] (any float dtype) times a packed weight -> f32 [..., n]. parts: 1 (int8
    activations, llama.cpp's w8a8) or 2 (int8 activations plus their int8 residual).
    With `layer` (an int32 scalar, traced or not), packed / scales / offsets are a stack of weights
    [L, ...] (pack's outputs stacked) and weight `layer` is used: the native kernel reads it where it
    lies, so a scanned layer loop passes the whole stack and no slice of it is copied.
    gated: x is gate | up [..., 2K] (a gated MLP's gate/up output) and the matmul's input is
    silu(gate) * up (gated_input), which the native kernel forms row by row as it quantizes.
    tiles: the weight's pack_tiles (stacked like packed when `layer` is given), or None: with them, two-part
    calls of many rows run on the AMX bf16 tile path where the kernel has it (close to, not bit for bit, the
    other paths' results; the reference ignores them). Without them AMX runs the int8 tile path, which gives the
    VNNI path's outputs exactly.
    rows: (begin, end), int32 scalars (traced or not): only x's rows [begin, end) (of x as [M, K]) are multiplied,
    each to what a call over every row gives it; the output's other rows are `into`'s (f32 [M, n], another call's
    output, updated in place), or unspecified without it."""
    if gated and x.shape[-1] % 2:
        raise ValueError(f"q8_matmul: a gated x holds gate | up, an even width; got {x.shape}")
    k = x.shape[-1] // 2 if gated else x.shape[-1]
    kp, np_ = padded(k, n)
    group_shape = (np_ // TILE, kp // GROUP * TILE)
    lead_w = packed.shape[:-2]
    if (len(lead_w) != (0 if layer is None else 1)
            or packed.shape[-2:] not in ((np_ // TILE, kp * TILE), (np_ // TILE, kp * TILE // 2))
            or scales.shape != (*lead_w, *group_shape)
            or (offsets is not None and offsets.shape != (*lead_w, *group_shape))):
        raise ValueError(f"q8_matmul: packed {packed.shape} / scales {scales.shape} do not hold a "
                         f"[{k}, {n}] weight{'' if layer is None else ' stack [L, ...]'} (expected "
                         f"{(*lead_w, np_ // TILE, kp * TILE)} (4 bits: half as wide) / {(*lead_w, *group_shape)}, offsets like "
                         "scales); build them with kernels.q8_matmul.pack")
    if tiles is not None and (tiles.dtype != jnp.uint16 or tiles.shape != (*lead_w, np_ // TILE, kp * 32)):
        raise ValueError(f"q8_matmul: tiles {tiles.dtype} {tiles.shape} are not this weight's pack_tiles (expected "
                         f"uint16 {(*lead_w, np_ // TILE, kp * 32)})")
    if scales.dtype != jnp.float16 or (offsets is not None and offsets.dtype != jnp.float16):
        raise ValueError(f"q8_matmul: scales and offsets are f16 (kernels.q8_matmul.pack), got {scales.dtype}"
                         + ("" if offsets is None else f" / {offsets.dtype}"))
    if parts not in (1, 2):
        raise ValueError(f"q8_matmul: parts must be 1 or 2, got {parts}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    index = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(())
    ref = functools.partial(_reference_at, n=n, parts=parts, gated=gated)
    rows_into = () if rows is None else row_range(rows, into, x2.shape[0], n)
    if native.load("q8_matmul", "q8_matmul"):
        y = jax.lax.platform_dependent(x2, packed, scales, offsets, tiles, index, *rows_into,
                                       cpu=functools.partial(_native, n=n, parts=parts, gated=gated), default=ref)
    else:
        y = ref(x2, packed, scales, offsets, tiles, index, *rows_into)
    return y.reshape(*lead, n)

