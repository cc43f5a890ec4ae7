"""A linear weight with LoRA adapters on top: the base weight (any form quantization.ops multiplies)
plus a low-rank delta per token, chosen by the token's adapter slot. The delta runs in the adapters'
dtype (f32 or bf16) with f32 accumulation, whatever the base weight's form (int8 included)."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraWeight:
    """base: the weight as the engine holds it; a [in, S*r], b [S*r, out]: the adapters of S slots side
    by side, slot s (1-based) in columns/rows (s-1)*r .. s*r of rank r (zero-padded, scale folded into
    b); slots [T]: each token's slot, 0 for the base model. In the stacked params every leaf has the
    layer axis first ([L, ...], slots broadcast [L, T]); the layer scan slices them like any weight."""

    base: Any
    a: jax.Array
    b: jax.Array
    slots: jax.Array
    rank: int = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self):
        return (self.a.shape[-2], self.b.shape[-1])

    def delta(self, x: jax.Array) -> jax.Array:
        """x [T, in] -> [T, out] f32: each token through its slot's B(A(x)), zero for slot 0.
        One dense pair of matmuls over all S slots, the other slots' columns masked: a fixed shape
        whatever the batch's mix of adapters (Punica's segment matmuls in dense form), and the cost
        S*r*(in+out) per token, small next to the base weight's in*out for S*r << in."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        h = jnp.einsum("ti,ic->tc", x2.astype(self.a.dtype), self.a,
                       preferred_element_type=jnp.float32)                           # [T,S*r]
        cols = jnp.arange(self.a.shape[-1], dtype=jnp.int32) // self.rank + 1         # [S*r] slot of each column
        h = jnp.where(self.slots.reshape(-1, 1) == cols[None, :], h, 0.0)
        y = jnp.einsum("tc,co->to", h.astype(self.b.dtype), self.b,
                       preferred_element_type=jnp.float32)                           # [T,out]
        return y.reshape(*lead, y.shape[-1])


def split(weights) -> tuple[list, list[LoraWeight | None]]:
    """The base forms of a group of weights, and each one's LoraWeight (None where it has none)."""
    bases = [w.base if isinstance(w, LoraWeight) else w for w in weights]
    loras = [w if isinstance(w, LoraWeight) else None for w in weights]
    return bases, loras


def add_deltas(x: jax.Array, ys, loras) -> tuple[jax.Array, ...]:
    return tuple(y if lo is None else (y.astype(jnp.float32) + lo.delta(x)).astype(y.dtype)
                 for y, lo in zip(ys, loras))
