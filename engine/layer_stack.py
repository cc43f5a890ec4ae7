"""XLA:CPU's forms of stacked linear weights: what the engine's scanned layer body multiplies by.

A scan over stacked weights [L, ...] makes XLA:CPU copy each layer's slice out of the stack before
its dot (it cannot matmul a dynamic slice), ~2x the weight reads at batch 1. So on CPU:
- group-wise int8 weights (`StackedQ8`) and f32 ones (`StackedF32`, packed in column panels) stay
  one stack [L, ...] that a native kernel reads at the traced layer index, where it lies: no slice,
  no switch. The linears one input feeds (q/k/v, gate/up: `FUSED`) are fused along their output
  columns at load, so each group is one kernel call (one fixed per-call cost instead of three or
  two); the other members hold a `FusedMember` marker;
- other float weights (bf16; f32 without the native kernel) and int8 ones under tensor parallelism
  (engine/sharding.py) are kept as L separate buffers (`PerLayer`), and the layer body picks layer
  i's buffer with lax.switch (`LayerPick`); a group of weights read by one input shares one switch.
models/layers.py calls `pick` and `linears` without knowing why.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from flax import nnx

from kernels import f32_matmul as f32
from kernels.q8_matmul import TILE, gated_native, q8_matmul, widen
from models import layers
from models.base import CausalLM
from quantization import QuantizedWeight
from quantization.groupwise import host_empty

# The linears of one module that models/layers.py multiplies by one input (layers.project), in its order.
FUSED: tuple[tuple[type, tuple[str, ...]], ...] = (
    (layers.Attention, ("wq", "wk", "wv")),
    (layers.GatedMLP, ("w_gate", "w_up")),
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PerLayer:
    """One weight as L separate buffers (arrays or int8 QuantizedWeights)."""

    layers: tuple

    def pick(self, index: jax.Array) -> "LayerPick":
        return LayerPick(index, self.layers)


@jax.jit
def _linears(ws: tuple, x: jax.Array) -> tuple[jax.Array, ...]:
    # jitted so that the switch branches (one per layer) share one trace: lowering time
    return tuple(layers.linear(x, w) for w in ws)


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackedQ8:
    """The group-wise int8 weights of every layer as one stack (a QuantizedWeight [L, K, N]) for one
    linear or a fused group: member j's output columns start at offsets[j] (whole 16-column tiles)
    and number widths[j]."""

    weight: QuantizedWeight
    widths: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

    @property
    def offsets(self) -> tuple[int, ...]:
        starts = np.cumsum([0] + [-(-w // TILE) * TILE for w in self.widths[:-1]])
        return tuple(int(s) for s in starts)

    def pick(self, index: jax.Array) -> "StackedPick":
        return StackedPick(index, self)

    def matmul(self, x: jax.Array, layer: jax.Array) -> jax.Array:
        """x f32 [M, K] @ layer `layer`'s weight -> f32 [M, total columns]."""
        w = self.weight
        return q8_matmul(x, w.q, w.scale, w.offset, n=w.logical[1], parts=1 if w.mode == "q8_0" else 2, layer=layer)


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
class FusedMember:
    """A linear whose weight lives in its group's StackedQ8 or StackedF32, as member `index` (no arrays)."""

    index: int = dataclasses.field(metadata=dict(static=True))

    def pick(self, index: jax.Array) -> "FusedMember":
        return self


@dataclasses.dataclass(frozen=True)
class StackedPick:
    """Layer `index` of a StackedQ8 or StackedF32, inside the scanned layer body."""

    index: jax.Array
    stack: StackedQ8 | StackedF32

    def _check_group(self, picks: tuple) -> None:
        widths = self.stack.widths
        if (len(picks) != len(widths) or picks[0] is not self
                or any(not isinstance(p, FusedMember) or p.index != j for j, p in enumerate(picks[1:], 1))):
            raise ValueError(f"weights fused as a group of {len(widths)} linears are multiplied as that "
                             f"group, in order (got {len(picks)} weights); see engine/layer_stack.FUSED")

    def linears(self, x: jax.Array, picks: tuple) -> tuple[jax.Array, ...]:
        self._check_group(picks)
        y = self.stack.matmul(x.reshape(-1, x.shape[-1]), self.index)
        return tuple(y[:, o:o + n].reshape(*x.shape[:-1], n).astype(x.dtype)
                     for o, n in zip(self.stack.offsets, self.stack.widths))

    def gated_down(self, x: jax.Array, picks: tuple, down) -> jax.Array | None:
        """down(silu(gate(x)) * up(x)) for this int8 gate/up group and an int8 down weight: the
        gate/up output [M, 2F] goes to the down projection's kernel whole, which forms silu(gate) * up
        per row as it quantizes (kernels.q8_matmul, gated). None where that does not apply (f32
        stacks, members of other widths, no AVX-512 kernel): the caller then multiplies unfused."""
        stack = self.stack
        if not (isinstance(stack, StackedQ8) and isinstance(down, StackedPick) and isinstance(down.stack, StackedQ8)
                and len(stack.widths) == 2 and stack.widths[0] == stack.widths[1] == stack.offsets[1]
                and down.stack.weight.logical[0] == stack.widths[0] and gated_native()):
            return None
        self._check_group(picks)
        gate_up = self.stack.matmul(x.reshape(-1, x.shape[-1]), self.index)          # [M, 2F]
        w = down.stack.weight
        y = q8_matmul(gate_up, w.q, w.scale, w.offset, n=w.logical[1], parts=1 if w.mode == "q8_0" else 2,
                      layer=down.index, gated=True)
        return y.reshape(*x.shape[:-1], w.logical[1]).astype(x.dtype)


def _fuse(weights: list[QuantizedWeight]) -> StackedQ8:
    """Stacked int8 weights [L, K, N_j] sharing K and mode -> one StackedQ8 over their columns."""
    widths = tuple(w.logical[1] for w in weights)
    if len(weights) == 1:
        return StackedQ8(weights[0], widths)
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
    return StackedQ8(fused, widths)


def _fuse_f32(weights: list) -> StackedF32:
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


def _stackable_f32(value) -> bool:
    return isinstance(value, jax.Array) and value.dtype == np.float32 and value.ndim == 3


def split_linears(model: CausalLM, *, stack_int8: bool = True, stack_f32: bool | None = None) -> None:
    """Put every per-layer linear weight of `model` in its XLA:CPU form (in place): int8 ones as
    StackedQ8 when `stack_int8`, f32 ones as StackedF32 when `stack_f32` (by default: as
    `stack_int8`, and only where kernels/f32_matmul's native kernel runs), FUSED groups fused;
    everything else as PerLayer."""
    if stack_f32 is None:
        stack_f32 = stack_int8
    stack_f32 = stack_f32 and f32.native_available()
    state = nnx.state(model, nnx.Param)
    flat = dict(nnx.to_flat_state(state))
    n = model.cfg.num_layers
    candidates: dict[tuple, object] = {}
    for w in type(model).WEIGHTS:
        key = tuple(w.path.split("."))
        if w.linear and w.per_layer and key in flat:
            value = flat[key].get_value()
            if (stack_int8 and isinstance(value, QuantizedWeight)) or (stack_f32 and _stackable_f32(value)):
                candidates[key] = value
    stacked: dict[tuple, object] = {}
    for path, module in nnx.iter_modules(model):
        for kind, names in FUSED:
            keys = [(*map(str, path), name, "w") for name in names]
            if not isinstance(module, kind) or not all(k in candidates for k in keys):
                continue
            group = [candidates[k] for k in keys]
            if all(isinstance(g, QuantizedWeight) for g in group):
                if len({(g.logical[0], g.mode, g.q.shape[0]) for g in group}) != 1:
                    continue  # not one input, mode and depth: left unfused
                stacked[keys[0]] = _fuse(group)
            elif all(_stackable_f32(g) for g in group) and len({g.shape[:2] for g in group}) == 1:
                stacked[keys[0]] = _fuse_f32(group)
            else:
                continue
            for j, k in enumerate(keys[1:], 1):
                stacked[k] = FusedMember(j)
    for w in type(model).WEIGHTS:
        key = tuple(w.path.split("."))
        var = flat.get(key)
        if var is None or not (w.linear and w.per_layer):
            continue
        if key in stacked:
            var.set_value(stacked[key])
            continue
        value = var.get_value()
        if key in candidates:
            var.set_value(_fuse([value]) if isinstance(value, QuantizedWeight) else _fuse_f32([value]))
            continue
        var.set_value(PerLayer(tuple(jax.tree.map(lambda a, i=i: a[i], value) for i in range(n))))
    nnx.update(model, state)
