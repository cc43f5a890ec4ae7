"""The model seam: what the engine, the loaders and quantization know about any architecture.

A model is an NNX module (a `CausalLM`) that
- is built from a ModelConfig (abstractly, then filled by models/loader.py from its `WEIGHTS`),
- declares each weight once: checkpoint names (HF and GGUF), logical axes, and whether it is a
  linear weight (what quantization rounds),
- describes the KV cache it needs (`kv_cache_shape`),
- runs one ragged step over the paged KV cache and returns the sampling rows' logits (`step`), and with every
  token's log-probability of the token after it where a prompt is scored, or its sequences' pooled hidden
  states where prompts are embedded (`extended_step`).
The engine runs it as a pure function: `nnx.split` outside jit, `nnx.merge` inside (`step_fn`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from slipstream.kernels.attention import kv_layout, ragged_paged_attention
from slipstream.kernels.sampling import top_logprobs
from slipstream.models import layers
from slipstream.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Weight:
    """One weight of an architecture. path: its place in the module tree ("blocks.attn.wq.w");
    hf / gguf: checkpoint names ("{i}" is the layer; None: not in that format); linear: a [in, out]
    matmul weight stored [out, in] in checkpoints (transposed on load, quantized by int8 modes);
    rope_permute: "q" or "k" for llama.cpp's interleaved Q/K rows in GGUF files; experts: a sparse MoE's
    expert weights stacked [L, E, in, out] (quantization/experts.py's form, not a dense linear's), from one HF tensor
    per layer and expert ("{e}" in the name) or one GGUF tensor per layer holding every expert. A declared weight the module does not have (a
    bias or q/k norm its config leaves out, the LM head when tied, a dense MLP in an MoE) is skipped."""

    path: str
    hf: str
    gguf: str | None
    linear: bool = False
    rope_permute: str | None = None
    experts: bool = False
    # a stack of some other count of layers than the text model's (a vision tower's): the ModelConfig attribute
    # path that gives it ("vision.num_layers"), "{i}" in the name as for `blocks.`
    stacked_by: str | None = None

    @property
    def per_layer(self) -> bool:
        return self.path.startswith("blocks.")

    def num_stacked(self, cfg: ModelConfig) -> int:
        """Layers stacked on its leading axis (0: not a stack)."""
        if self.per_layer:
            return cfg.num_layers
        if self.stacked_by is None:
            return 0
        value = cfg
        for name in self.stacked_by.split("."):
            value = getattr(value, name)
        return value


class CausalLM(nnx.Module):
    """Base of every architecture: embedding, a stack of `blocks` scanned over layers, final norm and
    LM head. Subclasses build `self.blocks` (stacked weights) and define `block` and the hooks."""

    WEIGHTS: ClassVar[tuple[Weight, ...]] = ()
    # (prefix of a declared HF name, a prefix other checkpoints of the architecture use instead): the HF loader
    # tries each in turn (transformers has saved LLaVA under three layouts)
    HF_ALIASES: ClassVar[tuple[tuple[str, str], ...]] = ()
    embed: layers.Embed
    final_norm: layers.RMSNorm
    lm_head: layers.Linear | None  # None: tied to the embedding

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg

    # ---- hooks an architecture may override ----------------------------------------------------

    def embed_tokens(self, tokens: jax.Array, dtype) -> jax.Array:
        return self.embed(tokens, dtype)                                             # [T,D]

    def block(self, blk: nnx.Module, x: jax.Array, positions: jax.Array, attend: layers.AttentionOp,
              cache: Any, layer: jax.Array) -> tuple[jax.Array, Any]:
        raise NotImplementedError

    def logits(self, h: jax.Array) -> jax.Array:
        h = self.final_norm(h)
        if self.lm_head is None:
            out = self.embed.attend(h)
        else:
            out = self.lm_head(h).astype(jnp.float32)
        cap = self.cfg.final_logit_softcap
        return out if cap is None else cap * jnp.tanh(out / cap)                     # [R,V]

    # ---- the forward ----------------------------------------------------------------------------

    def __call__(self, tokens: jax.Array, positions: jax.Array, attend: layers.AttentionOp, cache: Any,
                 rows: jax.Array | None = None, *, dtype=jnp.float32, embeds: jax.Array | None = None,
                 embedded: jax.Array | None = None) -> tuple[jax.Array, Any]:
        """Flat tokens [T] at positions [T] -> (logits [R, V] of the tokens at `rows` (all when None),
        the KV state after every layer attended through `attend`). embeds [T, D] with embedded i32[T]: rows that
        enter the first layer in place of their token's embedding where embedded is 1 (an image's, models/llava.py)."""
        x, cache = self.hidden(tokens, positions, attend, cache, dtype=dtype, embeds=embeds, embedded=embedded)
        return self.logits(x if rows is None else x[rows]), cache

    def hidden(self, tokens: jax.Array, positions: jax.Array, attend: layers.AttentionOp, cache: Any, *,
               dtype=jnp.float32, embeds: jax.Array | None = None,
               embedded: jax.Array | None = None) -> tuple[jax.Array, Any]:
        """__call__ up to the final norm: the last layer's output [T, D] of every token, and the KV state."""
        x = self.embed_tokens(tokens, dtype)
        if embeds is not None:
            x = jnp.where(embedded[:, None] > 0, embeds.astype(x.dtype), x)                     # [T,D]

        def body(blk, carry, i):
            x, cache = carry
            return self.block(blk, x, positions, attend, cache, i)

        return layers.scan_layers(self.blocks, body, (x, cache), self.cfg.num_layers)


# ---- attention ops: the paged step and the dense reference -------------------------------------

def int8_kv(cache: dict) -> bool:
    """Whether the KV cache stores int8 K/V (with per-token-per-head scales), in either layout."""
    return "k_scale" in cache or "kv_scale" in cache


@dataclasses.dataclass(frozen=True)
class PagedAttention:
    """Attention of one ragged step: kernels.attention's ragged paged attention over the KV pages, or the
    engine's wrapper of it with the same signature (`kernel`: tensor parallelism's shard_map)."""

    cfg: ModelConfig
    kv_lens: jax.Array
    page_indices: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array
    kernel: Callable = ragged_paged_attention

    def __call__(self, q, k, v, cache, layer, sliding):
        # int8 K/V round per token and head over head_dim: an outlier channel sets the scale and the
        # other channels lose their bits. Attention is invariant under one orthogonal R of head_dim
        # (q R (k R)^T = q k^T, softmax(.) (v R) R^T = softmax(.) v), and R spreads outliers out.
        rot = layers.head_rotation(q.shape[-1]) if int8_kv(cache) else None
        if rot is not None:  # each on its own: q and k/v split differently over heads under TP
            q, k, v = (layers.rotate_heads(x, rot) for x in (q, k, v))
        out, cache = self._attend(q, k, v, cache, layer, sliding)
        return (out if rot is None else layers.rotate_heads(out, rot, inverse=True)), cache

    def _attend(self, q, k, v, cache, layer, sliding):
        def attend(window):
            return self.kernel(q, k, v, cache, layer, self.kv_lens, self.page_indices, self.cu_q_lens,
                               self.num_seqs, sm_scale=self.cfg.sm_scale, sliding_window=window)

        if isinstance(sliding, bool):
            return attend(self.cfg.sliding_window if sliding else None)
        # Layers of both kinds under one scan (Gemma 3), and the kernel's window is static. A
        # lax.cond between the two calls made XLA copy the whole cache 4 times per step (the branches
        # alias it); attending both ways costs one extra windowed pass (W keys per token) and rewrites
        # the same K/V, with no copy.
        out_local, cache = attend(self.cfg.sliding_window)
        out_global, cache = attend(None)
        return jnp.where(sliding, out_local, out_global), cache


@dataclasses.dataclass(frozen=True)
class DenseAttention:
    """Attention without a cache over right-padded rows flattened to [B*T]: the test reference."""

    cfg: ModelConfig
    row: jax.Array        # [N] which batch row each flat token is in
    positions: jax.Array  # [N]
    valid: jax.Array      # [N]

    def __call__(self, q, k, v, cache, layer, sliding):
        qp, kp = self.positions[:, None], self.positions[None, :]
        mask = (self.row[:, None] == self.row[None, :]) & (kp <= qp) & self.valid[None, :]     # [N,N]
        if self.cfg.sliding_window:
            windowed = mask & (kp > qp - self.cfg.sliding_window)
            mask = jnp.where(sliding, windowed, mask)
        n, h, hd = q.shape
        kvh = k.shape[1]
        qg = q.reshape(n, kvh, h // kvh, hd)                                          # [N,KV,G,hd]
        scores = jnp.einsum("qkgh,skh->kgqs", qg, k, preferred_element_type=jnp.float32) * self.cfg.sm_scale
        probs = jax.nn.softmax(jnp.where(mask, scores, -1e30), axis=-1).astype(v.dtype)
        out = jnp.einsum("kgqs,skh->qkgh", probs, v, preferred_element_type=jnp.float32)
        return out.reshape(n, h, hd).astype(q.dtype), cache


# ---- what the engine calls -----------------------------------------------------------------------

SCORE_BLOCK = 256  # tokens per LM-head call when every token is scored (extended_step)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenScores:
    """The model's log-probabilities at each token of a step (extended_step): of the token after it, and the
    most likely ones there (best first)."""

    logprob: jax.Array   # f32[T]
    top_ids: jax.Array   # i32[T, top]
    top_logprobs: jax.Array  # f32[T, top]


def kv_cache_shape(cfg: ModelConfig, num_pages: int, page_size: int, dtype=jnp.float32,
                   platform: str | None = None) -> dict[str, jax.ShapeDtypeStruct]:
    """The cache's arrays (name -> shape and dtype) in the layout the attention kernel of `platform`
    (default: JAX's default backend) reads: kernels.attention.kv_layout. On CPU and GPU K and V pages
    [L, KV, num_pages, page_size, hd]; on TPU K and V of all heads merged per page."""
    return kv_layout(platform or jax.default_backend()).shapes(
        cfg.num_layers, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim, dtype)


def init_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype, platform: str | None = None) -> dict:
    """The zeroed KV pages (int8 caches also hold per-token-per-head f32 scales), see kv_cache_shape."""
    return {name: jnp.zeros(s.shape, s.dtype) for name, s in kv_cache_shape(cfg, num_pages, page_size, dtype,
                                                                             platform).items()}


def step(model: CausalLM, cache: dict, tokens: jax.Array, positions: jax.Array, kv_lens: jax.Array,
         page_indices: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array, sample_index: jax.Array,
         *, dtype=jnp.float32, attention: Callable = ragged_paged_attention, embeds: jax.Array | None = None,
         embedded: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """One ragged step over the paged KV cache: logits [R, V] of the tokens at sample_index [R], and the
    cache with every real token's K/V written.

    tokens, positions: int32 [T], the flat batch: sequence s owns tokens [cu_q_lens[s], cu_q_lens[s+1])
    at consecutive positions ending at kv_lens[s] - 1 (a decode is one token, a prefill chunk many;
    tokens from cu_q_lens[num_seqs] on are padding). kv_lens [S], page_indices [S, P], cu_q_lens [S+1],
    num_seqs [1]: kernels.attention's interface. Every weight matmul sees all T tokens at once.
    attention: the ragged paged attention op (the engine wraps kernels.attention's for tensor parallelism).
    embeds [T, D], embedded i32[T]: rows fed in place of their token's embedding (CausalLM.__call__).
    """
    attend = PagedAttention(model.cfg, kv_lens, page_indices, cu_q_lens, num_seqs, attention)
    return model(tokens, positions, attend, cache, sample_index, dtype=dtype, embeds=embeds, embedded=embedded)


def extended_step(model: CausalLM, cache: dict, tokens: jax.Array, positions: jax.Array, kv_lens: jax.Array,
                  page_indices: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array, sample_index: jax.Array, *,
                  targets: jax.Array | None = None, alternatives: jax.Array | None = None, top: int = 0,
                  pool: jax.Array | None = None, num_pooled: int = 0, dtype=jnp.float32,
                  attention: Callable = ragged_paged_attention, block: int = SCORE_BLOCK,
                  embeds: jax.Array | None = None,
                  embedded: jax.Array | None = None) -> tuple[tuple[jax.Array, dict[str, Any]], dict]:
    """step(), and what the step's rows give besides the sample rows' logits: ((logits [R, V], extras), cache).

    With targets: extras["scores"], TokenScores of all T tokens: the model's log-probability at each token of the
    token after it (targets i32[T]: each token's next token, any id where none is wanted: its row is computed and
    ignored) and the `top` best there, of which alternatives i32[] are wanted (at most one: the best alone, by a
    max, not a top-k: a third of its time on a TPU). The LM head runs over `block` rows at a time, so the step
    holds [block, V] logits, not [T, V].

    With pool i32[T]: extras["pooled"] f32[num_pooled, D], per pooled sequence the sum of its rows' last hidden
    states after the final norm (HF's last_hidden_state): pool names each row's pooled sequence (num_pooled for a
    row not pooled, padding too). An embedding is such a sum: over a prompt's rows (mean), or its last row."""
    attend = PagedAttention(model.cfg, kv_lens, page_indices, cu_q_lens, num_seqs, attention)
    h, cache = model.hidden(tokens, positions, attend, cache, dtype=dtype, embeds=embeds, embedded=embedded)
    extras: dict[str, Any] = {}
    if targets is not None:
        t = h.shape[0]
        block = min(block, t)
        pad = -t % block
        blocks = jnp.pad(h, ((0, pad), (0, 0))).reshape(-1, block, h.shape[-1])
        block_targets = jnp.pad(targets, (0, pad)).reshape(-1, block)

        def score(args):
            rows, target = args
            return top_logprobs(model.logits(rows), target, top, wanted=alternatives)

        chosen, top_ids, top_lps = jax.lax.map(score, (blocks, block_targets))
        extras["scores"] = TokenScores(chosen.reshape(-1)[:t], top_ids.reshape(-1, top)[:t],
                                       top_lps.reshape(-1, top)[:t])
    if pool is not None:
        normed = model.final_norm(h).astype(jnp.float32)
        extras["pooled"] = jax.ops.segment_sum(normed, pool, num_segments=num_pooled + 1)[:num_pooled]
    return (model.logits(h[sample_index]), extras), cache


def step_fn(graphdef: nnx.GraphDef, attention: Callable = ragged_paged_attention, *, score_top: int = 0,
            num_pooled: int = 0):
    """The pure function the engine jits: (state, cache, step inputs...) -> (logits, cache); given `targets`
    and `alternatives` (scoring, top score_top) or `pool` (pooling, num_pooled sequences), extended_step's:
    (state, cache, step inputs..., targets=, alternatives=, pool=) -> ((logits, extras), cache). Given embeds and
    embedded, those rows replace their tokens' embeddings (images)."""
    def run(state, cache, *inputs, targets=None, alternatives=None, pool=None, dtype=jnp.float32, embeds=None,
            embedded=None):
        model = nnx.merge(graphdef, state)
        if targets is None and pool is None:
            return step(model, cache, *inputs, dtype=dtype, attention=attention, embeds=embeds, embedded=embedded)
        return extended_step(model, cache, *inputs, targets=targets, alternatives=alternatives, top=score_top,
                             pool=pool, num_pooled=num_pooled, dtype=dtype, attention=attention, embeds=embeds,
                             embedded=embedded)
    return run


def dense_logits(model: CausalLM, tokens: jax.Array, valid: jax.Array | None = None,
                 dtype=jnp.float32) -> jax.Array:
    """Logits [B, T, V] of right-padded token rows [B, T] (valid: bool [B, T]) without a cache: the
    same layer code with plain masked attention (the reference the paged step is tested against)."""
    b, t = tokens.shape
    valid = jnp.ones((b, t), bool) if valid is None else valid
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)).reshape(-1)
    row = jnp.repeat(jnp.arange(b, dtype=jnp.int32), t)
    attend = DenseAttention(model.cfg, row, positions, valid.reshape(-1))
    logits, _ = model(tokens.reshape(-1), positions, attend, None, dtype=dtype)
    return logits.reshape(b, t, -1)
