"""int8 weights for the MXU and GPU tensor cores, quantized on the device in JAX: "int8" (one scale and
offset per 32 inputs per output channel, dequantized to the activation dtype inside the dot), "int4" (the same
with 4-bit values packed two a byte and bf16 scales and offsets: 5 bits a weight; the LM head stays "int8") and
"int8-channel" (one symmetric scale per output channel; int8 x int8 dots for steps of many rows) and
"int8-channel-a16" (the same weights, activations never rounded to one int8 part), and "int8-channel-w16" (the
int8-channel-a16 weight plus its rounding residual as a second int8 weight with 1/254 of its scale: ~16 bits per
weight). On CPU they run the native per-channel kernel (kernels/int8_channel_matmul.py) at every row count:
activations rounded per row to one int8 part (int8-channel) or two (the others, ~15 bits; the residual weight
multiplies one part), so a row's result never depends on the call's rows."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from slipstream.kernels import int8_channel_matmul as icm
from slipstream.kernels import native
from slipstream.kernels.tpu.nibbles import pack4, unpack4

MODES: tuple[str, ...] = ("int8", "int4", "int8-channel", "int8-channel-a16", "int8-channel-w16")
CHANNEL_MODES: tuple[str, ...] = ("int8-channel", "int8-channel-a16", "int8-channel-w16")
GROUP = 32        # inputs per scale and offset in mode "int8" (a GGUF block: Q4_1/Q8_0 sources round exactly)
A8_MIN_ROWS = 256  # "int8-channel": steps of this many rows or more quantize activations (prefill chunks)
LEVELS = 255.0    # asymmetric: q in -128..127 spans [min, max] of a group
INT8_MAX = 127.0  # symmetric: q in -127..127 spans [-max|w|, max|w|]
INT4_LEVELS, INT4_MAX = 15.0, 7.0  # "int4": q in -8..7 over [min, max], or -7..7 over +-max|w|
RESIDUAL = 254.0  # "int8-channel-w16": the residual weight's scale is the weight's / RESIDUAL


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Weight:
    """An int8 weight w [..., in, out] = q * scale + offset, per block of `block` inputs per output
    channel: q int8 [..., in, out], scale f32 [..., G, out] with G = ceil(in / block), offset like scale
    or None (symmetric). Leading axes (stacked layers L) are sliced by lax.scan like any leaf.
    a8_rows (static): a matmul of at least this many rows rounds each row of activations to int8
    (one scale per row) and multiplies in int32; None: always float activations (w8a16). On CPU, where the
    native per-channel kernel runs (one scale per output channel), a8_rows is not used: every call rounds each
    row to `parts` int8 parts (static: 1 or 2), whatever its row count.
    residual: per-channel only ("int8-channel-w16"), int8 like q: the weight is (q + residual / RESIDUAL) * scale;
    on CPU the residual multiplies the activations' first int8 part in the same kernel call.
    bits (static): 4 for "int4": q holds two 4-bit values a byte, [..., in / 2, out], in
    kernels/tpu/nibbles.py's layout (`values` unpacks them); `shape` and `in_features` are the logical ones."""

    q: jax.Array
    scale: jax.Array
    offset: jax.Array | None = None
    block: int = dataclasses.field(default=GROUP, metadata=dict(static=True))
    a8_rows: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    parts: int = dataclasses.field(default=1, metadata=dict(static=True))
    residual: jax.Array | None = None
    bits: int = dataclasses.field(default=8, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's logical shape [..., in, out] (q's, but for 4-bit values' packed input axis)."""
        return (*self.q.shape[:-2], self.in_features, self.q.shape[-1])

    @property
    def in_features(self) -> int:
        return int(self.q.shape[-2]) * 8 // self.bits

    def values(self) -> jax.Array:
        """q as one int8 value per weight [..., in, out] (4-bit values unpacked)."""
        return unpack4(self.q) if self.bits == 4 else self.q

    @property
    def ndim(self) -> int:
        return self.q.ndim

    def dequantize(self, dtype: jnp.dtype = jnp.float32) -> jax.Array:
        """The float weight [..., in, out] (f32 math, then `dtype`)."""
        k = self.in_features
        scale = jnp.repeat(self.scale.astype(jnp.float32), self.block, axis=-2)[..., :k, :]
        q = self.values().astype(jnp.float32)
        if self.residual is not None:
            q = q + self.residual.astype(jnp.float32) / RESIDUAL
        w = q * scale
        if self.offset is not None:
            w = w + jnp.repeat(self.offset.astype(jnp.float32), self.block, axis=-2)[..., :k, :]
        return w.astype(dtype)


def quantize(w: jax.Array, mode: str = "int8") -> Int8Weight:
    """A float weight [..., in, out] (a jax.Array stays on its device: no host copy) -> Int8Weight."""
    if mode not in MODES:
        raise ValueError(f"int8 weight mode must be one of {MODES}, got {mode!r}")
    if w.ndim < 2:
        raise ValueError(f"expected a weight of shape [..., in, out], got shape {tuple(w.shape)}")
    if w.ndim == 3:  # stacked layers: rounded one at a time (the temporaries are one layer's)
        return quantize_layers(_index_layer, (jnp.asarray(w),), int(w.shape[0]), mode)
    return _weight(_round(jnp.asarray(w), mode), mode, int(w.shape[-2]))


def _round(w: jax.Array, mode: str) -> tuple[jax.Array, ...]:
    if mode == "int8":
        return _quantize_asymmetric(w, GROUP)
    if mode == "int4":  # pack4 refuses inputs that are not whole pairs of groups (64), naming the count
        q, scale, offset = _quantize_asymmetric(w, GROUP, 4)
        return pack4(q), scale, offset
    if mode == "int8-channel-w16":
        return _quantize_symmetric_residual(w)
    return _quantize_symmetric(w)


def _weight(parts: tuple[jax.Array, ...], mode: str, k: int) -> Int8Weight:
    if mode in ("int8", "int4"):
        q, scale, offset = parts
        return Int8Weight(q=q, scale=scale, offset=offset, block=GROUP, bits=4 if mode == "int4" else 8)
    q, scale, *residual = parts
    if mode == "int8-channel-w16":
        return Int8Weight(q=q, scale=scale, block=k, a8_rows=None, parts=2, residual=residual[0] if residual else None)
    if mode == "int8-channel-a16":
        return Int8Weight(q=q, scale=scale, block=k, a8_rows=None, parts=2)
    return Int8Weight(q=q, scale=scale, block=k, a8_rows=A8_MIN_ROWS, parts=1)


def _index_layer(layer: jax.Array, w: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(w, layer, keepdims=False)


def from_int8(q: jax.Array, scale: float, mode: str = "int8") -> Int8Weight:
    """The weight q * scale (q int8 [in, out], one scale for all) in `mode`, exactly: no rounding
    (a random int8 weight drawn directly, or a tied head of such an embedding)."""
    if mode not in MODES or mode == "int4":
        raise ValueError(f"an int8 weight's mode must be one of {tuple(m for m in MODES if m != 'int4')}, got {mode!r}")
    k, n = q.shape
    groups = -(-k // GROUP) if mode == "int8" else 1
    parts = (q, jnp.full((groups, n), scale, jnp.float32))
    return _weight(parts + ((jnp.zeros((groups, n), jnp.float32),) if mode == "int8" else ()), mode, k)


_LAYER_INDEX = jax.ShapeDtypeStruct((), jnp.int32)


def quantize_layers(layer_fn, args: tuple, layers: int, mode: str = "int8") -> Int8Weight:
    """A stacked Int8Weight [L, in, out] whose layer l is the rounding of layer_fn(l, *args) (a float
    [in, out], traced: e.g. one layer of a float stack, or a random draw). One program loops over
    the layers and writes each into int8 buffers allocated once, so the float temporaries are one
    layer's whatever L is (a float stack of L layers need not exist). layer_fn: a module-level
    function (it keys the compile cache)."""
    if mode not in MODES:
        raise ValueError(f"int8 weight mode must be one of {MODES}, got {mode!r}")
    if layers < 1:
        raise ValueError(f"expected at least one layer, got {layers}")
    one = jax.eval_shape(layer_fn, _LAYER_INDEX, *args)
    if len(one.shape) != 2 or not jnp.issubdtype(one.dtype, jnp.floating):
        raise ValueError(f"layer_fn must give a float weight [in, out], got {one.dtype} {tuple(one.shape)}")
    return _weight(_quantize_loop(layer_fn, layers, mode, args), mode, int(one.shape[0]))


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _quantize_loop(layer_fn, layers: int, mode: str, args: tuple) -> tuple[jax.Array, ...]:
    parts = jax.eval_shape(lambda index: _round(layer_fn(index, *args), mode), _LAYER_INDEX)
    stacks = tuple(jnp.zeros((layers, *p.shape), p.dtype) for p in parts)          # [L, ...] each

    def body(layer, stacks):
        rounded = _round(layer_fn(layer, *args), mode)
        return tuple(jax.lax.dynamic_update_index_in_dim(s, r, layer, 0) for s, r in zip(stacks, rounded))

    return jax.lax.fori_loop(0, layers, body, stacks)


def _blocks(w: jax.Array, block: int) -> jax.Array:
    """w [..., K, N] -> f32 [..., G, block, N], K zero-padded to whole blocks."""
    *lead, k, n = w.shape
    g = -(-k // block)
    w = w.astype(jnp.float32)
    if g * block != k:
        w = jnp.pad(w, [(0, 0)] * len(lead) + [(0, g * block - k), (0, 0)])
    return w.reshape(*lead, g, block, n)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize_asymmetric(w: jax.Array, block: int, bits: int = 8) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per block and output channel the better of two roundings (smaller largest error): over
    [min, max] (q = -128 at the minimum: exact for GGUF Q4_1 blocks) or symmetric over +-max|w| with
    a zero offset (exact for Q8_0 blocks). q is rounded against the stored scale and offset.
    bits=4: q in -8..7 (-7..7 symmetric), scales and offsets stored in bf16 (rounded before q is)."""
    k = w.shape[-2]
    g = _blocks(w, block)                                                   # [..., G, B, N]
    lo, hi = g.min(axis=-2), g.max(axis=-2)                                 # [..., G, N]
    amax = jnp.maximum(-lo, hi)
    levels, top = (LEVELS, INT8_MAX) if bits == 8 else (INT4_LEVELS, INT4_MAX)
    stored = jnp.float32 if bits == 8 else jnp.bfloat16

    def kept(a):  # a scale or offset as it will be stored
        return a.astype(stored).astype(jnp.float32)

    def rounded(scale, offset, q_min, q_max):
        inv = jnp.where(scale > 0, 1.0 / jnp.where(scale > 0, scale, 1.0), 0.0)
        q = jnp.clip(jnp.round((g - offset[..., None, :]) * inv[..., None, :]), q_min, q_max)
        err = jnp.max(jnp.abs(q * scale[..., None, :] + offset[..., None, :] - g), axis=-2)
        return q, err

    a_scale = kept((hi - lo) / levels)
    a_offset = kept(lo + (top + 1) * a_scale)
    q_a, err_a = rounded(a_scale, a_offset, -top - 1, top)
    s_scale = kept(amax / top)
    q_s, err_s = rounded(s_scale, jnp.zeros_like(s_scale), -top, top)
    sym = err_s <= err_a                                                    # [..., G, N]
    q = jnp.where(sym[..., None, :], q_s, q_a).astype(jnp.int8)
    scale, offset = jnp.where(sym, s_scale, a_scale), jnp.where(sym, 0.0, a_offset)
    return q.reshape(*w.shape[:-2], -1, w.shape[-1])[..., :k, :], scale.astype(stored), offset.astype(stored)


@jax.jit
def _quantize_symmetric(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    wf = w.astype(jnp.float32)
    scale = jnp.max(jnp.abs(wf), axis=-2, keepdims=True) / INT8_MAX         # [..., 1, N]
    inv = jnp.where(scale > 0, 1.0 / jnp.where(scale > 0, scale, 1.0), 0.0)
    q = jnp.clip(jnp.round(wf * inv), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale


@jax.jit
def _quantize_symmetric_residual(w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The symmetric per-channel rounding and its residual: w / scale - q (within +-0.5) in RESIDUAL steps."""
    q, scale = _quantize_symmetric(w)
    inv = jnp.where(scale > 0, 1.0 / jnp.where(scale > 0, scale, 1.0), 0.0)
    r = jnp.clip(jnp.round((w.astype(jnp.float32) * inv - q.astype(jnp.float32)) * RESIDUAL), -INT8_MAX, INT8_MAX)
    return q, scale, r.astype(jnp.int8)


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Activations x [M, K] -> (int8 [M, K], f32 scale [M]): one symmetric scale per row (token)."""
    xf = x.astype(jnp.float32)
    s = jnp.max(jnp.abs(xf), axis=-1) / INT8_MAX
    inv = jnp.where(s > 0, 1.0 / jnp.where(s > 0, s, 1.0), 0.0)
    return jnp.clip(jnp.round(xf * inv[:, None]), -INT8_MAX, INT8_MAX).astype(jnp.int8), s


def matmul(x: jax.Array, w: Int8Weight, layer: jax.Array | None = None) -> jax.Array:
    """x [..., in] @ w [in, out] -> f32 [..., out]. Per output channel: the dot of x (or of its int8
    rows, from w.a8_rows rows on: the step's row count is static) with q, then the scale; on CPU the native
    kernel's rows of w.parts int8 parts at every row count. Per block: q
    dequantized to x's dtype inside the dot (one float rounding of each weight, as a float model has).
    layer: w is a stack [L, in, out] and this traced index picks the layer to multiply by. Where the
    TPU kernel runs, it reads that layer's blocks of the stack where they lie (no copy of the layer's
    int8 values or scales); every other path slices the layer out first."""
    if (layer is None) != (w.q.ndim == 2) or w.q.ndim not in (2, 3):
        raise ValueError(f"int8.matmul takes a weight [in, out], or a stack [L, in, out] and a layer index; got "
                         f"shape {tuple(w.q.shape)} {'without' if layer is None else 'with'} a layer index")
    k, n = w.in_features, w.q.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)                                                   # [M, K]
    grouped = not (w.offset is None and w.scale.shape[-2] == 1)
    if grouped and _tpu_kernel_applies(x2, w):
        index = jnp.asarray(0 if layer is None else layer, jnp.int32)
        y = jax.lax.platform_dependent(x2, index, w.q, w.scale, *(() if w.offset is None else (w.offset,)),
                                       tpu=functools.partial(_tpu_matmul, bits=w.bits),
                                       default=functools.partial(_xla_matmul, bits=w.bits))
        return y.reshape(*lead, n)
    if layer is not None:
        w = jax.tree.map(functools.partial(_index_layer, layer), w)
    operands = (x2, w.q, w.scale) + (() if w.residual is None else (w.residual,))
    if not grouped and _cpu_channel_native():
        y = jax.lax.platform_dependent(*operands, cpu=functools.partial(_cpu_channel, parts=w.parts),
                                       default=functools.partial(_per_channel, a8_rows=w.a8_rows))
    elif not grouped:
        y = _per_channel(*operands, a8_rows=w.a8_rows)
    else:
        y = jnp.einsum("mk,kn->mn", x2, w.dequantize(x2.dtype), preferred_element_type=jnp.float32)
    return y.reshape(*lead, n)


def _per_channel(x2: jax.Array, q: jax.Array, scale: jax.Array, residual: jax.Array | None = None, *,
                 a8_rows: int | None) -> jax.Array:
    """x2 [M, K] @ a per-channel weight in XLA: int8 rows times q in int32 from a8_rows rows on, else float (with
    a residual: float activations times q + residual / RESIDUAL)."""
    if residual is not None:
        q = q.astype(jnp.float32) + residual.astype(jnp.float32) / RESIDUAL
    elif a8_rows is not None and x2.shape[0] >= a8_rows:
        xq, xs = quantize_rows(x2)
        acc = jax.lax.dot_general(xq, q, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
        return acc.astype(jnp.float32) * xs[:, None] * scale[0]
    return jnp.einsum("mk,kn->mn", x2, q.astype(x2.dtype), preferred_element_type=jnp.float32) * scale[0]


def _cpu_channel_native() -> bool:
    return icm.native_available()


def _cpu_channel(x2: jax.Array, q: jax.Array, scale: jax.Array, residual: jax.Array | None = None, *,
                 parts: int) -> jax.Array:
    """The native CPU kernel on a weight packed here, per call (the engine packs its weights once, at load:
    quantization/layer_forms.py's StackedChannel / PackedChannel); a residual (scale / RESIDUAL) in the same call."""
    packed, scales, colsum = icm.pack_jax(q, scale[0])
    lo = None if residual is None else icm.pack_jax(residual, residual_scale(scale)[0])
    return icm.int8_channel_matmul(x2.astype(jnp.float32), packed, scales, colsum, n=q.shape[1], parts=parts,
                                   residual=lo)


def residual_scale(scale: jax.Array) -> jax.Array:
    """The residual weight's per-channel scale (f32, the same rounding wherever it is formed)."""
    return (jnp.asarray(scale, jnp.float32) / jnp.float32(RESIDUAL)).astype(jnp.float32)


def _xla_matmul(x2: jax.Array, layer: jax.Array, q: jax.Array, scale: jax.Array,
                offset: jax.Array | None = None, *, bits: int = 8) -> jax.Array:
    """The product by a weight of GROUP-input groups in XLA (of layer `layer` of a stack [L, K, N]: sliced
    out): the weight dequantized to x's dtype, then one dot (XLA writes the dequantized weight to memory
    first)."""
    if q.ndim == 3:
        q, scale, offset = (None if a is None else _index_layer(layer, a) for a in (q, scale, offset))
    w = Int8Weight(q=q, scale=scale, offset=offset, block=GROUP, bits=bits)
    return jnp.einsum("mk,kn->mn", x2, w.dequantize(x2.dtype), preferred_element_type=jnp.float32)


def _tpu_matmul(x2: jax.Array, layer: jax.Array, q: jax.Array, scale: jax.Array, offset: jax.Array | None = None,
                *, bits: int = 8, interpret: bool = False) -> jax.Array:
    """The same product by kernels/tpu/int8_matmul.py's Pallas kernel; a stack [L, K, N] is read in place
    at `layer`. interpret: Pallas' TPU interpreter (tests run this branch on CPU)."""
    from slipstream.kernels.tpu.int8_matmul import int8_matmul

    return int8_matmul(x2, q, scale, offset, layer if q.ndim == 3 else None, bits=bits, interpret=interpret)


def _tpu_kernel_applies(x2: jax.Array, w: Int8Weight) -> bool:
    """Whether a group-wise product runs kernels/tpu/int8_matmul.py's Pallas kernel on TPU (dequantized
    block by block in VMEM): its shapes tile (kernel blocks) and SLIPSTREAM_KERNELS is not `reference`.
    Elsewhere, and for shapes that do not tile, XLA's dequantize-then-dot."""
    from slipstream.kernels.tpu.int8_matmul import blocks

    if x2.dtype not in (jnp.bfloat16, jnp.float32) or w.block != GROUP:
        return False
    if blocks(x2.shape[0], w.in_features, w.q.shape[-1], group=w.block, x_bytes=x2.dtype.itemsize,
              offset=w.offset is not None, bits=w.bits, scale_bytes=w.scale.dtype.itemsize) is None:
        return False
    if jax.default_backend() == "tpu":  # records (and logs) the path, for the start-up log and /metrics
        return native.use_pallas("int8_matmul")
    return not native.reference_forced()  # lax.platform_dependent: XLA's dot unless lowered for TPU

