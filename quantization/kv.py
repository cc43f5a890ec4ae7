"""int8 KV cache entries: per-token, per-head symmetric scales over head_dim.

Pure array math; page layout and bookkeeping belong to engine/.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.attention import quantize_kv as kernels_quantize_kv


def quantize_kv(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x f[..., n_kv_heads, head_dim] -> (int8 same shape, f32 scale [..., n_kv_heads])."""
    if x.ndim < 2:
        raise ValueError(
            f"quantize_kv expects [..., n_kv_heads, head_dim], got shape {tuple(x.shape)}"
        )
    return kernels_quantize_kv(x)  # the attention kernels write the cache with this rounding


def dequantize_kv(q: jax.Array, scale: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Inverse of quantize_kv: int8 [..., n_kv_heads, head_dim] * scale -> dtype."""
    if q.shape[:-1] != scale.shape:
        raise ValueError(
            f"dequantize_kv: scale shape {tuple(scale.shape)} must equal q.shape[:-1] "
            f"{tuple(q.shape[:-1])}"
        )
    return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)
