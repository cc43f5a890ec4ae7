"""Builds quantization/layer_forms' native-CPU stacks from loaded weights, once at load: each weight packed
layer by layer (numpy) for its kernel into memory laid out for huge pages, then handed to XLA. Nothing here
runs inside a step; engine/layer_stack.py decides which weight takes which form."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from slipstream.kernels import f32_matmul as f32
from slipstream.kernels import int8_channel_matmul as icm
from slipstream.kernels.q8_matmul import TILE, amx_tiles_wanted, pack_tiles, widen
from slipstream.quantization import int8
from slipstream.quantization.experts import ExpertStack, FusedExperts, PackedExperts, pack_numpy
from slipstream.quantization.groupwise import host_copy, host_empty
from slipstream.quantization.layer_forms import PackedChannel, StackedChannel, StackedF32, StackedHybrid, StackedQ8
from slipstream.quantization.weights import QuantizedWeight


def channel_weight(w: int8.Int8Weight) -> bool:
    """True for a per-output-channel Int8Weight that the native CPU kernel can multiply (packed at load)."""
    return (isinstance(w, int8.Int8Weight) and w.offset is None and w.scale.shape[-2] == 1
            and icm.native_available())


def pack_channel(w: int8.Int8Weight) -> PackedChannel:
    """A 2-D per-channel Int8Weight [K, N] -> its PackedChannel (numpy, once)."""
    def packed_parts(q, scale):
        packed, scales, colsum = icm.pack(np.asarray(q), np.asarray(scale)[0])
        # huge pages: a decode step streams the LM head
        return jax.device_put(host_copy(packed)), jax.device_put(scales), jax.device_put(colsum)

    residual = None if w.residual is None else packed_parts(w.residual, int8.residual_scale(w.scale))
    return PackedChannel(*packed_parts(w.q, w.scale), int(w.q.shape[1]), w.parts, residual)


def fuse_channel(weights: list[int8.Int8Weight]) -> StackedChannel:
    """Stacked per-channel Int8Weights [L, K, N_j] sharing L, K and parts -> one StackedChannel over their columns,
    packed layer by layer (numpy) into memory laid out for huge pages (the decode step streams it)."""
    residual = None
    if weights[0].residual is not None:
        lo = fuse_channel([dataclasses.replace(w, q=w.residual, scale=int8.residual_scale(w.scale), residual=None)
                           for w in weights])
        residual = (lo.packed, lo.scales, lo.colsum)
    qs = [np.asarray(w.q) for w in weights]
    scales = [np.asarray(w.scale) for w in weights]
    layers, k = qs[0].shape[:2]
    widths = tuple(int(q.shape[2]) for q in qs)
    tiles = [icm.padded(k, n)[1] // icm.TILE for n in widths]
    starts = np.cumsum([0] + tiles)
    kp = icm.padded(k, 1)[0]
    packed = host_empty((layers, int(starts[-1]), kp * icm.TILE), np.int8)
    sc = np.zeros((layers, int(starts[-1]) * icm.TILE), np.float32)
    cs = np.zeros((layers, int(starts[-1]) * icm.TILE), np.int32)
    for j in range(len(weights)):
        cols = slice(int(starts[j]) * icm.TILE, int(starts[j + 1]) * icm.TILE)
        for i in range(layers):
            packed[i, starts[j]:starts[j + 1]], sc[i, cols], cs[i, cols] = icm.pack(qs[j][i], scales[j][i, 0])
    return StackedChannel(jax.device_put(packed), jax.device_put(sc), jax.device_put(cs), widths, weights[0].parts,
                          residual)


def pack_experts(gate: ExpertStack, up: ExpertStack, down: ExpertStack, *,
                 shards: int = 1) -> tuple[PackedExperts, FusedExperts, PackedExperts]:
    """A sparse MoE layer's int8 expert stacks -> their forms for the per-channel kernel: gate and up fused into one
    PackedExperts over their columns (one kernel call for both; up holds a FusedExperts marker), down alone.
    shards > 1 (tensor parallelism): each device's slice of the experts' hidden dimension packed apart, gate's and
    up's columns of a slice fused together, down's rows of it."""
    return (pack_numpy(gate, up, shards=shards, split="out"), FusedExperts(1),
            pack_numpy(down, shards=shards, split="in"))


def stack_tiles(w: QuantizedWeight) -> jax.Array | None:
    """A stacked q8_0-a16 weight's bf16 tiles (kernels.q8_matmul.pack_tiles per layer) where the kernel runs on the
    AMX tile unit and SLIPSTREAM_AMX_BF16=1 asks for its bf16 path, else None: 4 bytes per weight (the default
    model's layers: 425 MB) buy its many-row calls (prefill) the bf16 tile unit."""
    if w.mode == "q8_0" or not amx_tiles_wanted():
        return None
    q, scale = np.asarray(w.q), np.asarray(w.scale)
    offset = None if w.offset is None else np.asarray(w.offset)
    first = pack_tiles(q[0], scale[0], None if offset is None else offset[0])
    out = host_empty((q.shape[0], *first.shape), np.uint16)
    out[0] = first
    for i in range(1, q.shape[0]):
        out[i] = pack_tiles(q[i], scale[i], None if offset is None else offset[i])
    return jax.device_put(out)  # hands numpy's buffer to XLA


def fuse_q8(weights: list[QuantizedWeight]) -> StackedQ8:
    """Stacked int8 weights [L, K, N_j] sharing K and mode -> one StackedQ8 over their columns (with its AMX
    tiles where stack_tiles makes them)."""
    widths = tuple(w.logical[1] for w in weights)
    if len(weights) == 1:
        return StackedQ8(weights[0], widths, stack_tiles(weights[0]))
    def cat(arrays):  # along the tile axis, in numpy (jnp would compile a program per shape)
        arrays = [np.asarray(a) for a in arrays]
        if len({a.shape[-1] for a in arrays}) > 1:  # 4- and 8-bit members: all at 8 bits
            widest = max(a.shape[-1] for a in arrays)
            arrays = [a if a.shape[-1] == widest else widen(a) for a in arrays]
        shape = (*arrays[0].shape[:-2], sum(a.shape[-2] for a in arrays), arrays[0].shape[-1])
        out = host_empty(shape, arrays[0].dtype)  # huge pages: the decode step streams it
        np.concatenate(arrays, axis=-2, out=out)
        return jax.device_put(out)  # hands numpy's buffer to XLA

    offset = None
    if any(w.offset is not None for w in weights):
        offset = cat([np.zeros(w.scale.shape, np.float16) if w.offset is None else w.offset for w in weights])
    fused = QuantizedWeight(q=cat([w.q for w in weights]), scale=cat([w.scale for w in weights]),
                            mode=weights[0].mode, offset=offset,
                            logical=(weights[0].logical[0], sum(-(-n // TILE) * TILE for n in widths[:-1]) + widths[-1]))
    return StackedQ8(fused, widths, stack_tiles(fused))


def _dequantized_layer(layer: jax.Array, w: QuantizedWeight) -> jax.Array:
    one = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False), w)
    return one.dequantize()


def channel_w16(w: QuantizedWeight) -> int8.Int8Weight:
    """A stacked group-wise weight [L, K, N] rounded per output channel with its residual (int8-channel-w16), from
    its group-wise values, one layer at a time (the float temporaries are one layer's)."""
    return int8.quantize_layers(_dequantized_layer, (w,), int(w.q.shape[0]), "int8-channel-w16")


def fuse_hybrid(weights: list[QuantizedWeight]) -> StackedHybrid:
    """Stacked q8_0-a16 weights [L, K, N_j] sharing K -> one StackedHybrid over their columns: fuse_q8's stack and
    fuse_channel's of their int8-channel-w16 roundings."""
    if any(w.mode != "q8_0-a16" for w in weights):
        raise ValueError(f"a hybrid stack's default form is q8_0-a16, got {[w.mode for w in weights]}")
    return StackedHybrid(fuse_q8(weights), fuse_channel([channel_w16(w) for w in weights]))


def fuse_f32(weights: list) -> StackedF32:
    """Stacked f32 weights [L, K, N_j] sharing L and K -> one StackedF32 over their columns, packed
    layer by layer into memory laid out for huge pages (the decode step streams it)."""
    first = weights[0]
    layers, k = first.shape[0], first.shape[1]
    widths = tuple(int(w.shape[2]) for w in weights)
    starts = np.cumsum([0] + [f32.padded(n) // f32.PANEL for n in widths])
    out = host_empty((layers, int(starts[-1]), k * f32.PANEL), np.float32)
    for j, w in enumerate(weights):
        w = np.asarray(w)
        for i in range(layers):
            f32.pack(w[i], out=out[i, starts[j]:starts[j + 1]])
    return StackedF32(jax.device_put(out), widths)  # hands numpy's buffer to XLA
