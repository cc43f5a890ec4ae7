"""The TPU KV page layout: K and V of all KV heads of one page merged, so one DMA moves a whole page.

  kv       [L, num_pages, KV, 2, page_size, hd]   hd >= 128 ("split": index 0 of the "2" axis is K, 1 is V)
  kv       [L, num_pages, KV, page_size, 2 * hd]  hd <= 64  ("lanes": a token's K in lanes [0, hd), V in [hd, 2hd))
  kv_scale [L, num_pages, KV, 2, page_size]       f32, int8 caches only (per token and head)

A page (all heads, K and V) is one contiguous block; a head's keys lie in sublanes, so the kernel's score
and value matmuls read them as they lie. TPU memory tiles pad the minor dimension to 128 lanes: a
[page_size, 64] tile would take twice its bytes, and XLA then picks another layout for the cache and
copies all of it to the kernel's in every layer; so heads of 64 put K and V side by side in the lanes.
The "kv" key marks the layout (the CPU layout has "k" and "v").
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

# 128-token pages: a bf16 page of 8 KV heads x hd 128 is a 512 KiB DMA (sglang-jax found 128 necessary).
PAGE_SIZE = 128


def is_merged(kv_cache: dict) -> bool:
    """Whether the cache has this layout (else kernels.attention's CPU layout)."""
    return "kv" in kv_cache


def lanes_form(head_dim: int) -> bool:
    """Whether K and V of a head share one 128-lane row (heads of 64 or less)."""
    return 2 * head_dim <= 128


def is_lanes(kv_cache: dict) -> bool:
    return kv_cache["kv"].ndim == 5


def shapes(num_layers: int, num_kv_heads: int, num_pages: int, page_size: int, head_dim: int,
           dtype) -> dict[str, jax.ShapeDtypeStruct]:
    """The cache's arrays: name -> shape and dtype."""
    if lanes_form(head_dim):
        kv = (num_layers, num_pages, num_kv_heads, page_size, 2 * head_dim)
    else:
        kv = (num_layers, num_pages, num_kv_heads, 2, page_size, head_dim)
    out = {"kv": jax.ShapeDtypeStruct(kv, jnp.dtype(dtype))}
    if jnp.dtype(dtype) == jnp.int8:
        out["kv_scale"] = jax.ShapeDtypeStruct((num_layers, num_pages, num_kv_heads, 2, page_size), jnp.float32)
    return out


def from_standard(cache: dict) -> dict:
    """A CPU-layout cache ({"k", "v": [L, KV, pages, ps, hd]} in row order, optional scales) -> this layout.
    K must be in row order (kernels.attention.k_page_from_cache undoes the CPU's word-major K)."""
    if lanes_form(cache["k"].shape[-1]):
        kv = jnp.concatenate([cache["k"], cache["v"]], axis=-1)        # [L,KV,NP,ps,2hd]
        out = {"kv": jnp.transpose(kv, (0, 2, 1, 3, 4))}               # [L,NP,KV,ps,2hd]
    else:
        kv = jnp.stack([cache["k"], cache["v"]], axis=2)              # [L,KV,2,NP,ps,hd]
        out = {"kv": jnp.transpose(kv, (0, 3, 1, 2, 4, 5))}           # [L,NP,KV,2,ps,hd]
    if "k_scale" in cache:
        sc = jnp.stack([cache["k_scale"], cache["v_scale"]], axis=2)  # [L,KV,2,NP,ps]
        out["kv_scale"] = jnp.transpose(sc, (0, 3, 1, 2, 4))
    return out


def to_standard(cache: dict) -> dict:
    """Inverse of from_standard: {"k", "v": [L, KV, pages, ps, hd]} in row order (and scales)."""
    if is_lanes(cache):
        kv = jnp.transpose(cache["kv"], (0, 2, 1, 3, 4))              # [L,KV,NP,ps,2hd]
        hd = kv.shape[-1] // 2
        out = {"k": kv[..., :hd], "v": kv[..., hd:]}
    else:
        kv = jnp.transpose(cache["kv"], (0, 2, 3, 1, 4, 5))           # [L,KV,2,NP,ps,hd]
        out = {"k": kv[:, :, 0], "v": kv[:, :, 1]}
    if "kv_scale" in cache:
        sc = jnp.transpose(cache["kv_scale"], (0, 2, 3, 1, 4))        # [L,KV,2,NP,ps]
        out["k_scale"], out["v_scale"] = sc[:, :, 0], sc[:, :, 1]
    return out


def _rows(layer, page, offset, num_pages: int, kvh: int, ps: int, split: bool, past: int) -> jax.Array:
    """The flat row of each (token, head[, K|V]) at (layer, page [T], offset [T]): [T*KV(*2)]; a page past
    the cache gets `past` (out of bounds: the scatter drops it)."""
    slot = (layer * num_pages + page)[:, None] * kvh + jnp.arange(kvh)[None, :]          # [T,KV]
    if split:
        slot = slot[:, :, None] * 2 + jnp.arange(2)[None, None, :]                      # [T,KV,2]
    shape = (page.shape[0],) + (1,) * (slot.ndim - 1)
    rows = slot * ps + offset.reshape(shape)
    return jnp.where((page >= num_pages).reshape(shape), past, rows).reshape(-1)


def write_kv(kv_cache: dict, layer: jax.Array, k_new: jax.Array, v_new: jax.Array, page: jax.Array,
             offset: jax.Array, quantize) -> dict:
    """Scatter the step's K/V [T, KV, hd] at (page [T], offset [T]); a page past the cache (num_pages)
    writes nothing. The scatter runs on a flat view of the cache's rows (one per token, head and, in
    the split form, K or V): scattered in its 6-d shape, XLA gave the cache a layout of its own and
    copied all of it to the kernel's row-major one in every layer; the flat view is written in place."""
    out = dict(kv_cache)
    buf = kv_cache["kv"]
    lanes = is_lanes(kv_cache)
    num_pages, kvh, width = buf.shape[1], buf.shape[2], buf.shape[-1]
    ps = buf.shape[3] if lanes else buf.shape[4]
    if "kv_scale" in kv_cache:   # scales: [L, pages, KV, 2, ps] in both forms
        (k_new, ks), (v_new, vs) = quantize(k_new), quantize(v_new)
        sc = kv_cache["kv_scale"]
        at = _rows(layer, page, offset, num_pages, kvh, ps, True, sc.size)
        out["kv_scale"] = sc.reshape(-1).at[at].set(jnp.stack([ks, vs], axis=2).reshape(-1),
                                                    mode="drop").reshape(sc.shape)
    # lanes: row (layer, page, head, offset) holds [K | V]; split: row (layer, page, head, K|V, offset)
    new = jnp.concatenate([k_new, v_new], axis=-1) if lanes else jnp.stack([k_new, v_new], axis=2)
    rows = _rows(layer, page, offset, num_pages, kvh, ps, not lanes, buf.size // width)
    flat = buf.reshape(-1, width).at[rows].set(new.reshape(-1, width).astype(buf.dtype), mode="drop")
    out["kv"] = flat.reshape(buf.shape)
    return out
