"""The Llama-family forward pass: a pure function of (params, KV pages) -> (logits, KV pages).

Two entry points share the layer code: `forward_dense` (no cache; the reference for tests) and
`forward_paged` (reads and writes a paged KV cache; what the engine jits per shape bucket).
Layers are stacked on a leading axis and run under `lax.scan`, which keeps compile time flat in depth.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from models import layers
from models.config import ModelConfig


def _embed(params: dict, tokens: jax.Array, dtype) -> jax.Array:
    return jnp.take(params["embed"], tokens, axis=0).astype(dtype)  # [B,T,D]


def _lm_head(params: dict, cfg: ModelConfig, h: jax.Array) -> jax.Array:
    h = layers.rms_norm(h, params["final_norm"], cfg.rms_norm_eps)
    if "lm_head" not in params:  # tied; quantization may add an int8 copy as lm_head
        return jnp.einsum("...d,vd->...v", h, params["embed"].astype(h.dtype),
                          preferred_element_type=jnp.float32)
    return layers.linear(h, params["lm_head"]).astype(jnp.float32)


def _window_mask(mask: jax.Array, q_pos: jax.Array, k_pos: jax.Array, cfg: ModelConfig) -> jax.Array:
    if cfg.sliding_window is None:
        return mask
    return mask & (k_pos > q_pos - cfg.sliding_window)


def forward_dense(params: dict, cfg: ModelConfig, tokens: jax.Array,
                  valid: jax.Array | None = None, dtype=jnp.float32) -> jax.Array:
    """Logits [B,T,V] for right-padded token batches [B,T] (valid: bool [B,T]); no cache."""
    b, t = tokens.shape
    if valid is None:
        valid = jnp.ones((b, t), bool)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    q_pos, k_pos = positions[:, :, None], positions[:, None, :]
    mask = _window_mask((k_pos <= q_pos) & valid[:, None, :], q_pos, k_pos, cfg)  # [B,T,T]
    inv_freq = jnp.asarray(layers.rope_inv_freq(cfg))

    def layer(x, lp):
        h = layers.rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
        q, k, v = layers.qkv(h, lp, cfg, positions, inv_freq)
        x = x + layers.linear(layers.attend(q, k, v, mask), lp["wo"])
        x = x + layers.swiglu(layers.rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps), lp)
        return x, None

    x, _ = jax.lax.scan(layer, _embed(params, tokens, dtype), params["layers"])
    return _lm_head(params, cfg, x)


def init_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype) -> dict:
    """KV pages for all layers, flattened to token slots: [L, num_pages * page_size, KV, hd].

    With dtype int8 the cache also holds per-token-per-head f32 scales [L, slots, KV].
    """
    shape = (cfg.num_layers, num_pages * page_size, cfg.num_kv_heads, cfg.head_dim)
    cache = {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
    if jnp.dtype(dtype) == jnp.int8:
        cache["k_scale"] = jnp.zeros(shape[:3], jnp.float32)
        cache["v_scale"] = jnp.zeros(shape[:3], jnp.float32)
    return cache


def _write_kv(cache: dict, i: jax.Array, slots: jax.Array, k: jax.Array, v: jax.Array) -> dict:
    """Scatter new K/V [N,KV,hd] into layer i at flat token slots [N]."""
    out = dict(cache)
    if "k_scale" in cache:
        from quantization.kv import quantize_kv

        (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
        out["k"] = cache["k"].at[i, slots].set(kq)
        out["v"] = cache["v"].at[i, slots].set(vq)
        out["k_scale"] = cache["k_scale"].at[i, slots].set(ks)
        out["v_scale"] = cache["v_scale"].at[i, slots].set(vs)
    else:
        out["k"] = cache["k"].at[i, slots].set(k.astype(cache["k"].dtype))
        out["v"] = cache["v"].at[i, slots].set(v.astype(cache["v"].dtype))
    return out


def _read_kv(cache: dict, i: jax.Array, token_slots: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Gather K/V of layer i at token slots [B,S] -> [B,S,KV,hd]."""
    k = cache["k"][i][token_slots]
    v = cache["v"][i][token_slots]
    if "k_scale" in cache:
        from quantization.kv import dequantize_kv

        k = dequantize_kv(k, cache["k_scale"][i][token_slots], dtype)
        v = dequantize_kv(v, cache["v_scale"][i][token_slots], dtype)
    return k.astype(dtype), v.astype(dtype)


def forward_paged(params: dict, cfg: ModelConfig, cache: dict, tokens: jax.Array,
                  positions: jax.Array, write_slots: jax.Array, block_tables: jax.Array,
                  last_index: jax.Array,
                  *, page_size: int, dtype=jnp.float32) -> tuple[jax.Array, dict]:
    """One step over a paged KV cache; returns logits of each row's `last_index` token and the cache.

    tokens, positions: int32 [B,T] (T = 1 for decode, a chunk for prefill).
    write_slots: int32 [B,T]: flat cache slot (page * page_size + offset) for each token's K/V;
    padding tokens write to slot 0 of the reserved page 0.
    block_tables: int32 [B,P]: the pages of each row's sequence, in order (P*page_size >= last
    position + 1); entries past the sequence are page 0.
    Every key at a position <= the query's position is attended, so earlier chunks, prefix-cache
    pages and the current chunk are all seen; page 0's garbage is never at a valid position.
    """
    b, t = tokens.shape
    p = block_tables.shape[1]
    write_slots = write_slots.reshape(-1)                                           # [B*T]
    read_slots = (block_tables[:, :, None] * page_size
                  + jnp.arange(page_size, dtype=jnp.int32)).reshape(b, p * page_size)  # [B,S]
    k_pos = jnp.arange(p * page_size, dtype=jnp.int32)[None, None, :]
    q_pos = positions[:, :, None]
    mask = _window_mask(k_pos <= q_pos, q_pos, k_pos, cfg)                          # [B,T,S]
    inv_freq = jnp.asarray(layers.rope_inv_freq(cfg))

    def layer(carry, lp_i):
        x, kv = carry
        lp, i = lp_i
        h = layers.rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
        q, k, v = layers.qkv(h, lp, cfg, positions, inv_freq)
        kv = _write_kv(kv, i, write_slots, k.reshape(b * t, *k.shape[2:]), v.reshape(b * t, *v.shape[2:]))
        k_all, v_all = _read_kv(kv, i, read_slots, x.dtype)
        x = x + layers.linear(layers.attend(q, k_all, v_all, mask), lp["wo"])
        x = x + layers.swiglu(layers.rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps), lp)
        return (x, kv), None

    layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    (x, cache), _ = jax.lax.scan(layer, (_embed(params, tokens, dtype), cache),
                                 (params["layers"], layer_ids))
    h_last = jnp.take_along_axis(x, last_index[:, None, None], axis=1)[:, 0]          # [B,D]
    return _lm_head(params, cfg, h_last), cache
