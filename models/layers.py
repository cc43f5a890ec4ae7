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


AttentionState = tuple[jax.Array, jax.Array, jax.Array]  # (unnormalised out, running max, running sum)


def attention_rows(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """q [B,T,H,hd] -> [B,KV,G*T,hd]: each KV head's queries as the rows of one matmul (g major)."""
    b, t, h, hd = q.shape
    g = h // num_kv_heads
    return q.reshape(b, t, num_kv_heads, g, hd).transpose(0, 2, 3, 1, 4).reshape(b, num_kv_heads, g * t, hd)


def attention_start(q_rows: jax.Array) -> AttentionState:
    b, kvh, m, hd = q_rows.shape
    return (jnp.zeros((b, kvh, m, hd), jnp.float32), jnp.full((b, kvh, m), -1e30, jnp.float32),
            jnp.zeros((b, kvh, m), jnp.float32))


def attention_block(state: AttentionState, q_rows: jax.Array, k: jax.Array, v: jax.Array,
                    mask: jax.Array, k_scale: jax.Array | None = None,
                    v_scale: jax.Array | None = None) -> AttentionState:
    """Fold one block of keys into an online softmax (as flash attention does).

    q_rows [B,KV,G*T,hd]; k, v [B,KV,S,hd]; mask bool [B,S,T] (key s visible to query t).
    k_scale, v_scale [B,KV,S] (int8 KV): k and v are the unscaled int8 values; a per-key scale
    factors out of both dots, so it multiplies the scores and the probabilities instead of
    every element of K and V (a dequantized copy of K/V cost more than the attention itself).
    A block whose keys are all masked for a row adds nothing to it, provided an earlier block
    gave that row a real key (the step's own token does).
    """
    acc, m, l = state
    b, kvh, rows, hd = q_rows.shape
    s_len, t = k.shape[2], mask.shape[2]
    # Keys on the major axis of the scores, K as the left operand: XLA:CPU then streams each
    # head's [S,hd] rows once; the q-major form ran ~3x slower.
    scores = jnp.einsum("bksh,bkmh->bksm", k, q_rows.astype(k.dtype),
                        preferred_element_type=jnp.float32) * (1.0 / math.sqrt(hd))
    if k_scale is not None:
        scores = scores * k_scale[..., None]
    visible = mask[:, None, :, None, :]                                              # [B,1,S,1,T]
    scores = jnp.where(visible, scores.reshape(b, kvh, s_len, rows // t, t), -1e30)
    m_new = jnp.maximum(m, jnp.max(scores, axis=2).reshape(b, kvh, rows))
    probs = jnp.exp(scores - m_new.reshape(b, kvh, 1, rows // t, t))
    probs = jnp.where(visible, probs, 0.0).reshape(b, kvh, s_len, rows)                # [B,KV,S,M]
    correction = jnp.exp(m - m_new)
    # The barrier keeps probs materialised as [M,S]: folded into the matmul as a transposed left
    # operand, XLA:CPU leaves its fast path for V.
    weights = probs if v_scale is None else probs * v_scale[..., None]
    probs_t = jax.lax.optimization_barrier(jnp.swapaxes(weights, 2, 3).astype(v.dtype))  # [B,KV,M,S]
    out = jnp.einsum("bkms,bksh->bkmh", probs_t, v, preferred_element_type=jnp.float32)
    return acc * correction[..., None] + out, m_new, l * correction + jnp.sum(probs, axis=2)


def attention_finish(state: AttentionState, t: int, dtype) -> jax.Array:
    """Normalise and return [B,T,H*hd] (heads in the same order as q)."""
    acc, _, l = state
    b, kvh, rows, hd = acc.shape
    out = (acc / l[..., None]).reshape(b, kvh, rows // t, t, hd)                    # [B,KV,G,T,hd]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, kvh * (rows // t) * hd).astype(dtype)
