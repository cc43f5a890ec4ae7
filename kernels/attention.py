"""Ragged paged attention: the one attention op of a step (decodes and prefill chunks of many sequences).

Interface after tpu-inference's ragged paged attention: the step's new K/V are written into the pages,
then every query token attends over its own sequence's keys up to its position. The cache's layout is
the backend's (kv_layout): on TPU the merged layout of kernels/tpu/layout.py, read by our Pallas kernel
(kernels/tpu); elsewhere the layout below, read on CPU by a native kernel
(kernels/cpu/csrc/ragged_paged_attention.cc) when it is built. The pure-JAX reference below is the test
oracle and runs elsewhere (GPU).

Shapes (T flat tokens, S sequence rows, P pages per row, L layers, KV heads, H = KV * G query heads;
the standard layout's cache):
  q [T, H, hd]; k_new, v_new [T, KV, hd]
  kv_cache {"k", "v": [L, KV, num_pages, page_size, hd]} (f32, bf16 or int8), and for int8
           {"k_scale", "v_scale": [L, KV, num_pages, page_size]} f32 (per token and head)
  layer int32 scalar; kv_lens [S]: each sequence's KV length after the step;
  page_indices [S, P]; cu_q_lens [S + 1]: sequence s's tokens are q[cu_q_lens[s]:cu_q_lens[s + 1]];
  num_seqs: int32 [1] (or scalar): rows past it are padding; so are tokens from cu_q_lens[num_seqs].
  Token t of sequence s sits at position kv_lens[s] - (cu_q_lens[s + 1] - t).
Padding tokens write nothing and get zeros. Page 0 is a dummy page for padded page-table entries.

Layout inside a page (the kernel's choice): V holds a page's rows in order, [page_size, hd]. K in f32, in
bf16 with an even hd, and in int8 with hd % 4 == 0, holds them as 4-byte words, word-major: the page's
bytes are [hd * itemsize / 4, page_size, 4], so word w of consecutive keys lies together (int8: columns
4w..4w+3, as the native kernel's vpdpbusd scores read them; f32: column w, one vector of 16 keys for
broadcast FMAs, with no horizontal sums; bf16: columns 2w, 2w+1, widened in registers for the same FMAs),
read as it lies, with no transpose. k_page_from_cache / k_page_to_cache convert
a page between the two; the array shapes do not change.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from slipstream.kernels import native
from slipstream.kernels.ragged_tokens import quantize_kv, token_layout  # noqa: F401 (part of this seam)

KVCache = dict[str, jax.Array]

# Keys per block of the reference's online softmax (a multiple of the page size is used).
_BLOCK_KEYS = 128


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """The KV cache's layout on one backend: its arrays and default page size. The engine's allocator,
    prefix cache and scheduler see page ids and the page size only."""

    name: str             # "standard" ([L, KV, pages, page_size, hd] "k"/"v") or "merged" (kernels/tpu/layout.py)
    page_size: int        # the default page size (--page-size overrides it)

    def shapes(self, num_layers: int, num_kv_heads: int, num_pages: int, page_size: int, head_dim: int,
               dtype) -> dict[str, jax.ShapeDtypeStruct]:
        """name -> shape and dtype of the cache's arrays."""
        if self.name == "merged":
            from slipstream.kernels.tpu import layout

            return layout.shapes(num_layers, num_kv_heads, num_pages, page_size, head_dim, dtype)
        shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
        out = {"k": jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)), "v": jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))}
        if jnp.dtype(dtype) == jnp.int8:
            out["k_scale"] = out["v_scale"] = jax.ShapeDtypeStruct(shape[:4], jnp.float32)
        return out

    def init(self, num_layers: int, num_kv_heads: int, num_pages: int, page_size: int, head_dim: int,
             dtype) -> KVCache:
        """The zeroed cache."""
        specs = self.shapes(num_layers, num_kv_heads, num_pages, page_size, head_dim, dtype)
        return {name: jnp.zeros(s.shape, s.dtype) for name, s in specs.items()}


def kv_layout(platform: str) -> KVLayout:
    """The KV layout the attention kernel of `platform` ("cpu", "tpu", "gpu", ...) reads: on TPU K and V of
    all heads merged per page, 128-token pages (the Pallas kernel's DMAs); elsewhere the standard layout
    with 16-token pages (the native CPU kernel, the reference)."""
    if platform == "tpu":
        return KVLayout("merged", page_size=128)
    return KVLayout("standard", page_size=16)


def ragged_paged_attention(q: jax.Array, k_new: jax.Array, v_new: jax.Array, kv_cache: KVCache,
                           layer: jax.Array, kv_lens: jax.Array, page_indices: jax.Array,
                           cu_q_lens: jax.Array, num_seqs: jax.Array, *, sm_scale: float,
                           sliding_window: int | None = None, soft_cap: float | None = None
                           ) -> tuple[jax.Array, KVCache]:
    """Write the new tokens' K/V into their pages, then attend; returns (out [T, H, hd], kv_cache).
    soft_cap: Gemma-style cap * tanh(score / cap) on the scaled scores, before masking. The cache's
    layout picks the kernel: merged (TPU): the Pallas kernel on TPU; standard: the native kernel on
    CPU; the pure-JAX reference elsewhere."""
    args = (q, k_new, v_new, kv_cache, layer, kv_lens, page_indices, cu_q_lens, num_seqs)
    kwargs = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if "kv" in kv_cache:
        if not native.use_pallas("ragged_paged_attention"):
            return ragged_paged_attention_reference(*args, **kwargs)
        from slipstream.kernels.tpu import ragged_paged_attention as tpu_rpa

        return jax.lax.platform_dependent(
            *args, tpu=lambda *a: tpu_rpa.ragged_paged_attention(*a, **kwargs),
            default=lambda *a: ragged_paged_attention_reference(*a, **kwargs))
    if soft_cap is not None:  # the native kernel has no soft-cap
        native.note_reference("ragged_paged_attention (soft_cap)", "the native CPU kernel has no logit soft-cap")
        return ragged_paged_attention_reference(*args, **kwargs)
    if not native.load("ragged_paged_attention", "ragged_paged_attention"):
        return ragged_paged_attention_reference(*args, **kwargs)
    from slipstream.kernels import attention_native

    return jax.lax.platform_dependent(
        *args, cpu=lambda *a: attention_native.ragged_paged_attention_cpu(
            *a, sm_scale=sm_scale, sliding_window=sliding_window),
        default=lambda *a: ragged_paged_attention_reference(*a, **kwargs))


def write_kv(kv_cache: KVCache, layer: jax.Array, k_new: jax.Array, v_new: jax.Array,
             slots: jax.Array) -> KVCache:
    """Scatter the new tokens' K/V [T, KV, hd] of one layer at flat slots [T] (page * page_size + offset;
    out of range, e.g. -1, writes nothing); int8 caches store the quantized values and their scales."""
    _, kvh, num_pages, page_size = kv_cache["k"].shape[:4]

    def put(buf: jax.Array, new: jax.Array) -> jax.Array:
        flat = buf.reshape(buf.shape[0], kvh, num_pages * page_size, *buf.shape[4:])
        # advanced indices split by a slice: the indexed view is [T, KV, ...], like `new`
        return flat.at[layer, :, slots].set(new.astype(buf.dtype), mode="drop").reshape(buf.shape)

    def put_words_major(buf: jax.Array, new: jax.Array) -> jax.Array:
        hd, e = buf.shape[-1], _word_elems(buf.dtype)
        view = buf.reshape(*buf.shape[:3], hd // e, page_size, e)      # [L, KV, pages, hd/e, ps, e]
        page = jnp.where(slots < 0, num_pages, slots // page_size)      # out of range: dropped
        # advanced indices split by slices: the indexed view is [T, KV, hd/e, e]
        new = new.astype(buf.dtype).reshape(*new.shape[:2], hd // e, e)
        return view.at[layer, :, page, :, slots % page_size].set(new, mode="drop").reshape(buf.shape)

    out = dict(kv_cache)
    if "k_scale" in kv_cache:
        (kq, ks), (vq, vs) = quantize_kv(k_new), quantize_kv(v_new)
        out["k"] = (put_words_major if k_words_major(kv_cache) else put)(kv_cache["k"], kq)
        out["v"] = put(kv_cache["v"], vq)
        out["k_scale"], out["v_scale"] = put(kv_cache["k_scale"], ks), put(kv_cache["v_scale"], vs)
    else:
        k_put = put_words_major if k_words_major(kv_cache) else put
        out["k"], out["v"] = k_put(kv_cache["k"], k_new), put(kv_cache["v"], v_new)
    return out


def _word_elems(dtype) -> int:
    """Elements of `dtype` in a 4-byte word of a word-major K page."""
    return 4 // jnp.dtype(dtype).itemsize


def k_pages_word_major(dtype, head_dim: int) -> bool:
    """Whether K pages of this cache dtype and head_dim are stored word-major (see the module doc)."""
    dtype = jnp.dtype(dtype)
    return (dtype == jnp.float32 or (dtype == jnp.bfloat16 and head_dim % 2 == 0)
            or (dtype == jnp.int8 and head_dim % 4 == 0))


def k_words_major(kv_cache: KVCache) -> bool:
    """Whether the cache's K pages are stored word-major (f32 K, bf16 K with an even head_dim, or int8 K
    with head_dim % 4 == 0)."""
    return k_pages_word_major(kv_cache["k"].dtype, kv_cache["k"].shape[-1])


def k_page_to_cache(k):
    """f32, bf16 or int8 K pages [..., page_size, hd] in row order -> as the cache stores them (word-major,
    same shape). Works on numpy and JAX arrays."""
    *lead, ps, hd = k.shape
    e = _word_elems(k.dtype)
    return k.reshape(*lead, ps, hd // e, e).swapaxes(-3, -2).reshape(*lead, ps, hd)


def k_page_from_cache(k):
    """Inverse of k_page_to_cache: stored f32, bf16 or int8 K pages [..., page_size, hd] -> rows in order."""
    *lead, ps, hd = k.shape
    e = _word_elems(k.dtype)
    return k.reshape(*lead, hd // e, ps, e).swapaxes(-3, -2).reshape(*lead, ps, hd)


def ragged_paged_attention_reference(q, k_new, v_new, kv_cache, layer, kv_lens, page_indices, cu_q_lens,
                                     num_seqs, *, sm_scale: float, sliding_window: int | None = None,
                                     soft_cap: float | None = None):
    """Pure JAX: each token gathers its own sequence's pages, a block of keys at a time, into an
    online softmax; the loop runs up to the longest position in the batch only. A merged (TPU) cache
    is converted to the standard layout and back (a test oracle there, never the TPU's path)."""
    if "kv" in kv_cache:
        from slipstream.kernels.tpu import layout

        std = layout.to_standard(kv_cache, k_new.shape[-1])
        if k_words_major(std):
            std["k"] = k_page_to_cache(std["k"])
        out, std = ragged_paged_attention_reference(q, k_new, v_new, std, layer, kv_lens, page_indices, cu_q_lens,
                                                    num_seqs, sm_scale=sm_scale, sliding_window=sliding_window,
                                                    soft_cap=soft_cap)
        if k_words_major(std):
            std["k"] = k_page_from_cache(std["k"])
        return out, layout.from_standard(std)
    t_len, h, hd = q.shape
    _, kvh, num_pages, page_size = kv_cache["k"].shape[:4]
    g = h // kvh
    seq, pos, valid = token_layout(kv_lens, cu_q_lens, num_seqs, t_len)
    page = jnp.take_along_axis(page_indices[seq], (pos // page_size)[:, None], axis=1)[:, 0]
    slots = jnp.where(valid, page * page_size + pos % page_size, num_pages * page_size)  # padding: dropped
    kv_cache = write_kv(kv_cache, layer, k_new, v_new, slots)

    pages_per_block = max(1, _BLOCK_KEYS // page_size)
    block_keys = pages_per_block * page_size
    n_pages = page_indices.shape[1]
    padded = -(-n_pages // pages_per_block) * pages_per_block
    tables = jnp.pad(page_indices, ((0, 0), (0, padded - n_pages)))[seq]     # [T, P'] page 0 past the end
    n_blocks = (jnp.max(jnp.where(valid, pos, 0)) + block_keys) // block_keys
    int8 = "k_scale" in kv_cache
    k_tiled = k_words_major(kv_cache)
    qg = q.astype(jnp.float32).reshape(t_len, kvh, g, hd) * sm_scale        # [T,KV,G,hd]

    def gather(name: str, pages: jax.Array) -> jax.Array:
        buf = jax.lax.dynamic_index_in_dim(kv_cache[name], layer, 0, keepdims=False)  # [KV,NP,ps,...]
        blocks = buf[:, pages]                                               # [KV,T,nb,ps,...]
        if name == "k" and k_tiled:
            blocks = k_page_from_cache(blocks)
        blocks = blocks.reshape(kvh, t_len, block_keys, *buf.shape[3:])
        return jnp.swapaxes(blocks, 0, 1)                                    # [T,KV,BK,...]

    def body(i, state):
        acc, m, l = state
        pages = jax.lax.dynamic_slice_in_dim(tables, i * pages_per_block, pages_per_block, 1)
        k = gather("k", pages).astype(jnp.float32)                           # [T,KV,BK,hd]
        v = gather("v", pages).astype(jnp.float32)
        s = jnp.einsum("tkgh,tksh->tkgs", qg, k)                             # [T,KV,G,BK]
        if int8:
            s = s * gather("k_scale", pages)[:, :, None, :]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        k_pos = i * block_keys + jnp.arange(block_keys, dtype=jnp.int32)
        visible = (k_pos[None, :] <= pos[:, None]) & valid[:, None]          # [T,BK]
        if sliding_window is not None:
            visible &= k_pos[None, :] > pos[:, None] - sliding_window
        s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])                                   # 0 where not visible
        corr = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
        pv = p * gather("v_scale", pages)[:, :, None, :] if int8 else p
        acc = acc * corr[..., None] + jnp.einsum("tkgs,tksh->tkgh", pv, v)
        return acc, m_new, l * corr + jnp.sum(p, axis=-1)

    init = (jnp.zeros((t_len, kvh, g, hd), jnp.float32), jnp.full((t_len, kvh, g), -jnp.inf, jnp.float32),
            jnp.zeros((t_len, kvh, g), jnp.float32))
    acc, _, l = jax.lax.fori_loop(0, n_blocks, body, init)
    out = jnp.where(valid[:, None, None, None], acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return out.reshape(t_len, h, hd).astype(q.dtype), kv_cache
