"""The Llama-family forward pass: a pure function of (params, KV pages) -> (logits, KV pages).

Two entry points share the layer code: `forward_dense` (no cache; the reference for tests) and
`forward_paged` (reads and writes a paged KV cache; what the engine jits per shape bucket).
Layers run under `lax.scan`, which keeps compile time flat in depth; their weights are stacked on a
leading axis, or (split_layers, what the engine uses) a list of per-layer buffers picked by lax.switch.
"""
from __future__ import annotations

import functools

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


def split_layers(params: dict) -> dict:
    """params with "layers" as a list of per-layer dicts, each weight its own buffer (the form
    forward_paged runs fastest on; the engine keeps its params this way)."""
    stacked = params["layers"]
    if isinstance(stacked, (list, tuple)):
        return params
    n_layers = jax.tree_util.tree_leaves(stacked)[0].shape[0]
    return {**params, "layers": [jax.tree.map(lambda w, i=i: w[i], stacked) for i in range(n_layers)]}


def _stacked_layers(params: dict):
    layers_ = params["layers"]
    if isinstance(layers_, (list, tuple)):  # split_layers' form: restack (a copy) for lax.scan
        return jax.tree.map(lambda *ws: jnp.stack(ws), *layers_)
    return layers_


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

    x, _ = jax.lax.scan(layer, _embed(params, tokens, dtype), _stacked_layers(params))
    return _lm_head(params, cfg, x)


def init_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype) -> dict:
    """KV pages for all layers, heads before pages: K and V [L, KV, num_pages, page_size, hd].

    Heads first so that one (layer, head, page) is a contiguous [page_size, hd] block: a row
    gather of a sequence's pages is then directly the [S, hd] operand of the attention matmuls,
    with no transpose. With dtype int8 the cache also holds per-token-per-head f32 scales
    [L, KV, num_pages, page_size].
    """
    shape = (cfg.num_layers, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
    cache = {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
    if jnp.dtype(dtype) == jnp.int8:
        cache["k_scale"] = jnp.zeros(shape[:4], jnp.float32)
        cache["v_scale"] = jnp.zeros(shape[:4], jnp.float32)
    return cache


def _as_stored(cache: dict, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """K/V as a later step will read them back (int8 round trip), so this step attends the same values."""
    if "k_scale" not in cache:
        return k, v
    from quantization.kv import dequantize_kv, quantize_kv

    return dequantize_kv(*quantize_kv(k), k.dtype), dequantize_kv(*quantize_kv(v), v.dtype)


def _write_kv(cache: dict, slots: jax.Array, k: jax.Array, v: jax.Array) -> dict:
    """Scatter every layer's new K/V [L,N,KV,hd] at flat token slots [N] (page * page_size + offset)."""
    n_layers, kvh, num_pages, page_size, hd = cache["k"].shape

    def put(buf: jax.Array, new: jax.Array) -> jax.Array:
        flat = buf.reshape(n_layers, kvh, num_pages * page_size, *buf.shape[4:])
        return flat.at[:, :, slots].set(jnp.swapaxes(new, 1, 2).astype(buf.dtype)).reshape(buf.shape)

    out = dict(cache)
    if "k_scale" in cache:
        from quantization.kv import quantize_kv

        (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
        out["k"], out["v"] = put(cache["k"], kq), put(cache["v"], vq)
        out["k_scale"], out["v_scale"] = put(cache["k_scale"], ks), put(cache["v_scale"], vs)
    else:
        out["k"], out["v"] = put(cache["k"], k), put(cache["v"], v)
    return out


def _read_kv(cache: dict, rows: jax.Array, dtype) -> tuple[jax.Array, ...]:
    """Gather pages by row id (layer * KV + head) * num_pages + page, rows [B,KV,P] -> K, V [B,KV,S,hd]
    in dtype, then K's and V's scales [B,KV,S] (None unless the cache is int8: K and V are then the
    unscaled int8 values, for attention_block to scale its scores and probabilities)."""
    b, kvh, p = rows.shape

    def gather(buf: jax.Array) -> jax.Array:
        n_layers, _, num_pages, page_size = buf.shape[:4]
        flat = buf.reshape(n_layers * kvh * num_pages, -1)          # one contiguous page per row
        return flat[rows].reshape(b, kvh, p * page_size, *buf.shape[4:])

    k, v = gather(cache["k"]).astype(dtype), gather(cache["v"]).astype(dtype)
    if "k_scale" in cache:
        return k, v, gather(cache["k_scale"]), gather(cache["v_scale"])
    return k, v, None, None


_MATMULS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@jax.jit
def _linears(ws: tuple, x: jax.Array) -> tuple[jax.Array, ...]:
    # jitted so that the switch branches (one per layer) share one trace: lowering time
    return tuple(layers.linear(x, w) for w in ws)


# Bytes of K, V and scores per block of cached keys: small enough to stay in L2 between the gather
# and the two matmuls that read it (bigger blocks re-read from DRAM, smaller ones pay loop overhead).
_BLOCK_BYTES = 4 << 20


def _pages_per_block(b: int, t: int, p: int, page_size: int, cfg: ModelConfig, itemsize: int) -> int:
    per_key = b * cfg.num_kv_heads * (2 * cfg.head_dim * itemsize + cfg.num_heads // cfg.num_kv_heads * t * 4)
    pages = max(1, _BLOCK_BYTES // (per_key * page_size))
    pages = 1 << (pages.bit_length() - 1)                       # a power of two, like the buckets
    return min(pages, 1 << (p - 1).bit_length())


def forward_paged(params: dict, cfg: ModelConfig, cache: dict, tokens: jax.Array,
                  positions: jax.Array, write_slots: jax.Array, block_tables: jax.Array,
                  last_index: jax.Array,
                  *, page_size: int, dtype=jnp.float32) -> tuple[jax.Array, dict]:
    """One step over a paged KV cache; returns logits of each row's `last_index` token and the cache.

    tokens, positions: int32 [B,T] (T = 1 for decode, a chunk for prefill); a row's tokens are
    consecutive positions from positions[:, 0], padding after them.
    write_slots: int32 [B,T]: flat cache slot (page * page_size + offset) for each token's K/V;
    padding tokens write to slot 0 of the reserved page 0.
    block_tables: int32 [B,P]: the pages of each row's sequence, in order (P*page_size >= last
    position + 1); entries past the sequence are page 0.
    params["layers"]: stacked [L, ...] leaves, or a list of per-layer dicts (what the engine
    passes: each layer's weights are then their own buffers and no step copies them out of a stack).
    Every key at a position <= the query's position is attended: earlier chunks and prefix-cache
    pages from the cache (positions before the row's first token, read in blocks of pages up to
    the batch's longest row only), the current chunk from its own K/V, which is written to the
    cache once, for all layers, after the last layer.
    """
    b, t = tokens.shape
    n_layers, kvh, num_pages = cache["k"].shape[:3]
    per_block = _pages_per_block(b, t, block_tables.shape[1], page_size, cfg, jnp.dtype(dtype).itemsize)
    n_pages = -(-block_tables.shape[1] // per_block) * per_block
    block_tables = jnp.pad(block_tables, ((0, 0), (0, n_pages - block_tables.shape[1])))  # page 0
    # cache rows of each layer's pages: (layer * KV + head) * num_pages + page        [L,B,KV,P]
    heads = jnp.arange(n_layers * kvh, dtype=jnp.int32).reshape(n_layers, 1, kvh, 1)
    rows = heads * num_pages + block_tables[None, :, None, :]
    start = positions[:, 0]                                      # keys before it are in the cache
    block_keys = per_block * page_size
    n_blocks = jnp.minimum((jnp.max(start) + block_keys - 1) // block_keys, n_pages // per_block)
    order = jnp.arange(t, dtype=jnp.int32)
    causal = (order[:, None] <= order[None, :])[None]                              # [1,U,T]: key u, query t
    chunk_mask = jnp.broadcast_to(_window_mask(causal, positions[:, None, :], positions[:, :, None], cfg),
                                  (b, t, t))                                        # [B,U,T]
    inv_freq = jnp.asarray(layers.rope_inv_freq(cfg))

    def cache_block(state, q_rows, layer_rows, i):
        k_pos = i * block_keys + jnp.arange(block_keys, dtype=jnp.int32)            # [S]
        mask = _window_mask(k_pos[None, :, None] < start[:, None, None], positions[:, None, :],
                            k_pos[None, :, None], cfg)                              # [B,S,T]
        k, v, k_scale, v_scale = _read_kv(
            cache, jax.lax.dynamic_slice_in_dim(layer_rows, i * per_block, per_block, 2), dtype)
        return layers.attention_block(state, q_rows, k, v, mask, k_scale, v_scale)

    def attention(q, k, v, layer_rows):
        q_rows = layers.attention_rows(q, kvh)                                      # [B,KV,G*T,hd]
        k_new, v_new = (jnp.swapaxes(a, 1, 2) for a in _as_stored(cache, k, v))      # [B,KV,T,hd]
        state = layers.attention_block(layers.attention_start(q_rows), q_rows, k_new, v_new, chunk_mask)
        state = jax.lax.fori_loop(0, n_blocks, lambda i, st: cache_block(st, q_rows, layer_rows, i), state)
        return layers.attention_finish(state, t, q.dtype)

    def layer_body(x, lp, layer_rows, matmul=None):
        matmul = matmul or layers.layer_matmul(lp)
        h = layers.rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
        q, k, v = layers.qkv(h, lp, cfg, positions, inv_freq, matmul=matmul)
        x = x + matmul(attention(q, k, v, layer_rows), ("wo",))[0]
        x = x + layers.swiglu(layers.rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps), lp, matmul=matmul)
        return x, (k, v)

    x = _embed(params, tokens, dtype)
    if isinstance(params["layers"], (list, tuple)):
        # The matmul weights stay per-layer buffers, picked by lax.switch on the layer index: a
        # scan over a stack copies every weight out of it each step (XLA:CPU cannot matmul a
        # dynamic slice), ~2x the weight reads at batch 1. Small leaves (norms, biases) are stacked.
        per_layer = params["layers"]
        small = jax.tree.map(lambda *a: jnp.stack(a), *[{name: w for name, w in lp.items() if name not in _MATMULS}
                                                        for lp in per_layer])

        def layer(x, xs):
            lp, i, layer_rows = xs

            def matmul(a, names):
                # Rows flattened, one row as a vector: XLA:CPU wraps a [1,D] matvec inside a branch
                # in relayout copies (and a 2-row matmul runs ~30% slower at batch 1).
                flat = a.reshape(-1, a.shape[-1])
                flat = flat[0] if flat.shape[0] == 1 else flat
                outs = jax.lax.switch(i, [functools.partial(_linears, tuple(lw[name] for name in names))
                                          for lw in per_layer], flat)
                return tuple(o.reshape(*a.shape[:-1], o.shape[-1]) for o in outs)

            return layer_body(x, lp, layer_rows, matmul)

        x, (k, v) = jax.lax.scan(layer, x, (small, jnp.arange(n_layers, dtype=jnp.int32), rows))
    else:
        x, (k, v) = jax.lax.scan(lambda x, xs: layer_body(x, *xs), x, (params["layers"], rows))
    cache = _write_kv(cache, write_slots.reshape(-1), k.reshape(n_layers, b * t, *k.shape[3:]),
                      v.reshape(n_layers, b * t, *v.shape[3:]))
    h_last = jnp.take_along_axis(x, last_index[:, None, None], axis=1)[:, 0]          # [B,D]
    return _lm_head(params, cfg, h_last), cache
