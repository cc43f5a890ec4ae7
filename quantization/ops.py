"""Runtime matmul for float or int8 weights: `linear` is the only matmul the model calls.

The model passes whatever params holds (array or QuantizedWeight) and never branches on it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.q8_matmul import q8_matmul
from quantization import int8
from quantization.weights import QuantizedWeight


def linear(x: jax.Array, w: jax.Array | QuantizedWeight | int8.Int8Weight) -> jax.Array:
    """x[..., in] @ w[in, out] -> [..., out] in x.dtype, accumulating in f32 (per group of 32 inputs
    in int32 for the group-wise int8 modes: kernels.q8_matmul, native on CPU; quantization/int8.py's
    dots for the MXU modes)."""
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
