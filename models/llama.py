"""The Llama-family forward pass: a pure function of (params, KV pages) -> (logits, KV pages).

Two entry points share the layer code: `forward_dense` (no cache; the reference for tests) and
`forward_step` (one ragged step of many sequences over a paged KV cache; what the engine jits per
token bucket).
Layers run under `lax.scan`, which keeps compile time flat in depth; their weights are stacked on a
leading axis, or (split_layers, what the engine uses) a list of per-layer buffers picked by lax.switch.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels.attention import ragged_paged_attention
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


_MATMULS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@jax.jit
def _linears(ws: tuple, x: jax.Array) -> tuple[jax.Array, ...]:
    # jitted so that the switch branches (one per layer) share one trace: lowering time
    return tuple(layers.linear(x, w) for w in ws)


def forward_step(params: dict, cfg: ModelConfig, cache: dict, tokens: jax.Array, positions: jax.Array,
                 kv_lens: jax.Array, page_indices: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array,
                 sample_index: jax.Array, *, dtype=jnp.float32) -> tuple[jax.Array, dict]:
    """One ragged step over the paged KV cache: logits [R, V] of the tokens at sample_index [R], and
    the cache with every real token's K/V written.

    tokens, positions: int32 [T], the flat batch: sequence s owns tokens [cu_q_lens[s], cu_q_lens[s+1])
    at consecutive positions ending at kv_lens[s] - 1 (a decode is one token, a prefill chunk many;
    the tokens from cu_q_lens[num_seqs] on are padding). kv_lens [S], page_indices [S, P],
    cu_q_lens [S+1], num_seqs [1]: kernels.attention's interface. Every weight matmul sees all T
    tokens at once; attention is the one ragged op (kernels.attention.ragged_paged_attention).
    params["layers"]: stacked [L, ...] leaves, or a list of per-layer dicts (what the engine passes
    on CPU: each layer's weights are then their own buffers and no step copies them out of a stack).
    """
    n_layers = cache["k"].shape[0]
    inv_freq = jnp.asarray(layers.rope_inv_freq(cfg))
    pos2 = positions[None]                                                        # [1,T]

    def layer_body(x, cache, lp, i, matmul=None):
        matmul = matmul or layers.layer_matmul(lp)
        h = layers.rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
        q, k, v = layers.qkv(h[None], lp, cfg, pos2, inv_freq, matmul=matmul)    # [1,T,H|KV,hd]
        out, cache = ragged_paged_attention(
            q[0], k[0], v[0], cache, i, kv_lens, page_indices, cu_q_lens, num_seqs,
            sm_scale=cfg.head_dim ** -0.5, sliding_window=cfg.sliding_window)
        x = x + matmul(out.reshape(out.shape[0], -1), ("wo",))[0]
        x = x + layers.swiglu(layers.rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps), lp, matmul=matmul)
        return x, cache

    x = _embed(params, tokens, dtype)                                             # [T,D]
    index = jnp.arange(n_layers, dtype=jnp.int32)
    if isinstance(params["layers"], (list, tuple)):
        # The matmul weights stay per-layer buffers, picked by lax.switch on the layer index: a
        # scan over a stack copies every weight out of it each step (XLA:CPU cannot matmul a
        # dynamic slice), ~2x the weight reads at batch 1. Small leaves (norms, biases) are stacked.
        per_layer = params["layers"]
        small = jax.tree.map(lambda *a: jnp.stack(a), *[{name: w for name, w in lp.items() if name not in _MATMULS}
                                                        for lp in per_layer])

        def layer(carry, xs):
            lp, i = xs

            def matmul(a, names):
                # one row as a vector: XLA:CPU wraps a [1,D] matvec inside a branch in relayout copies
                flat = a.reshape(-1, a.shape[-1])
                flat = flat[0] if flat.shape[0] == 1 else flat
                outs = jax.lax.switch(i, [functools.partial(_linears, tuple(lw[name] for name in names))
                                          for lw in per_layer], flat)
                return tuple(o.reshape(*a.shape[:-1], o.shape[-1]) for o in outs)

            return layer_body(*carry, lp, i, matmul), None

        (x, cache), _ = jax.lax.scan(layer, (x, cache), (small, index))
    else:
        (x, cache), _ = jax.lax.scan(lambda carry, xs: (layer_body(*carry, *xs), None), (x, cache),
                                     (params["layers"], index))
    return _lm_head(params, cfg, x[sample_index]), cache                         # [R,V]
