"""The TPU KV page layout: one row per token holding every KV head's K and V, so a page is one DMA and the
step's K/V write is one scatter index per token.

  kv       [L, num_pages, page_size, KV * 2 * hd]   row (layer, page, offset): [K_0 | V_0 | K_1 | V_1 | ...]
  kv_scale [L, num_pages, KV, 2, page_size]          f32, int8 caches only (per token and head)

A page (all heads, K and V) is one contiguous block [page_size, KV * 2hd]; a head's keys lie in sublanes and
its [K | V] in lanes [h * 2hd, (h + 1) * 2hd), so the kernel's score and value matmuls read them as they lie
(128-lane slices; heads of 64 share one 128-lane slice [K | V], and the kernel pads q to it). XLA's TPU
scatter costs about 70-95 ns per index whatever the row's width, so the write's cost is set by its index
count: one per token here (a row per token and head was 8-16 per token at 8 KV heads: 565 us per layer for a
512-token chunk of 8B heads). The row's width is a multiple of 128 lanes at any head size of 64 or more, so
TPU memory tiles carry no padding. The "kv" key marks the layout (the CPU layout has "k" and "v").
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

# 128-token pages: a bf16 page of 8 KV heads x hd 128 is a 512 KiB DMA (sglang-jax found 128 necessary).
PAGE_SIZE = 128


def is_merged(kv_cache: dict) -> bool:
    """Whether the cache has this layout (else kernels.attention's CPU layout)."""
    return "kv" in kv_cache


def pads_q(head_dim: int) -> bool:
    """Whether a head's K and V share one 128-lane slice (heads of 64 or less): the kernel then pads q with
    zeros to the slice's width and keeps the V lanes of its output, where wider heads slice K and V apart."""
    return 2 * head_dim <= 128


def shapes(num_layers: int, num_kv_heads: int, num_pages: int, page_size: int, head_dim: int,
           dtype) -> dict[str, jax.ShapeDtypeStruct]:
    """The cache's arrays: name -> shape and dtype."""
    kv = (num_layers, num_pages, page_size, num_kv_heads * 2 * head_dim)
    out = {"kv": jax.ShapeDtypeStruct(kv, jnp.dtype(dtype))}
    if jnp.dtype(dtype) == jnp.int8:
        out["kv_scale"] = jax.ShapeDtypeStruct((num_layers, num_pages, num_kv_heads, 2, page_size), jnp.float32)
    return out


def from_standard(cache: dict) -> dict:
    """A CPU-layout cache ({"k", "v": [L, KV, pages, ps, hd]} in row order, optional scales) -> this layout.
    K must be in row order (kernels.attention.k_page_from_cache undoes the CPU's word-major K)."""
    n_layers, kvh, n_pages, ps, hd = cache["k"].shape
    kv = jnp.stack([cache["k"], cache["v"]], axis=-2)                  # [L,KV,NP,ps,2,hd]
    kv = jnp.transpose(kv, (0, 2, 3, 1, 4, 5))                         # [L,NP,ps,KV,2,hd]
    out = {"kv": kv.reshape(n_layers, n_pages, ps, kvh * 2 * hd)}
    if "k_scale" in cache:
        sc = jnp.stack([cache["k_scale"], cache["v_scale"]], axis=2)  # [L,KV,2,NP,ps]
        out["kv_scale"] = jnp.transpose(sc, (0, 3, 1, 2, 4))
    return out


def to_standard(cache: dict, head_dim: int) -> dict:
    """Inverse of from_standard: {"k", "v": [L, KV, pages, ps, hd]} in row order (and scales)."""
    n_layers, n_pages, ps, width = cache["kv"].shape
    kvh = width // (2 * head_dim)
    kv = cache["kv"].reshape(n_layers, n_pages, ps, kvh, 2, head_dim)
    kv = jnp.transpose(kv, (0, 3, 1, 2, 4, 5))                         # [L,KV,NP,ps,2,hd]
    out = {"k": kv[..., 0, :], "v": kv[..., 1, :]}
    if "kv_scale" in cache:
        sc = jnp.transpose(cache["kv_scale"], (0, 2, 3, 1, 4))        # [L,KV,2,NP,ps]
        out["k_scale"], out["v_scale"] = sc[:, :, 0], sc[:, :, 1]
    return out


def write_kv(kv_cache: dict, layer: jax.Array, k_new: jax.Array, v_new: jax.Array, page: jax.Array,
             offset: jax.Array, quantize) -> dict:
    """Scatter the step's K/V [T, KV, hd] at (page [T], offset [T]); a page past the cache (num_pages)
    writes nothing. The scatter runs on a flat view of the cache's rows, one index per token (the scales:
    one per token, head and K|V): scattered in its own shape, XLA gave the cache a layout of its own and
    copied all of it to the kernel's row-major one in every layer; the flat view is written in place."""
    out = dict(kv_cache)
    buf = kv_cache["kv"]
    t_len, kvh, _ = k_new.shape
    num_pages, ps, width = buf.shape[1:]
    lp = layer * num_pages + page                                                      # [T]
    gone = page >= num_pages
    if "kv_scale" in kv_cache:   # scales: [L, pages, KV, 2, ps]
        (k_new, ks), (v_new, vs) = quantize(k_new), quantize(v_new)
        sc = kv_cache["kv_scale"]
        at = ((lp[:, None, None] * kvh + jnp.arange(kvh)[None, :, None]) * 2
              + jnp.arange(2)[None, None, :]) * ps + offset[:, None, None]             # [T, KV, 2]
        at = jnp.where(gone[:, None, None], sc.size, at).reshape(-1)
        out["kv_scale"] = sc.reshape(-1).at[at].set(jnp.stack([ks, vs], axis=2).reshape(-1),
                                                    mode="drop").reshape(sc.shape)
    new = jnp.stack([k_new, v_new], axis=2).reshape(t_len, width)                     # [T, KV*2*hd]
    rows = jnp.where(gone, buf.size // width, lp * ps + offset)
    flat = buf.reshape(-1, width).at[rows].set(new.astype(buf.dtype), mode="drop")
    out["kv"] = flat.reshape(buf.shape)
    return out
