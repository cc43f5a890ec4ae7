"""Per-backend forms of stacked linear weights [L, in, out] that the scanned layer body multiplies by
(which form a weight takes, and why XLA:CPU and the TPU need them: engine/layer_stack.py). Each form is
picked per layer by quantization.ops.pick and multiplied through quantization.ops.linears: per-layer
buffers behind a layer switch (PerLayer), or one stack a kernel reads at the layer index (StackedQ8,
StackedF32, StackedChannel: native CPU kernels, fused groups' other members are FusedMember markers;
StackedInt8: the TPU's Pallas int8 kernel; StackedHybrid: a StackedQ8 and a StackedChannel of the same weights, a
step's rows split between them), or, for a weight outside the layer stack (the LM head), packed once for its CPU
kernel (PackedChannel). The native-CPU forms are built at load by quantization/layer_packing.py."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from slipstream.kernels import f32_matmul as f32
from slipstream.kernels import int8_channel_matmul as icm
from slipstream.kernels.q8_matmul import TILE, gated_input, gated_native, q8_matmul
from slipstream.quantization import int8, lora, ops
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
