"""Llama building blocks as pure functions: RMSNorm, RoPE, SwiGLU, the one linear op.

Norms, softmax and matmul accumulation run in f32 whatever the activation dtype.
"""
from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig


def linear(x: jax.Array, w) -> jax.Array:
    """x @ w with f32 accumulation; int8 weights go to the quantization ops."""
    if isinstance(w, jax.Array | np.ndarray):
        y = jnp.einsum("...i,io->...o", x, w, preferred_element_type=jnp.float32)
        return y.astype(x.dtype)
    from quantization import ops  # int8 weights are a pytree, not an array

    return ops.linear(x, w)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * weight.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [head_dim // 2], with Llama-3 or linear scaling applied (as HF does)."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    rs = cfg.rope_scaling
    if rs is None:
        return inv.astype(np.float32)
    if rs.kind == "linear":
        return (inv / rs.factor).astype(np.float32)
    low_wavelen = rs.original_max_position / rs.low_freq_factor
    high_wavelen = rs.original_max_position / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (rs.original_max_position / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF layout). x: [B, T, N, hd], positions: [B, T]."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, hd/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


# (x, weight names) -> x @ each named weight of the layer; lets a caller choose where weights live
Matmul = Callable[[jax.Array, tuple[str, ...]], tuple[jax.Array, ...]]


def layer_matmul(lp: dict) -> Matmul:
    return lambda x, names: tuple(linear(x, lp[name]) for name in names)


def swiglu(h: jax.Array, lp: dict, *, matmul: Matmul | None = None) -> jax.Array:
    mm = matmul or layer_matmul(lp)
    gate, up = mm(h, ("w_gate", "w_up"))  # [..., F] each
    return mm(jax.nn.silu(gate) * up, ("w_down",))[0]


def qkv(h: jax.Array, lp: dict, cfg: ModelConfig, positions: jax.Array,
        inv_freq: jax.Array, *, matmul: Matmul | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Projections with RoPE applied. Returns q [B,T,H,hd], k and v [B,T,KV,hd]."""
    b, t, _ = h.shape
    q, k, v = (matmul or layer_matmul(lp))(h, ("wq", "wk", "wv"))
    if cfg.attention_bias:
        q, k, v = q + lp["bq"].astype(q.dtype), k + lp["bk"].astype(k.dtype), v + lp["bv"].astype(v.dtype)
    q = apply_rope(q.reshape(b, t, cfg.num_heads, cfg.head_dim), positions, inv_freq)
    k = apply_rope(k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim), positions, inv_freq)
    return q, k, v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """GQA attention. q [B,T,H,hd]; k, v [B,S,KV,hd]; mask bool [B,T,S] -> [B,T,H*hd]."""
    b, t, h, hd = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, hd)                                     # [B,T,KV,G,hd]
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / math.sqrt(hd))
    scores = jnp.where(mask[:, None, None, :, :], scores, -1e30)                 # [B,KV,G,T,S]
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h * hd).astype(q.dtype)
