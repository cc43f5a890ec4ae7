"""A linear weight with LoRA adapters on top: the base weight (any form quantization.ops multiplies)
plus a low-rank delta per token, chosen by the token's adapter slot. The delta runs in the adapters'
dtype (f32 or bf16) with f32 accumulation, whatever the base weight's form (int8 included)."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from slipstream.kernels import f32_matmul as f32
from slipstream.kernels.lora_delta import lora_add
from slipstream.kernels.q8_matmul import gated_input


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedStack:
    """One side of every layer's adapter weights (A [in, S*r] or B [S*r, out]) as one stack packed
    for kernels/f32_matmul ([L, Np/32, K*32]): the scanned layer body passes the whole stack and the
    layer index to kernels/lora_delta (ops.per_layer), which reads layer i where it lies, instead of
    XLA:CPU copying each layer's slice out of an [L, ...] stack."""

    packed: jax.Array
    n: int = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-2], self.packed.shape[-1] // f32.PANEL, self.n)

    def pick(self, index: jax.Array) -> "PackedPick":
        return PackedPick(index, self)


@dataclasses.dataclass(frozen=True)
class PackedPick:
    """Layer `index` of a PackedStack, inside the scanned layer body."""

    index: jax.Array
    stack: PackedStack

    @property
    def shape(self) -> tuple[int, ...]:
        return self.stack.shape[1:]


def _matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum("ti,io->to", x.astype(w.dtype), w, preferred_element_type=jnp.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraWeight:
    """base: the weight as the engine holds it; a [in, S*r], b [S*r, out]: the adapters of S slots side
    by side, slot s (1-based) in columns/rows (s-1)*r .. s*r of rank r (zero-padded, scale folded into
    b), as arrays or (XLA:CPU) PackedStacks; slots [T]: each token's slot, 0 for the base model. In the
    stacked params every leaf has the layer axis first ([L, ...], slots broadcast [L, T]); the layer
    scan slices the arrays like any weight and picks the PackedStacks at the layer index."""

    base: Any
    a: Any
    b: Any
    slots: jax.Array
    rank: int = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self):
        return (self.a.shape[-2], self.b.shape[-1])

    def add_to(self, y: jax.Array, x: jax.Array, col: int = 0, gated: bool = False) -> jax.Array:
        """y [T, W] holding x's product by the base weight in columns col .. col + out (a fused group's
        output holds its other members' around it), plus each token's B(A(x)) there, for x [T, in]
        (gated: a gated MLP's gate | up [T, 2*in], the input silu(gate) * up), in y's dtype (f32
        accumulation); nothing added for slot 0.
        - Packed stacks (XLA:CPU): kernels/lora_delta, each token through its own slot's A and B only,
          y updated in place.
        - Arrays: one dense pair of matmuls over all S slots, the other slots' columns masked: a fixed
          shape whatever the batch's mix of adapters (Punica's segment matmuls in dense form), and the
          cost S*r*(in+out) per token, small next to the base weight's in*out for S*r << in. Skipped
          in a step with no token on an adapter."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        y2 = y.reshape(-1, y.shape[-1]).astype(jnp.float32)
        slots = self.slots.reshape(-1)
        if isinstance(self.a, PackedPick):
            out = lora_add(y2, x2, self.a.stack.packed, self.b.stack.packed, slots, rank=self.rank,
                           layer=self.a.index, col=col, n=self.b.stack.n, gated=gated)
            return out.reshape(*lead, out.shape[-1]).astype(y.dtype)
        x2 = gated_input(x2) if gated else x2

        def dense(x2):
            h = _matmul(x2, self.a)                                                   # [T,S*r] f32
            cols = jnp.arange(self.a.shape[-1], dtype=jnp.int32) // self.rank + 1     # [S*r] slot of each column
            h = jnp.where(slots[:, None] == cols[None, :], h, 0.0)
            return _matmul(h, self.b)                                                 # [T,out] f32

        d = jax.lax.cond(jnp.any(slots > 0), dense,
                         lambda x2: jnp.zeros((x2.shape[0], self.b.shape[-1]), jnp.float32), x2)
        out = y2.at[:, col:col + d.shape[-1]].add(d)
        return out.reshape(*lead, out.shape[-1]).astype(y.dtype)


def split(weights) -> tuple[list, list[LoraWeight | None]]:
    """The base forms of a group of weights, and each one's LoraWeight (None where it has none)."""
    bases = [w.base if isinstance(w, LoraWeight) else w for w in weights]
    loras = [w if isinstance(w, LoraWeight) else None for w in weights]
    return bases, loras


def add_deltas(x: jax.Array, ys, loras) -> tuple[jax.Array, ...]:
    return tuple(y if lo is None else lo.add_to(y, x) for y, lo in zip(ys, loras))


def add_fused(x: jax.Array, y: jax.Array, spans, loras) -> jax.Array:
    """A fused group's product y [T, W] (member j in columns spans[j] = (first, width)) with each
    member's delta added where its columns lie: no member's columns are copied out for it."""
    for (first, _), lo in zip(spans, loras):
        if lo is not None:
            y = lo.add_to(y, x, col=first)
    return y
