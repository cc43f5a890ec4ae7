"""int8 KV cache entries: per-token, per-head symmetric scales over head_dim.

Pure array math; page layout and bookkeeping belong to engine/.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from quantization.weights import INT8_MAX


def quantize_kv(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x f[..., n_kv_heads, head_dim] -> (int8 same shape, f32 scale [..., n_kv_heads])."""
    if x.ndim < 2:
        raise ValueError(
            f"quantize_kv expects [..., n_kv_heads, head_dim], got shape {tuple(x.shape)}"
        )
    x32 = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x32), axis=-1) / INT8_MAX  # [..., n_kv_heads]
    # A zero vector (e.g. padding) keeps scale 0 and dequantizes to exact zeros.
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(x32 / safe[..., None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale


def dequantize_kv(q: jax.Array, scale: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Inverse of quantize_kv: int8 [..., n_kv_heads, head_dim] * scale -> dtype."""
    if q.shape[:-1] != scale.shape:
        raise ValueError(
            f"dequantize_kv: scale shape {tuple(scale.shape)} must equal q.shape[:-1] "
            f"{tuple(q.shape[:-1])}"
        )
    return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)
