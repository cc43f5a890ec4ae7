"""The one linear-weight seam: every matmul by a weight the model makes goes through `linear`,
`linears` (a group one input feeds), `gated_down` and, in the layer scan, `per_layer` / `pick`.

The model passes whatever its params hold (a float array, a group-wise QuantizedWeight, an
Int8Weight, or a per-backend stacked form of quantization/layer_forms.py) and never branches on it.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

from slipstream.kernels.q8_matmul import q8_matmul
from slipstream.quantization import int8, lora
from slipstream.quantization.groupwise import QuantizedTable
from slipstream.quantization.weights import QuantizedWeight


def linear(x: jax.Array, w: jax.Array | QuantizedWeight | int8.Int8Weight) -> jax.Array:
    """x[..., in] @ w[in, out] -> [..., out] in x.dtype, accumulating in f32 (per group of 32 inputs
    in int32 for the group-wise int8 modes: kernels.q8_matmul, native on CPU; quantization/int8.py's
    dots for the MXU modes). A LoraWeight adds its adapters' delta to its base weight's product."""
    if isinstance(w, lora.LoraWeight):
        return lora.add_deltas(x, (linear(x, w.base),), (w,))[0]
    if w.ndim != 2:
        raise ValueError(
            f"linear expects a 2-D weight [in, out], got shape {tuple(w.shape)}; "
            "slice stacked layer weights (e.g. with lax.scan) first"
        )
    if x.shape[-1] != w.shape[0]:
        raise ValueError(
            f"linear: input feature size {x.shape[-1]} does not match weight shape {tuple(w.shape)}"
        )
    if isinstance(w, int8.Int8Weight):
        return int8.matmul(x, w).astype(x.dtype)
    if not isinstance(w, QuantizedWeight):
        y = jnp.einsum("...i,io->...o", x, w, preferred_element_type=jnp.float32)
        return y.astype(x.dtype)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # [M, in]
    y = q8_matmul(x2, w.q, w.scale, w.offset, n=w.shape[1], parts=1 if w.mode == "q8_0" else 2)
    return y.reshape(*lead, w.shape[1]).astype(x.dtype)


def embed_lookup(table: Any, tokens: jax.Array, dtype) -> jax.Array:
    """Rows `tokens` [T] of an embedding table [V, D] (a float array, or group-wise int8 rows
    dequantized here: groupwise.QuantizedTable) -> [T, D] in `dtype`."""
    if isinstance(table, QuantizedTable):
        return table.lookup(tokens, dtype)
    return jnp.take(table, tokens, axis=0).astype(dtype)


def embed_dense(table: Any, dtype) -> jax.Array:
    """The whole embedding table [V, D] in `dtype` (a tied LM head kept in float)."""
    return table.dequantize(dtype) if isinstance(table, QuantizedTable) else table.astype(dtype)


def linears(x: jax.Array, weights: Sequence[Any]) -> tuple[jax.Array, ...]:
    """x @ each weight of a group one input feeds (q/k/v, gate/up), in the model's order. A form that
    multiplies a whole group (a `linears` method: layer_forms' picks, engine/sharding.py's weights)
    gets it at once, so a per-layer switch or a fused stack serves the group with one call. LoRA
    weights: the base forms as a group, then each member's delta (into the group's fused product where
    its form has one: `fused_linears`)."""
    bases, loras = lora.split(weights)
    if any(lo is not None for lo in loras):
        if hasattr(bases[0], "fused_linears"):
            y, spans = bases[0].fused_linears(x, tuple(bases))                       # [M, W] f32
            y = lora.add_fused(x.reshape(-1, x.shape[-1]), y, spans, loras)
            return tuple(y[:, o:o + n].reshape(*x.shape[:-1], n).astype(x.dtype) for o, n in spans)
        return lora.add_deltas(x, linears(x, bases), loras)
    if hasattr(weights[0], "linears"):
        return weights[0].linears(x, tuple(weights))
    return tuple(linear(x, w) for w in weights)


def gated_down(x: jax.Array, gate: Any, up: Any, down: Any) -> jax.Array | None:
    """down(silu(gate(x)) * up(x)) where the weights' form multiplies the whole MLP at once (int8
    stacks on CPU form silu(gate) * up inside the down projection's kernel); None elsewhere, and the
    caller multiplies the three linears itself. LoRA weights: the base forms' MLP with the deltas
    (gate's and up's before the activation) added inside."""
    (gate, up, down), loras = lora.split((gate, up, down))
    if hasattr(gate, "gated_down"):
        return gate.gated_down(x, (gate, up), down, loras=tuple(loras))
    return None


def per_layer(leaf: Any) -> bool:
    """A stacked weight the layer scan must pick by the traced layer index (L separate buffers, or a
    stack a kernel reads in place) instead of slicing it along its leading axis."""
    return hasattr(leaf, "pick")


def pick(leaf: Any, layer: jax.Array) -> Any:
    """Layer `layer`'s weight of a per_layer leaf, inside the scanned layer body."""
    return leaf.pick(layer)
