"""Group-wise int8 weights, modes "q8_0" and "q8_0-a16" (llama.cpp's Q8_0): int8 with one f16
scale, and optionally one f16 offset, per 32 input channels per output column, packed once at load
for kernels.q8_matmul.

Load time only, in numpy, one layer at a time so no second float copy of the model exists. GGUF
Q8_0, Q4_0 and Q4_1 blocks convert exactly (a minimum becomes the group offset), Q4_K blocks with
their scales (products of an f16 and a 6-bit integer) rounded to f16, within 2^-11 relative; other GGUF
types are decoded by the `gguf` package one tensor at a time and rounded to Q8_0.
"""
from __future__ import annotations

import dataclasses
import mmap
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from slipstream.kernels import q8_matmul

GROUP = q8_matmul.GROUP
QUANTIZED_MODES: tuple[str, ...] = ("q8_0", "q8_0-a16")
INT8_MAX = 127.0
# (q int8 [N, K], d f32 [N, G]) or (q, d, m) with offsets m f32 [N, G]: w = q * d (+ m) per group
# (kernels.q8_matmul.pack stores d and m in f16)
Rows = tuple


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """Group-wise int8 weight (llama.cpp's Q8_0, see quantization/groupwise.py): one scale per 32
    inputs per output column, packed for kernels.q8_matmul: q u8[..., Np/16, Kp*16], scale
    f32[..., Np/16, Kp/32*16]; offset: None or like scale (w = q * scale + offset per group, GGUF's
    asymmetric blocks); logical = (in, out), the float weight's shape (static).
    mode (static): "q8_0" rounds activations to int8 per 32 values (llama.cpp's w8a8); "q8_0-a16"
    adds their int8 residual. Leading axes (stacked layers L) are sliced by lax.scan like any leaf.
    """

    q: jax.Array
    scale: jax.Array
    mode: str = dataclasses.field(metadata=dict(static=True))
    offset: jax.Array | None = None
    logical: tuple[int, int] | None = dataclasses.field(default=None, metadata=dict(static=True))

    def __post_init__(self) -> None:
        # Only the static field is checked: JAX rebuilds this node with placeholder leaves
        # (tracers, None, axis specs) during transformations.
        if self.mode not in QUANTIZED_MODES:
            raise ValueError(f"QuantizedWeight mode must be one of {QUANTIZED_MODES}, got {self.mode!r}")

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape of the float weight this stands for ([..., in, out])."""
        return (*self.q.shape[:-2], *self.logical)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dequantize(self, dtype: jnp.dtype = jnp.float32) -> jax.Array:
        """The float weight [..., in, out] (materialized; for tests and debugging, not the hot path)."""
        from slipstream.kernels.q8_matmul import GROUP, unpack, unpack_groups

        k, n = self.logical
        q, d = unpack(self.q, self.scale)  # [..., Np, Kp], [..., Np, Kp/32]
        w = q.astype(jnp.float32) * jnp.repeat(d, GROUP, axis=-1)
        if self.offset is not None:
            w = w + jnp.repeat(unpack_groups(self.offset), GROUP, axis=-1)
        return jnp.swapaxes(w[..., :n, :k], -1, -2).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedTable:
    """An embedding table [vocab, dim] as group-wise int8 rows, dequantized at lookup: q int8 [V, D],
    scale f32 [V, G] (one per 32 values of a row), offset None or like scale. A GGUF Q8_0 token_embd
    is kept as stored (its rows look up to exactly the floats a decoded table holds) at a quarter of
    an f32 table's bytes."""

    q: jax.Array
    scale: jax.Array
    offset: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def ndim(self) -> int:
        return self.q.ndim

    def lookup(self, tokens: jax.Array, dtype) -> jax.Array:
        """Rows `tokens` [T] -> [T, D] in `dtype` (q * scale (+ offset) in f32, as dequantize_rows)."""
        d = self.q.shape[-1]

        def groups(x):  # [T, G] -> [T, D]
            return jnp.repeat(jnp.take(x, tokens, axis=0).astype(jnp.float32), GROUP, axis=-1)[..., :d]

        w = jnp.take(self.q, tokens, axis=0).astype(jnp.float32) * groups(self.scale)
        if self.offset is not None:
            w = w + groups(self.offset)
        return w.astype(dtype)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The whole float table [V, D] (materialized: for a tied head built later, and tests)."""
        return self.lookup(jnp.arange(self.q.shape[0]), dtype)


def table_from_rows(rows: Rows) -> QuantizedTable:
    """(q int8 [V, D], d [V, G][, m]) -> a QuantizedTable on the default device (numpy's buffers
    handed over, scales in f32: exact for any block type)."""
    q, d, *m = rows
    return QuantizedTable(q=jax.device_put(np.ascontiguousarray(q, np.int8)),
                          scale=jax.device_put(np.ascontiguousarray(d, np.float32)),
                          offset=jax.device_put(np.ascontiguousarray(m[0], np.float32)) if m else None)


def quantize_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Float rows w [N, K] (one output column per row, GGUF's order) -> (q int8 [N, K], d f32 [N, G]):
    per 32 inputs d = max|w| / 127, rounded to f16 as llama.cpp's quantize_row_q8_0 stores it, and
    q = round(w / d) with that d (so the kernel's f16 scales are exact). An all-zero group gets d = 0."""
    n, k = w.shape
    kp = -(-k // GROUP) * GROUP
    wg = np.zeros((n, kp), np.float32)
    wg[:, :k] = w
    wg = wg.reshape(n, kp // GROUP, GROUP)
    d = (np.abs(wg).max(axis=-1) / np.float32(INT8_MAX)).astype(np.float16).astype(np.float32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    q = np.clip(np.round(wg * inv[..., None]), -INT8_MAX, INT8_MAX).astype(np.int8)
    return q.reshape(n, kp)[:, :k], d


def quantize_rows4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Float rows w [N, K] -> (q in 0..15 [N, K], d f32 [N, G], m f32 [N, G]): GGUF Q4_1's rounding per 32
    inputs, m the group's minimum and d its range / 15, both rounded to f16 as the kernel stores them, and
    q = round((w - m) / d) with those (pack_rows packs such rows at 4 bits). A constant group gets d = 0."""
    n, k = w.shape
    kp = -(-k // GROUP) * GROUP
    wg = np.zeros((n, kp), np.float32)
    wg[:, :k] = w
    if kp != k:  # the padding repeats each row's last input: no wider range for the last group
        wg[:, k:] = wg[:, k - 1:k]
    wg = wg.reshape(n, kp // GROUP, GROUP)
    lo, hi = wg.min(axis=-1), wg.max(axis=-1)
    m = lo.astype(np.float16).astype(np.float32)
    d = ((hi - lo) / np.float32(15)).astype(np.float16).astype(np.float32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    q = np.clip(np.round((wg - m[..., None]) * inv[..., None]), 0, 15).astype(np.int8)
    return q.reshape(n, kp)[:, :k], d, m


def dequantize_rows(q: np.ndarray, d: np.ndarray, m: np.ndarray | None = None) -> np.ndarray:
    """(q int8 [N, K], d [N, G], offsets m [N, G] or None) -> f32 [N, K], with no temporary as large
    as the result."""
    n, k = q.shape
    if k % GROUP:
        out = (q.astype(np.float32) * np.repeat(d, GROUP, axis=1)[:, :k]).astype(np.float32)
        return out if m is None else out + np.repeat(m, GROUP, axis=1)[:, :k]
    out = np.empty((n, k), np.float32)
    grouped = out.reshape(n, k // GROUP, GROUP)
    np.multiply(q.reshape(n, k // GROUP, GROUP), d[..., None].astype(np.float32), out=grouped)
    if m is not None:
        np.add(grouped, m[..., None].astype(np.float32), out=grouped)
    return out


def from_q8_0_blocks(raw: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """GGUF Q8_0 rows (u8 [N, K/32*34]: per block an f16 scale then 32 int8) -> (q [N, K], d [N, K/32])."""
    blocks = raw.reshape(raw.shape[0], k // GROUP, 34)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8).reshape(raw.shape[0], k)
    return q, d


def from_q4_0_blocks(raw: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """GGUF Q4_0 rows (per block an f16 scale, then 16 bytes: element j in the low nibble of byte j,
    element j+16 in the high one, both offset by 8) -> the same values in Q8_0, exactly."""
    blocks = raw.reshape(raw.shape[0], k // GROUP, 18)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 2:]
    q = np.concatenate([(qs & 0x0F), (qs >> 4)], axis=-1).astype(np.int8) - np.int8(8)
    return q.reshape(raw.shape[0], k), d


def from_q4_1_blocks(raw: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF Q4_1 rows (per block f16 scale d, f16 minimum m, then 16 bytes of nibbles as in Q4_0,
    unsigned: w = d * q + m) -> (q in 0..15, d, m): exact, the minimum as the group offset."""
    blocks = raw.reshape(raw.shape[0], k // GROUP, 20)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]
    q = np.concatenate([(qs & 0x0F), (qs >> 4)], axis=-1).astype(np.int8)
    return q.reshape(raw.shape[0], k), d, m


def from_q4_k_blocks(raw: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF Q4_K rows (super-blocks of 256: f16 d and dmin, 6-bit scale and minimum per 32, 4-bit q:
    w = d * sc * q - dmin * m) -> (q in 0..15, d * sc, -dmin * m) per group of 32: exact."""
    from gguf.quants import Q4_K

    n = raw.shape[0]
    blocks = raw.reshape(n * (k // 256), 144)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)        # [B, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16].copy())                  # [B, 8] each
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    q = (qs & np.uint8(0x0F)).astype(np.int8).reshape(n, k)              # sub-block s = nibbles of chunk s // 2
    scale = (d * sc.astype(np.float32)).reshape(n, k // GROUP)
    offset = -(dmin * mn.astype(np.float32)).reshape(n, k // GROUP)
    return q, scale, offset


HUGE_PAGE = 2 << 20
use_huge_pages = True  # module switch, for A/B benchmarks


def host_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """np.empty for a weight the kernels stream at every step: an array of 2 MiB or more lies in
    memory 2 MiB-aligned and advised for transparent huge pages (Linux), which streams faster (no
    TLB miss and page walk every 4 KiB) and which XLA:CPU takes without a copy (jax.device_put)."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if not use_huge_pages or nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.empty(shape, dtype)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: the pages are faulted in huge
    raw = np.frombuffer(region, np.uint8)  # keeps the mapping alive as long as any view of it
    start = -raw.ctypes.data % HUGE_PAGE
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def host_copy(a: np.ndarray) -> np.ndarray:
    """`a` copied into host_empty memory (a copy only when that memory differs)."""
    out = host_empty(a.shape, a.dtype)
    if out.nbytes < HUGE_PAGE:
        return np.ascontiguousarray(a)
    np.copyto(out, a)
    return out


# Weights whose q all lie in 0..15 (GGUF's Q4_1 and Q4_K blocks) are packed at 4 bits: the same
# products from 20 instead of 36 bytes per group and column (module switch, for A/B benchmarks).
pack_nibbles = True


def pack_rows(rows: Rows) -> tuple[np.ndarray, ...]:
    """slipstream.kernels.q8_matmul.pack of (q, d[, m]), at 4 bits where q allows it and pack_nibbles is on."""
    bits = q8_matmul.pack_bits(rows[0]) if pack_nibbles else 8
    return q8_matmul.pack(*rows, bits=bits)


def stack_packed(layers: list[tuple[np.ndarray, ...]], k: int, n: int, mode: str = "q8_0"):
    """Per-layer kernels.q8_matmul.pack outputs -> one QuantizedWeight [L, K, N]; empties `layers`
    as it goes, so at most one extra host copy of this weight exists at a time. Layers with and
    without offsets may mix (zero offsets fill in)."""
    if len({layer[0].shape for layer in layers}) > 1:  # 4- and 8-bit layers: all at 8 bits
        layers[:] = [(q8_matmul.widen(packed), *rest) if q8_matmul.packed_bits(packed.shape[-1], rest[0].shape[-1]) == 4
                     else (packed, *rest) for packed, *rest in layers]
    packed = host_empty((len(layers), *layers[0][0].shape), np.uint8)
    scales = host_empty((len(layers), *layers[0][1].shape), np.float16)
    offsets = None
    if any(len(layer) == 3 for layer in layers):
        offsets = host_empty((len(layers), *layers[0][1].shape), np.float16)
        offsets.fill(0)
    for i in range(len(layers)):
        packed[i], scales[i] = layers[i][:2]
        if len(layers[i]) == 3:
            offsets[i] = layers[i][2]
        layers[i] = None
    layers.clear()
    # device_put hands numpy's buffer to XLA; jnp.asarray would compile a copy program per shape
    return QuantizedWeight(q=jax.device_put(packed), scale=jax.device_put(scales), mode=mode, logical=(k, n),
                           offset=None if offsets is None else jax.device_put(offsets))


def pack_layers(rows: Sequence[Rows], mode: str = "q8_0"):
    """Per-layer rows -> one QuantizedWeight [L, K, N] (leading layer axis), packed."""
    n, k = rows[0][0].shape
    return stack_packed([pack_rows(r) for r in rows], k, n, mode)


def pack_one(rows: Rows, mode: str = "q8_0"):
    """Rows (q [N, K], d [N, G][, m]) -> a QuantizedWeight of logical shape [K, N]."""
    packed, scales, *offset = pack_rows(rows)
    return QuantizedWeight(q=jax.device_put(host_copy(packed)), scale=jax.device_put(host_copy(scales)), mode=mode,
                           logical=(rows[0].shape[1], rows[0].shape[0]),
                           offset=jax.device_put(host_copy(offset[0])) if offset else None)


def quantize_weight(w, mode: str = "q8_0", bits: int = 8) -> object:
    """A float weight [..., in, out] (array) -> group-wise QuantizedWeight, one leading index at a time;
    bits=4: Q4_1 rows (quantize_rows4), packed at 4 bits."""
    rows = quantize_rows4 if bits == 4 else quantize_rows
    w = np.asarray(w)
    lead = w.shape[:-2]
    if not lead:
        return pack_one(rows(np.asarray(w, np.float32).T), mode)
    flat = w.reshape(-1, *w.shape[-2:])
    qw = pack_layers([rows(np.asarray(flat[i], np.float32).T) for i in range(flat.shape[0])], mode)
    if len(lead) == 1:
        return qw
    return type(qw)(q=qw.q.reshape(*lead, *qw.q.shape[1:]), scale=qw.scale.reshape(*lead, *qw.scale.shape[1:]),
                    mode=mode, logical=qw.logical)
