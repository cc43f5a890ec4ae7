"""The TPU KV page layouts: K and V of all KV heads of one page merged, so one DMA moves a whole page.

  16/32-bit K/V, "tokens": kv [L, num_pages, page_size, KV * 2 * hd]  row (layer, page, offset):
                                 [K_0 | V_0 | K_1 | V_1 | ...]; an even count of heads of 64 pairs them
                                 (pairs_heads): [K_0 | K_1 | V_0 | V_1 | K_2 | K_3 | ...]
  int8 K/V, hd >= 128, "split": kv [L, num_pages, KV, 2, page_size, hd]   index 0 of the "2" axis is K, 1 is V
  int8 K/V, hd <= 64, "lanes":  kv [L, num_pages, KV, page_size, 2 * hd]  a token's K in lanes [0, hd), V in [hd, 2hd)
  int8 scales:             kv_scale [L, num_pages, KV, 2, page_size]      f32 (per token and head)

A page (all heads, K and V) is one contiguous block; a head's keys lie in sublanes, so the kernel's score
and value matmuls read them as they lie (in "tokens", head h's [K | V] are lanes [h * 2hd, (h + 1) * 2hd)).
The step's K/V write is a Pallas kernel (int8: kv_write.py, INT8_WRITE; float "tokens": kv_write_float.py,
FLOAT_WRITE) or an XLA scatter into a flat view of the rows; on the v5e the scatter costs 70-95 ns per index
whatever the row's width: one index per token in "tokens" (a 512-token chunk of 8B heads: 97 us per layer),
one per token, head and K|V in "split" (562 us). int8 stays in the per-head forms: scattering
int8 rows wider than 128 lanes, XLA (jax 0.10) copies the whole cache into its packed (32, 128) tiling in
every layer (tests/kernels/tpu_kv_write_probe: "rows8" and "rows1" at int8). TPU memory tiles pad the minor
dimension to 128 lanes: a [page_size, 64] tile would take twice its bytes and XLA then picks another layout
and copies, so int8 heads of 64 put K and V side by side ("lanes"). The "kv" key marks these layouts (the
CPU layout has "k" and "v").
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

# 128-token pages: a bf16 page of 8 KV heads x hd 128 is a 512 KiB DMA (sglang-jax found 128 necessary).
PAGE_SIZE = 128


def is_merged(kv_cache: dict) -> bool:
    """Whether the cache has one of these layouts (else kernels.attention's CPU layout)."""
    return "kv" in kv_cache


def pads_q(head_dim: int) -> bool:
    """Whether a head's K and V share one 128-lane slice (heads of 64 or less): the kernel then pads q with
    zeros to the slice's width and keeps the V lanes of its output, where wider heads slice K and V apart."""
    return 2 * head_dim <= 128


PAGE_AXIS = {"tokens": 2, "lanes": 3, "split": 4}   # the page_size axis of each form's kv array

# How write_kv writes the step's K/V: "kernel" (a Pallas kernel moving whole memory tiles by DMA) or "scatter"
# (XLA). The int8 forms (INT8_WRITE): kv_write.py, for pages of a multiple of 32 tokens (smaller pages, as in the
# CPU tests' 16, keep the scatter; it takes 2 * KV row and scale indices per token); on the v5e, Llama-3.1-8B int8
# (benchmarks/results.d/tpu-v5e.md), the kernel writes a 64-slot decode step's K/V in 1.0 ms against the
# scatter's 5.4, a 2048-token chunk's in < 0.7 ms against 91. The float "tokens" form (FLOAT_WRITE):
# kv_write_float.py, for pages of whole (16, 128) bf16 / (8, 128) f32 tiles and rows of whole 128 lanes (one
# scatter index per token: 2.0 ms of a Llama-3.2-1B 1024-token prefill step on the v5e).
WRITES = ("scatter", "kernel")
INT8_WRITE = "kernel"
FLOAT_WRITE = "kernel"


def pairs_heads(head_dim: int, num_kv_heads: int) -> bool:
    """Whether a "tokens" row pairs heads of 64: [K_0 | K_1 | V_0 | V_1 | K_2 | ...], so that a pair's K
    and its V are each one 128-lane slice, read by the kernel as one head of 128 (its query rows twice as
    many: a KV head's q in the lanes of its K). An odd count of heads of 64 keeps [K_0 | V_0 | K_1 | ...]."""
    return 2 * head_dim == 128 and num_kv_heads % 2 == 0


def _paired(x: jax.Array, axis: int) -> jax.Array:
    """Heads of 64 on `axis` (the head dim last) -> pairs [.., heads / 2, .., 128]: [x_2j | x_2j+1]."""
    x = jnp.moveaxis(x, axis, -2)
    x = x.reshape(*x.shape[:-2], x.shape[-2] // 2, 2 * x.shape[-1])
    return jnp.moveaxis(x, -2, axis)


def _unpaired(x: jax.Array, axis: int) -> jax.Array:
    x = jnp.moveaxis(x, axis, -2)
    x = x.reshape(*x.shape[:-2], x.shape[-2] * 2, x.shape[-1] // 2)
    return jnp.moveaxis(x, -2, axis)


def form(kv_cache: dict) -> str:
    """"tokens", "split" or "lanes" (see the module's docstring)."""
    return {4: "tokens", 5: "lanes", 6: "split"}[kv_cache["kv"].ndim]


def shapes(num_layers: int, num_kv_heads: int, num_pages: int, page_size: int, head_dim: int,
           dtype) -> dict[str, jax.ShapeDtypeStruct]:
    """The cache's arrays: name -> shape and dtype."""
    if jnp.dtype(dtype) != jnp.int8:
        kv = (num_layers, num_pages, page_size, num_kv_heads * 2 * head_dim)
    elif pads_q(head_dim):
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
    n_layers, kvh, n_pages, ps, hd = cache["k"].shape
    if cache["k"].dtype != jnp.int8:
        k, v = cache["k"], cache["v"]
        if pairs_heads(hd, kvh):
            k, v = _paired(k, 1), _paired(v, 1)                        # [L,KV/2,NP,ps,128]
        kv = jnp.stack([k, v], axis=-2)                                # [L,KV',NP,ps,2,hd']
        kv = jnp.transpose(kv, (0, 2, 3, 1, 4, 5))                     # [L,NP,ps,KV',2,hd']
        out = {"kv": kv.reshape(n_layers, n_pages, ps, kvh * 2 * hd)}
    elif pads_q(hd):
        kv = jnp.concatenate([cache["k"], cache["v"]], axis=-1)        # [L,KV,NP,ps,2hd]
        out = {"kv": jnp.transpose(kv, (0, 2, 1, 3, 4))}               # [L,NP,KV,ps,2hd]
    else:
        kv = jnp.stack([cache["k"], cache["v"]], axis=2)              # [L,KV,2,NP,ps,hd]
        out = {"kv": jnp.transpose(kv, (0, 3, 1, 2, 4, 5))}           # [L,NP,KV,2,ps,hd]
    if "k_scale" in cache:
        sc = jnp.stack([cache["k_scale"], cache["v_scale"]], axis=2)  # [L,KV,2,NP,ps]
        out["kv_scale"] = jnp.transpose(sc, (0, 3, 1, 2, 4))
    return out


def to_standard(cache: dict, head_dim: int) -> dict:
    """Inverse of from_standard: {"k", "v": [L, KV, pages, ps, hd]} in row order (and scales)."""
    kind = form(cache)
    if kind == "tokens":
        n_layers, n_pages, ps, width = cache["kv"].shape
        kvh = width // (2 * head_dim)
        hd = 2 * head_dim if pairs_heads(head_dim, kvh) else head_dim
        kv = cache["kv"].reshape(n_layers, n_pages, ps, width // (2 * hd), 2, hd)
        kv = jnp.transpose(kv, (0, 3, 1, 2, 4, 5))                     # [L,KV',NP,ps,2,hd']
        out = {"k": kv[..., 0, :], "v": kv[..., 1, :]}
        if hd != head_dim:
            out = {name: _unpaired(x, 1) for name, x in out.items()}
    elif kind == "lanes":
        kv = jnp.transpose(cache["kv"], (0, 2, 1, 3, 4))              # [L,KV,NP,ps,2hd]
        out = {"k": kv[..., :head_dim], "v": kv[..., head_dim:]}
    else:
        kv = jnp.transpose(cache["kv"], (0, 2, 3, 1, 4, 5))           # [L,KV,2,NP,ps,hd]
        out = {"k": kv[:, :, 0], "v": kv[:, :, 1]}
    if "kv_scale" in cache:
        sc = jnp.transpose(cache["kv_scale"], (0, 2, 3, 1, 4))        # [L,KV,2,NP,ps]
        out["k_scale"], out["v_scale"] = sc[:, :, 0], sc[:, :, 1]
    return out


def _head_rows(lp, offset, kvh: int, ps: int, split: bool) -> jax.Array:
    """The flat row of each (token, head[, K|V]) of a per-head form: [T, KV(, 2)]; lp = layer * pages + page."""
    slot = lp[:, None] * kvh + jnp.arange(kvh)[None, :]                                # [T,KV]
    if split:
        slot = slot[:, :, None] * 2 + jnp.arange(2)[None, None, :]                      # [T,KV,2]
    return slot * ps + offset.reshape((-1,) + (1,) * (slot.ndim - 1))


def write_kv(kv_cache: dict, layer: jax.Array, k_new: jax.Array, v_new: jax.Array, page: jax.Array,
             offset: jax.Array, quantize, *, int8_write: str | None = None, float_write: str | None = None,
             max_items: int | None = None, interpret: bool = False) -> dict:
    """Scatter the step's K/V [T, KV, hd] at (page [T], offset [T]); a page past the cache (num_pages)
    writes nothing. The scatter runs on a flat view of the cache's rows (one per token in "tokens"; per
    token and head in "lanes"; per token, head and K|V in "split" and the scales): scattered in its own
    shape, XLA gave the cache a layout of its own and copied all of it to the kernel's row-major one in
    every layer; the flat view is written in place.
    int8_write / float_write: how the int8 forms / the float "tokens" form are written, one of WRITES (default
    INT8_WRITE / FLOAT_WRITE); a "kernel" also takes max_items (a bound on the step's runs of tokens per page,
    kv_write.work_items) and interpret (Pallas' TPU interpreter). Off the TPU, outside the interpreter, and for
    caches a kernel does not tile, the scatter writes."""
    out = dict(kv_cache)
    buf = kv_cache["kv"]
    kind = form(kv_cache)
    chosen = {"int8_write": INT8_WRITE if int8_write is None else int8_write,
              "float_write": FLOAT_WRITE if float_write is None else float_write}
    for name, how in chosen.items():
        if how not in WRITES:
            raise ValueError(f"{name} must be one of {WRITES}, got {how!r}")
    # the kernels are Mosaic TPU code: elsewhere only Pallas' interpreter runs them
    kernel = chosen["float_write" if kind == "tokens" else "int8_write"] == "kernel" and (
        interpret or jax.default_backend() == "tpu")
    if kernel:   # Pallas: imported where used (the CPU engine imports this file)
        from slipstream.kernels.tpu import kv_write, kv_write_float
    if kernel and kind != "tokens" and buf.shape[PAGE_AXIS[kind]] % kv_write.TILE == 0:
        return kv_write.write(kv_cache, layer, k_new, v_new, page, offset, quantize, max_items=max_items,
                              interpret=interpret)
    t_len, kvh, _ = k_new.shape
    num_pages, width = buf.shape[1], buf.shape[-1]
    ps = buf.shape[PAGE_AXIS[kind]]
    lp = layer * num_pages + page                                                      # [T]
    gone = page >= num_pages
    if "kv_scale" in kv_cache:   # scales: [L, pages, KV, 2, ps]
        (k_new, ks), (v_new, vs) = quantize(k_new), quantize(v_new)
        sc = kv_cache["kv_scale"]
        at = jnp.where(gone[:, None, None], sc.size, _head_rows(lp, offset, kvh, ps, True)).reshape(-1)
        out["kv_scale"] = sc.reshape(-1).at[at].set(jnp.stack([ks, vs], axis=2).reshape(-1),
                                                    mode="drop").reshape(sc.shape)
    if kind == "tokens":
        if pairs_heads(k_new.shape[-1], kvh):
            k_new, v_new = _paired(k_new, 1), _paired(v_new, 1)                        # [T, KV/2, 128]
        new = jnp.stack([k_new, v_new], axis=2)                                        # [T, KV', 2, hd']
        if kernel and kv_write_float.supports(buf):
            out["kv"] = kv_write_float.write(buf, layer, new.reshape(t_len, width).astype(buf.dtype), page, offset,
                                             max_items=max_items, interpret=interpret)
            return out
        rows = lp * ps + offset
    else:   # lanes: row (layer, page, head, offset) holds [K | V]; split: row (layer, page, head, K|V, offset)
        new = jnp.concatenate([k_new, v_new], axis=-1) if kind == "lanes" else jnp.stack([k_new, v_new], axis=2)
        rows = _head_rows(lp, offset, kvh, ps, kind == "split")
    past = buf.size // width
    rows = jnp.where(gone.reshape((-1,) + (1,) * (rows.ndim - 1)), past, rows).reshape(-1)
    flat = buf.reshape(-1, width).at[rows].set(new.reshape(-1, width).astype(buf.dtype), mode="drop")
    out["kv"] = flat.reshape(buf.shape)
    return out
