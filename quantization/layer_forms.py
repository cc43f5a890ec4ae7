"""Per-backend forms of stacked linear weights [L, in, out] that the scanned layer body multiplies by
(which form a weight takes, and why XLA:CPU and the TPU need them: engine/layer_stack.py). Each form is
picked per layer by quantization.ops.pick and multiplied through quantization.ops.linears: per-layer
buffers behind a layer switch (PerLayer), or one stack a kernel reads at the layer index (StackedQ8,
StackedF32, StackedChannel: native CPU kernels, fused groups' other members are FusedMember markers;
StackedInt8: the TPU's Pallas int8 kernel; StackedHybrid: a StackedQ8 and a StackedChannel of the same weights, a
step's rows split between them), or, for a weight outside the layer stack (the LM head), packed once for its CPU
kernel (PackedChannel)."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from slipstream.kernels import f32_matmul as f32
from slipstream.kernels import int8_channel_matmul as icm
from slipstream.kernels.q8_matmul import (TILE, amx_tiles_wanted, gated_input, gated_native, pack_tiles, q8_matmul,
                                          widen)
from slipstream.quantization import int8, lora, ops
from slipstream.quantization.groupwise import host_copy, host_empty
from slipstream.quantization.weights import QuantizedWeight


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PerLayer:
    """One weight as L separate buffers (arrays, QuantizedWeights or Int8Weights)."""

    layers: tuple

    def pick(self, index: jax.Array) -> "LayerPick":
        return LayerPick(index, self.layers)


@jax.jit
def _linears(ws: tuple, x: jax.Array) -> tuple[jax.Array, ...]:
    # jitted so that the switch branches (one per layer) share one trace: lowering time
    return tuple(ops.linear(x, w) for w in ws)


@dataclasses.dataclass(frozen=True)
class LayerPick:
    """Layer `index`'s buffer of a PerLayer weight, inside the scanned layer body."""

    index: jax.Array
    layers: tuple

    def linears(self, x: jax.Array, picks: tuple["LayerPick", ...]) -> tuple[jax.Array, ...]:
        # one row as a vector: XLA:CPU wraps a [1,D] matvec inside a branch in relayout copies
        flat = x.reshape(-1, x.shape[-1])
        flat = flat[0] if flat.shape[0] == 1 else flat
        branches = [functools.partial(_linears, tuple(p.layers[j] for p in picks)) for j in range(len(self.layers))]
        outs = jax.lax.switch(self.index, branches, flat)
        return tuple(o.reshape(*x.shape[:-1], o.shape[-1]) for o in outs)


def tile_offsets(widths: tuple[int, ...], tile: int) -> tuple[int, ...]:
    """Where each member of a fused group starts: its columns padded to whole tiles of `tile` columns."""
    return tuple(int(s) for s in np.cumsum([0] + [-(-w // tile) * tile for w in widths[:-1]]))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackedQ8:
    """The group-wise int8 weights of every layer as one stack (a QuantizedWeight [L, K, N]) for one
    linear or a fused group: member j's output columns start at offsets[j] (whole 16-column tiles)
    and number widths[j]. tiles: the stack's kernels.q8_matmul.pack_tiles [L, Np/16, Kp*32] where the kernel
    runs two-part calls on the AMX bf16 tile path (SLIPSTREAM_AMX_BF16=1; fuse_q8 makes them), else None."""

    weight: QuantizedWeight
    widths: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    tiles: jax.Array | None = None

    @property
    def offsets(self) -> tuple[int, ...]:
        return tile_offsets(self.widths, TILE)

    def pick(self, index: jax.Array) -> "StackedPick":
        return StackedPick(index, self)

    def matmul(self, x: jax.Array, layer: jax.Array) -> jax.Array:
        """x f32 [M, K] @ layer `layer`'s weight -> f32 [M, total columns]."""
        w = self.weight
        return q8_matmul(x, w.q, w.scale, w.offset, n=w.logical[1], parts=1 if w.mode == "q8_0" else 2, layer=layer,
                         tiles=self.tiles)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackedF32:
    """The f32 weights of every layer, packed for kernels/f32_matmul.py as one stack [L, Np/32, K*32],
    for one linear or a fused group: member j's output columns start at offsets[j] (whole 32-column
    panels) and number widths[j]."""

    packed: jax.Array
    widths: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(int(s) for s in np.cumsum([0] + [f32.padded(w) for w in self.widths[:-1]]))

    def pick(self, index: jax.Array) -> "StackedPick":
        return StackedPick(index, self)

    def matmul(self, x: jax.Array, layer: jax.Array) -> jax.Array:
        """x [M, K] @ layer `layer`'s weight -> f32 [M, total columns]."""
        return f32.f32_matmul(x, self.packed, n=self.offsets[-1] + self.widths[-1], layer=layer)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackedChannel:
    """The per-output-channel int8 weights (int8-channel modes) of every layer, packed for
    kernels/int8_channel_matmul.py as one stack (packed [L, Np/16, Kp*16], scales and colsum [L, Np]) for one
    linear or a fused group: member j's output columns start at offsets[j] (whole 16-column tiles) and number
    widths[j]. parts: the activations' int8 parts (1 or 2). residual: int8-channel-w16's residual weights packed
    alike (packed, scales, colsum), multiplied by the first activation part in the same kernel call; None in the
    other modes."""

    packed: jax.Array
    scales: jax.Array
    colsum: jax.Array
    widths: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    parts: int = dataclasses.field(default=1, metadata=dict(static=True))
    residual: tuple[jax.Array, jax.Array, jax.Array] | None = None

    @property
    def offsets(self) -> tuple[int, ...]:
        return tile_offsets(self.widths, icm.TILE)

    def pick(self, index: jax.Array) -> "StackedPick":
        return StackedPick(index, self)

    def matmul(self, x: jax.Array, layer: jax.Array) -> jax.Array:
        """x [M, K] @ layer `layer`'s weight -> f32 [M, total columns]."""
        n = self.offsets[-1] + self.widths[-1]
        return icm.int8_channel_matmul(x, self.packed, self.scales, self.colsum, n=n, parts=self.parts, layer=layer,
                                       residual=self.residual)


PROMPT_END = np.iinfo(np.int32).max  # a row range's end past any step's rows (the kernels clamp it to M)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackedHybrid:
    """One linear or fused group in two forms (the hybrid default on CPU, engine/layer_stack.py): the group-wise
    q8_0-a16 stack (`default`, the GGUF's groups: a generated token's rows, and every row when no split is bound)
    and the same weights rounded per output channel with their residual (`prompt`: int8-channel-w16, from the
    group-wise values) for a step's prompt rows. default_rows / prompt_rows: None (every row on `default`), or the
    step's split as bound by bind_rows, i32[2] each: rows [0, split) on `default`, [split, M) on `prompt` (the
    prompt rows: the step's last ones). Each kernel call multiplies only its own rows (the kernels' `rows`), the
    second into the first's output, so a row's output is its form's at any split and row count."""

    default: StackedQ8
    prompt: StackedChannel
    default_rows: jax.Array | None = None   # i32[2]
    prompt_rows: jax.Array | None = None    # i32[2]

    def __post_init__(self) -> None:
        if isinstance(self.default, StackedQ8) and isinstance(self.prompt, StackedChannel) and (
                self.default.widths != self.prompt.widths or self.default.offsets != self.prompt.offsets):
            raise ValueError(f"a hybrid stack's two forms hold other columns ({self.default.widths} at "
                             f"{self.default.offsets} against {self.prompt.widths} at {self.prompt.offsets})")

    @property
    def widths(self) -> tuple[int, ...]:
        return self.default.widths

    @property
    def offsets(self) -> tuple[int, ...]:
        return self.default.offsets

    def pick(self, index: jax.Array) -> "StackedPick":
        return StackedPick(index, self)

    def bound(self, split: jax.Array) -> "StackedHybrid":
        """This stack with rows [0, split) on `default` and [split, M) on `prompt` (split an int32 scalar)."""
        split = jnp.asarray(split, jnp.int32).reshape(())
        zero, end = jnp.zeros((), jnp.int32), jnp.full((), PROMPT_END, jnp.int32)
        return dataclasses.replace(self, default_rows=jnp.stack([zero, split]), prompt_rows=jnp.stack([split, end]))

    def matmul(self, x: jax.Array, layer: jax.Array) -> jax.Array:
        """x [M, K] @ layer `layer`'s weight -> f32 [M, total columns]: each row on its form."""
        if self.default_rows is None:
            return self.default.matmul(x, layer)
        w, p = self.default.weight, self.prompt
        y = q8_matmul(x, w.q, w.scale, w.offset, n=w.logical[1], parts=2, layer=layer, tiles=self.default.tiles,
                      rows=self.default_rows)
        return icm.int8_channel_matmul(x, p.packed, p.scales, p.colsum, n=w.logical[1], parts=2, layer=layer,
                                       residual=p.residual, rows=self.prompt_rows, into=y)

    def gated_down(self, gate_up: jax.Array, layer: jax.Array) -> jax.Array:
        """down(silu(gate) * up) of a gated MLP's gate | up [M, 2F] by this (down) stack -> f32 [M, out]: the
        q8 kernel forms the input row by row as it quantizes; the prompt rows' per-channel call takes it formed
        in XLA."""
        w = self.default.weight
        y = q8_matmul(gate_up, w.q, w.scale, w.offset, n=w.logical[1], parts=2, layer=layer, gated=True,
                      tiles=self.default.tiles, rows=self.default_rows)
        if self.default_rows is None:
            return y
        p = self.prompt
        return icm.int8_channel_matmul(gated_input(gate_up), p.packed, p.scales, p.colsum, n=w.logical[1], parts=2,
                                       layer=layer, residual=p.residual, rows=self.prompt_rows, into=y)


def bind_rows(tree, split: jax.Array):
    """`tree` (a model's params) with every StackedHybrid bound to a step's split (StackedHybrid.bound): rows
    [0, split) take the default form, the rest the prompt form. Other leaves unchanged."""
    hybrid = lambda leaf: isinstance(leaf, StackedHybrid)  # noqa: E731
    return jax.tree.map(lambda leaf: leaf.bound(split) if hybrid(leaf) else leaf, tree, is_leaf=hybrid)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedChannel:
    """One per-output-channel int8 weight outside the layer stack (the LM head), packed once for
    kernels/int8_channel_matmul.py; multiplied through quantization.ops.linears as a group of one."""

    packed: jax.Array
    scales: jax.Array
    colsum: jax.Array
    n: int = dataclasses.field(metadata=dict(static=True))
    parts: int = dataclasses.field(default=1, metadata=dict(static=True))
    residual: tuple[jax.Array, jax.Array, jax.Array] | None = None   # as StackedChannel's

    def linears(self, x: jax.Array, picks: tuple) -> tuple[jax.Array, ...]:
        if len(picks) != 1 or picks[0] is not self:
            raise ValueError(f"a packed int8-channel weight is multiplied alone (got a group of {len(picks)})")
        x2 = x.reshape(-1, x.shape[-1])
        y = icm.int8_channel_matmul(x2, self.packed, self.scales, self.colsum, n=self.n, parts=self.parts,
                                    residual=self.residual)
        return (y.reshape(*x.shape[:-1], self.n).astype(x.dtype),)


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackedInt8:
    """A quantization/int8 weight of every layer as one stack (an Int8Weight [L, K, N]), multiplied at
    the traced layer index by int8.matmul: on TPU its Pallas kernel reads that layer's blocks of the
    stack where they lie, so no layer's int8 values or scales are copied out of the stack per step (the
    scan's slice was). The same arrays as the Int8Weight: wrapping copies nothing."""

    weight: int8.Int8Weight

    def pick(self, index: jax.Array) -> "Int8Pick":
        return Int8Pick(index, self.weight)


@dataclasses.dataclass(frozen=True)
class Int8Pick:
    """Layer `index` of a StackedInt8, inside the scanned layer body."""

    index: jax.Array
    weight: int8.Int8Weight

    def linears(self, x: jax.Array, picks: tuple) -> tuple[jax.Array, ...]:
        # each member its own call (the group's other members may take any form)
        return tuple(int8.matmul(x, p.weight, layer=p.index).astype(x.dtype) if isinstance(p, Int8Pick)
                     else ops.linear(x, p) for p in picks)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FusedMember:
    """A linear whose weight lives in its group's StackedQ8, StackedF32 or StackedChannel, as member `index` (no
    arrays)."""

    index: int = dataclasses.field(metadata=dict(static=True))

    def pick(self, index: jax.Array) -> "FusedMember":
        return self


@dataclasses.dataclass(frozen=True)
class StackedPick:
    """Layer `index` of a StackedQ8, StackedF32, StackedChannel or StackedHybrid, inside the scanned layer body."""

    index: jax.Array
    stack: StackedQ8 | StackedF32 | StackedChannel | StackedHybrid

    def _check_group(self, picks: tuple) -> None:
        widths = self.stack.widths
        if (len(picks) != len(widths) or picks[0] is not self
                or any(not isinstance(p, FusedMember) or p.index != j for j, p in enumerate(picks[1:], 1))):
            raise ValueError(f"weights fused as a group of {len(widths)} linears are multiplied as that "
                             f"group, in order (got {len(picks)} weights); see engine/layer_stack.FUSED")

    def fused_linears(self, x: jax.Array, picks: tuple) -> tuple[jax.Array, tuple[tuple[int, int], ...]]:
        """The group's product whole, f32 [M, W], and each member's columns in it (first, width)."""
        self._check_group(picks)
        y = self.stack.matmul(x.reshape(-1, x.shape[-1]), self.index)
        return y, tuple(zip(self.stack.offsets, self.stack.widths))

    def linears(self, x: jax.Array, picks: tuple) -> tuple[jax.Array, ...]:
        y, spans = self.fused_linears(x, picks)
        return tuple(y[:, o:o + n].reshape(*x.shape[:-1], n).astype(x.dtype) for o, n in spans)

    def gated_down(self, x: jax.Array, picks: tuple, down, loras: tuple = (None, None, None)) -> jax.Array | None:
        """down(silu(gate(x)) * up(x)) for this int8 gate/up group and an int8 down weight: the
        gate/up output [M, 2F] goes to the down projection's kernel whole, which forms silu(gate) * up
        per row as it quantizes (kernels.q8_matmul, gated). None where that does not apply (f32
        stacks, members of other widths, no AVX-512 kernel): the caller then multiplies unfused.
        loras: gate's, up's and down's LoraWeight or None: gate's and up's deltas go into the gate/up
        output before the activation, down's (its input gate | up, gated) onto the product."""
        stack = self.stack
        kinds = (StackedQ8, StackedHybrid)
        if not (isinstance(stack, kinds) and isinstance(down, StackedPick) and type(down.stack) is type(stack)
                and len(stack.widths) == 2 and stack.widths[0] == stack.widths[1] == stack.offsets[1]
                and _q8(down.stack).weight.logical[0] == stack.widths[0] and gated_native()):
            return None
        self._check_group(picks)
        x2 = x.reshape(-1, x.shape[-1])
        gate_up = self.stack.matmul(x2, self.index)                                   # [M, 2F]
        gate_up = lora.add_fused(x2, gate_up, tuple(zip(stack.offsets, stack.widths)), loras[:2])
        w = _q8(down.stack).weight
        if isinstance(down.stack, StackedHybrid):
            y = down.stack.gated_down(gate_up, down.index)
        else:
            y = q8_matmul(gate_up, w.q, w.scale, w.offset, n=w.logical[1], parts=1 if w.mode == "q8_0" else 2,
                          layer=down.index, gated=True, tiles=down.stack.tiles)        # [M, out]
        if loras[2] is not None:
            y = loras[2].add_to(y, gate_up, gated=True)
        return y.reshape(*x.shape[:-1], w.logical[1]).astype(x.dtype)


def _q8(stack: StackedQ8 | StackedHybrid) -> StackedQ8:
    return stack.default if isinstance(stack, StackedHybrid) else stack


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
