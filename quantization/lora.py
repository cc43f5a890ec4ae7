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
class TilePlan:
    """A step's tokens grouped by adapter slot, for the delta of a many-token step (Punica's segment
    matmuls with static shapes): the tokens sorted by slot, cut into blocks of `block` rows, and one
    tile per (block, slot) pair that occurs, K = blocks + slots - 1 tiles at most. Tile k multiplies
    its block's rows by its slot's A and B only, so a token costs r*(in+out) multiply-adds instead of
    the dense form's S*r*(in+out). Built once per step (tile_plan); the layer scan slices it like the
    weights (every leaf [L, ...])."""

    rows: jax.Array    # i32 [K, block]: the token in each row of each tile (>= T: padding, reads zeros)
    slot: jax.Array    # i32 [K]: the tile's slot - 1 (the column group of A, row group of B)
    keep: jax.Array    # bool [K, block]: rows whose token is on the tile's slot (others give zero)
    source: jax.Array  # i32 [T]: each token's row in the tiles' output [K * block]
    lora: jax.Array    # bool [T]: the token is on an adapter (slot > 0)


def tile_plan(token_slots: jax.Array, max_loras: int, block: int) -> TilePlan:
    """The TilePlan of tokens on slots i32[T] (0: base model, no tile), traced inside the step."""
    t = token_slots.shape[0]
    blocks = -(-t // block)
    tiles = blocks + max_loras - 1
    slots = jnp.concatenate([token_slots.astype(jnp.int32), jnp.zeros(blocks * block - t, jnp.int32)])
    order = jnp.argsort(slots, stable=True)                                          # sorted row -> token
    by_block = slots[order].reshape(blocks, block)
    lo, hi = jnp.maximum(by_block[:, 0], 1), jnp.maximum(by_block[:, -1], 1)         # slots each block spans
    count = hi - lo + 1                                                              # its tiles (sorted: sum <= tiles)
    start = jnp.cumsum(count) - count                                                # its first tile
    k = jnp.arange(tiles, dtype=jnp.int32)
    tile_block = jnp.clip(jnp.searchsorted(start, k, side="right") - 1, 0, blocks - 1).astype(jnp.int32)
    tile_slot = lo[tile_block] + k - start[tile_block]
    used = k < start[-1] + count[-1]
    keep = (by_block[tile_block] == tile_slot[:, None]) & used[:, None]
    rows = order.reshape(blocks, block)[tile_block]
    position = jnp.zeros(blocks * block, jnp.int32).at[order].set(jnp.arange(blocks * block, dtype=jnp.int32))[:t]
    b, j = position // block, position % block
    on = token_slots > 0
    source = jnp.where(on, (start[b] + token_slots - lo[b]) * block + j, 0)
    return TilePlan(rows, jnp.clip(tile_slot - 1, 0, max_loras - 1), keep, source, on)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraWeight:
    """base: the weight as the engine holds it; a [in, S*r], b [S*r, out]: the adapters of S slots side
    by side, slot s (1-based) in columns/rows (s-1)*r .. s*r of rank r (zero-padded, scale folded into
    b); slots [T]: each token's slot, 0 for the base model; plan: the tokens grouped by slot (steps of
    many tokens; None: the dense form). In the stacked params every leaf has the layer axis first
    ([L, ...], slots and plan broadcast); the layer scan slices them like any weight."""

    base: Any
    a: jax.Array
    b: jax.Array
    slots: jax.Array
    plan: TilePlan | None
    rank: int = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self):
        return (self.a.shape[-2], self.b.shape[-1])

    def delta(self, x: jax.Array) -> jax.Array:
        """x [T, in] -> [T, out] f32: each token through its slot's B(A(x)), zero for slot 0."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        y = self._dense(x2) if self.plan is None else self._tiled(x2, self.plan)
        return y.reshape(*lead, y.shape[-1])

    def _dense(self, x2: jax.Array) -> jax.Array:
        """One dense pair of matmuls over all S slots, the other slots' columns masked: cheapest for
        few tokens (a decode step reads every slot's A and B anyway), S*r*(in+out) per token."""
        h = jnp.einsum("ti,ic->tc", x2.astype(self.a.dtype), self.a,
                       preferred_element_type=jnp.float32)                           # [T,S*r]
        cols = jnp.arange(self.a.shape[-1], dtype=jnp.int32) // self.rank + 1         # [S*r] slot of each column
        h = jnp.where(self.slots.reshape(-1, 1) == cols[None, :], h, 0.0)
        return jnp.einsum("tc,co->to", h.astype(self.b.dtype), self.b,
                          preferred_element_type=jnp.float32)                         # [T,out]

    def _tiled(self, x2: jax.Array, plan: TilePlan) -> jax.Array:
        """Tile by tile (TilePlan): each block of slot-sorted tokens through its own slots' A and B."""
        r, (d_in, d_out) = self.rank, self.shape
        s = self.a.shape[-1] // r
        xt = jnp.take(x2.astype(self.a.dtype), plan.rows, axis=0, mode="fill", fill_value=0)   # [K,blk,in]
        at = jnp.take(self.a.reshape(d_in, s, r), plan.slot, axis=1)                 # [in,K,r]
        h = jnp.einsum("kti,ikr->ktr", xt, at, preferred_element_type=jnp.float32)
        h = jnp.where(plan.keep[..., None], h, 0.0)
        bt = jnp.take(self.b.reshape(s, r, d_out), plan.slot, axis=0)               # [K,r,out]
        yt = jnp.einsum("ktr,kro->kto", h.astype(self.b.dtype), bt, preferred_element_type=jnp.float32)
        y = jnp.take(yt.reshape(-1, d_out), plan.source, axis=0)                    # [T,out]
        return jnp.where(plan.lora[:, None], y, 0.0)


def split(weights) -> tuple[list, list[LoraWeight | None]]:
    """The base forms of a group of weights, and each one's LoraWeight (None where it has none)."""
    bases = [w.base if isinstance(w, LoraWeight) else w for w in weights]
    loras = [w if isinstance(w, LoraWeight) else None for w in weights]
    return bases, loras


def add_deltas(x: jax.Array, ys, loras) -> tuple[jax.Array, ...]:
    return tuple(y if lo is None else (y.astype(jnp.float32) + lo.delta(x)).astype(y.dtype)
                 for y, lo in zip(ys, loras))
