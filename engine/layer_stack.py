"""XLA:CPU's per-layer weight buffers: the engine's form of stacked linear weights on CPU.

A scan over stacked weights [L, ...] makes XLA:CPU copy each layer's slice out of the stack before
its dot (it cannot matmul a dynamic slice), ~2x the weight reads at batch 1. So on CPU each linear
weight is kept as L separate buffers (`PerLayer`), and the scanned layer body picks layer i's buffer
with lax.switch (`LayerPick`); a group of weights read by one input (q/k/v, gate/up) shares one
switch. models/layers.py calls `pick` and `linears` without knowing why.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
from flax import nnx

from models import layers
from models.base import CausalLM


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


def split_linears(model: CausalLM) -> None:
    """Keep every per-layer linear weight of `model` as L buffers (in place)."""
    state = nnx.state(model, nnx.Param)
    flat = dict(nnx.to_flat_state(state))
    n = model.cfg.num_layers
    for w in type(model).WEIGHTS:
        var = flat.get(tuple(w.path.split(".")))
        if var is None or not (w.linear and w.per_layer):
            continue
        value = var.get_value()
        var.set_value(PerLayer(tuple(jax.tree.map(lambda a, i=i: a[i], value) for i in range(n))))
    nnx.update(model, state)
