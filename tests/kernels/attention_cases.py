"""Random ragged batches and a loop-per-sequence numpy oracle for ragged paged attention."""
from __future__ import annotations

import dataclasses

import numpy as np

from slipstream.kernels.attention import k_page_from_cache, k_page_to_cache, k_pages_word_major


@dataclasses.dataclass
class Case:
    q: np.ndarray            # [T,H,hd]
    k_new: np.ndarray        # [T,KV,hd]
    v_new: np.ndarray
    cache: dict              # numpy arrays, layout of kernels.attention
    layer: int
    kv_lens: np.ndarray      # [S]
    page_indices: np.ndarray  # [S,P]
    cu_q_lens: np.ndarray    # [S+1]
    num_seqs: np.ndarray     # [1]
    q_lens: list[int]


def make_case(rng: np.random.Generator, *, q_lens: list[int], cached: list[int], kv_heads: int, group: int,
              head_dim: int, page_size: int, layers: int = 2, layer: int = 1, pad_seqs: int = 1,
              pad_tokens: int = 3, int8: bool = False, dtype=np.float32, max_pages: int | None = None,
              consecutive: bool = False) -> Case:
    """Sequence i feeds q_lens[i] new tokens after cached[i] keys already in its pages: scattered, or with
    `consecutive` each sequence's pages one run of consecutive ids (as the engine's allocator places them)."""
    n = len(q_lens)
    kv_lens = np.asarray([c + q for c, q in zip(cached, q_lens)], np.int32)
    need = [-(-int(k) // page_size) for k in kv_lens]
    p = max_pages or max(need + [1])
    total = sum(need) + 1
    pages = np.arange(1, total, dtype=np.int32)                       # page 0 never used
    if not consecutive:
        pages = rng.permutation(pages)
    table = np.zeros((n + pad_seqs, p), np.int32)
    at = 0
    for i, k in enumerate(need):
        table[i, :k] = pages[at:at + k]
        at += k
    t = sum(q_lens) + pad_tokens
    cu = np.zeros(n + pad_seqs + 1, np.int32)
    cu[1:n + 1] = np.cumsum(q_lens)
    cu[n + 1:] = cu[n]
    h = kv_heads * group
    shape = (layers, kv_heads, total, page_size, head_dim)
    if int8:
        cache = {"k": rng.integers(-127, 128, shape).astype(np.int8),
                 "v": rng.integers(-127, 128, shape).astype(np.int8),
                 "k_scale": rng.uniform(0.001, 0.02, shape[:4]).astype(np.float32),
                 "v_scale": rng.uniform(0.001, 0.02, shape[:4]).astype(np.float32)}
    else:
        cache = {"k": rng.standard_normal(shape).astype(dtype), "v": rng.standard_normal(shape).astype(dtype)}
    return Case(q=rng.standard_normal((t, h, head_dim)).astype(np.float32),
                k_new=rng.standard_normal((t, kv_heads, head_dim)).astype(np.float32),
                v_new=rng.standard_normal((t, kv_heads, head_dim)).astype(np.float32),
                cache=cache, layer=layer, kv_lens=np.concatenate([kv_lens, np.zeros(pad_seqs, np.int32)]),
                page_indices=table, cu_q_lens=cu, num_seqs=np.asarray([n], np.int32), q_lens=list(q_lens))


def _quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    scale = np.abs(x).max(-1) * np.float32(1 / 127)   # bit for bit what XLA makes of quantize_kv's "/ 127"
    safe = np.where(scale > 0, scale, 1.0)
    return np.clip(np.round(x / safe[..., None]), -127, 127).astype(np.int8), scale.astype(np.float32)


def oracle(c: Case, *, sm_scale: float, sliding_window: int | None = None,
           soft_cap: float | None = None) -> tuple[np.ndarray, dict]:
    """Per sequence: write its new K/V into its pages, then plain softmax attention per token."""
    cache = {k: v.copy() for k, v in c.cache.items()}
    int8 = "k_scale" in cache
    _, kvh, _, ps, hd = cache["k"].shape
    words_major = k_pages_word_major(cache["k"].dtype, hd)   # K pages as the cache stores them (kernels.attention's doc)
    if words_major:
        cache["k"] = np.ascontiguousarray(k_page_from_cache(cache["k"]))
    t_len, h, _ = c.q.shape
    g = h // kvh
    out = np.zeros((t_len, h, hd), np.float32)
    for s, n in enumerate(c.q_lens):
        start, kv_len = int(c.cu_q_lens[s]), int(c.kv_lens[s])
        for j in range(n):
            tok, pos = start + j, kv_len - n + j
            page, off = c.page_indices[s, pos // ps], pos % ps
            if int8:
                (kq, ks), (vq, vs) = _quantize(c.k_new[tok]), _quantize(c.v_new[tok])
                cache["k"][c.layer, :, page, off], cache["k_scale"][c.layer, :, page, off] = kq, ks
                cache["v"][c.layer, :, page, off], cache["v_scale"][c.layer, :, page, off] = vq, vs
            else:
                cache["k"][c.layer, :, page, off] = c.k_new[tok]
                cache["v"][c.layer, :, page, off] = c.v_new[tok]

        def keys(name):
            rows = cache[name][c.layer][:, c.page_indices[s, :-(-kv_len // ps)]]  # [KV, pages, ps, ...]
            rows = rows.reshape(kvh, -1, *rows.shape[3:])[:, :kv_len].astype(np.float32)
            if int8 and name in ("k", "v"):
                rows = rows * cache[name + "_scale"][c.layer][:, c.page_indices[s, :-(-kv_len // ps)]] \
                    .reshape(kvh, -1)[:, :kv_len, None]
            return rows                                                   # [KV, kv_len, hd]

        k, v = keys("k"), keys("v")
        for j in range(n):
            tok, pos = start + j, kv_len - n + j
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for head in range(h):
                kh = head // g
                sc = k[kh, lo:pos + 1] @ c.q[tok, head] * sm_scale
                if soft_cap is not None:
                    sc = soft_cap * np.tanh(sc / soft_cap)
                p = np.exp(sc - sc.max())
                out[tok, head] = (p / p.sum()) @ v[kh, lo:pos + 1]
    if words_major:
        cache["k"] = np.ascontiguousarray(k_page_to_cache(cache["k"]))
    return out, cache
