"""The TPU KV page layout: K and V of all KV heads of one page merged, so one DMA moves a whole page.

  kv       [L, num_pages, KV, 2, page_size, hd]   (index 0 of the "2" axis is K, 1 is V; f32, bf16 or int8)
  kv_scale [L, num_pages, KV, 2, page_size]       f32, int8 caches only (per token and head)

A page (all heads, K and V) is one contiguous block of KV * 2 * page_size * hd elements; a head's K or V
inside it is a [page_size, hd] tile, keys in sublanes, so the kernel's score and value matmuls read it as
it lies. The "kv" key marks the layout (the CPU layout has "k" and "v").
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

# 128-token pages: a bf16 page of 8 KV heads x hd 128 is a 512 KiB DMA (sglang-jax found 128 necessary).
PAGE_SIZE = 128


def is_merged(kv_cache: dict) -> bool:
    """Whether the cache has this layout (else kernels.attention's CPU layout)."""
    return "kv" in kv_cache


def shapes(num_layers: int, num_kv_heads: int, num_pages: int, page_size: int, head_dim: int,
           dtype) -> dict[str, jax.ShapeDtypeStruct]:
    """The cache's arrays: name -> shape and dtype."""
    kv = (num_layers, num_pages, num_kv_heads, 2, page_size, head_dim)
    out = {"kv": jax.ShapeDtypeStruct(kv, jnp.dtype(dtype))}
    if jnp.dtype(dtype) == jnp.int8:
        out["kv_scale"] = jax.ShapeDtypeStruct(kv[:5], jnp.float32)
    return out


def from_standard(cache: dict) -> dict:
    """A CPU-layout cache ({"k", "v": [L, KV, pages, ps, hd]} in row order, optional scales) -> this layout.
    K must be in row order (kernels.attention.k_page_from_cache undoes the CPU's word-major K)."""
    kv = jnp.stack([cache["k"], cache["v"]], axis=2)                  # [L,KV,2,NP,ps,hd]
    out = {"kv": jnp.transpose(kv, (0, 3, 1, 2, 4, 5))}               # [L,NP,KV,2,ps,hd]
    if "k_scale" in cache:
        sc = jnp.stack([cache["k_scale"], cache["v_scale"]], axis=2)  # [L,KV,2,NP,ps]
        out["kv_scale"] = jnp.transpose(sc, (0, 3, 1, 2, 4))
    return out


def to_standard(cache: dict) -> dict:
    """Inverse of from_standard: {"k", "v": [L, KV, pages, ps, hd]} in row order (and scales)."""
    kv = jnp.transpose(cache["kv"], (0, 2, 3, 1, 4, 5))               # [L,KV,2,NP,ps,hd]
    out = {"k": kv[:, :, 0], "v": kv[:, :, 1]}
    if "kv_scale" in cache:
        sc = jnp.transpose(cache["kv_scale"], (0, 2, 3, 1, 4))        # [L,KV,2,NP,ps]
        out["k_scale"], out["v_scale"] = sc[:, :, 0], sc[:, :, 1]
    return out


def write_kv(kv_cache: dict, layer: jax.Array, k_new: jax.Array, v_new: jax.Array, page: jax.Array,
             offset: jax.Array, quantize) -> dict:
    """Scatter the step's K/V [T, KV, hd] at (page [T], offset [T]); a page past the cache (num_pages)
    writes nothing. The scatter runs on a flat view, one row of hd per (token, head, K or V): scattered
    in its 6-d shape, XLA gives the cache a layout of its own choosing and copies all of it to the
    Pallas kernel's row-major layout in every layer; the flat view is the same bytes, written in place."""
    out = dict(kv_cache)
    buf = kv_cache["kv"]
    _, num_pages, kvh, _, ps, hd = buf.shape
    t = k_new.shape[0]
    # [T, KV, 2]: the row of each (token, head, K|V) in the flat [L * pages * KV * 2 * ps] rows
    slot = ((layer * num_pages + page)[:, None, None] * kvh + jnp.arange(kvh)[None, :, None]) * 2 \
        + jnp.arange(2)[None, None, :]
    rows = slot * ps + offset[:, None, None]
    rows = jnp.where((page < num_pages)[:, None, None], rows, buf.size // hd).reshape(t * kvh * 2)
    if "kv_scale" in kv_cache:
        (kq, ks), (vq, vs) = quantize(k_new), quantize(v_new)
        new, scales = jnp.stack([kq, vq], axis=2), jnp.stack([ks, vs], axis=2)   # [T,KV,2,hd], [T,KV,2]
        sc = kv_cache["kv_scale"]
        out["kv_scale"] = sc.reshape(-1).at[rows].set(scales.reshape(-1), mode="drop").reshape(sc.shape)
    else:
        new = jnp.stack([k_new, v_new], axis=2).astype(buf.dtype)                  # [T,KV,2,hd]
    flat = buf.reshape(-1, hd).at[rows].set(new.reshape(t * kvh * 2, hd), mode="drop")
    out["kv"] = flat.reshape(buf.shape)
    return out
