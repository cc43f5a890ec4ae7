"""Shared building blocks of every architecture: Flax NNX modules (linear, RMSNorm, embedding,
attention, gated MLP) over pure functions (RoPE, norms), and the scan over a stack of layers.

Every weight is an `nnx.Param` with logical axis names (`sharding_names`), stacked layers first
("layers"). Norms, softmax and matmul accumulation run in f32 whatever the activation dtype.
Backend tricks live elsewhere: every weight matmul goes through quantization.ops, whatever form the
weight takes (float, int8, XLA:CPU's per-layer buffers and stacks), and attention is an `AttentionOp`
the caller passes in.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from slipstream.models.config import ModelConfig, RopeScaling
from slipstream.quantization import ops

LAYERS = "layers"  # the logical axis of stacked per-layer weights


def param(shape: tuple[int, ...], axes: tuple[str, ...], dtype=jnp.float32) -> nnx.Param:
    """A zero weight with logical axes (models are built abstractly, then filled by the loader)."""
    if len(shape) != len(axes):
        raise ValueError(f"weight of shape {shape} needs {len(shape)} axis names, got {axes}")
    return nnx.Param(jnp.zeros(shape, dtype), sharding_names=axes, eager_sharding=False)


def _stack(layers: int | None, shape: tuple[int, ...], axes: tuple[str, ...]):
    return ((layers, *shape), (LAYERS, *axes)) if layers else (shape, axes)


# ---- matmuls ---------------------------------------------------------------------------------

linear = ops.linear  # x [..., in] @ w [in, out] -> [..., out], f32 accumulation, any weight form


class Linear(nnx.Module):
    """y = x @ w (+ b); w [in, out] (stacked: [L, in, out])."""

    def __init__(self, d_in: int, d_out: int, axes: tuple[str, str], *, layers: int | None = None,
                 bias: bool = False):
        self.w = param(*_stack(layers, (d_in, d_out), axes))
        self.b = param(*_stack(layers, (d_out,), axes[1:])) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        return project(x, (self,))[0]


def project(x: jax.Array, mods: Sequence[Linear]) -> tuple[jax.Array, ...]:
    """Several Linears over one input (q/k/v, gate/up), as one group for the backend."""
    ys = ops.linears(x, [m.w.get_value() for m in mods])
    return tuple(y if m.b is None else y + m.b.get_value().astype(y.dtype) for m, y in zip(mods, ys))


# ---- norms, embedding, RoPE ------------------------------------------------------------------

def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (offset + weight.astype(jnp.float32))).astype(x.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm; offset 1 gives Gemma's (1 + w) scale."""

    def __init__(self, dim: int, eps: float, *, axis: str = "embed", layers: int | None = None,
                 offset: float = 0.0):
        self.w = param(*_stack(layers, (dim,), (axis,)))
        self.eps, self.offset = eps, offset

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.w.get_value(), self.eps, self.offset)


class Embed(nnx.Module):
    """Token embedding [vocab, embed]; `attend` is the tied LM head."""

    def __init__(self, vocab: int, dim: int):
        self.table = param((vocab, dim), ("vocab", "embed"))

    def __call__(self, tokens: jax.Array, dtype) -> jax.Array:
        return ops.embed_lookup(self.table.get_value(), tokens, dtype)              # [T,D]

    def attend(self, h: jax.Array) -> jax.Array:
        table = ops.embed_dense(self.table.get_value(), h.dtype)
        return jnp.einsum("td,vd->tv", h, table, preferred_element_type=jnp.float32)  # [T,V]


def rope_inv_freq(rotary_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """Inverse frequencies [rotary_dim // 2] with the scaling applied (as transformers computes them)."""
    inv = 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))
    rs = scaling
    if rs is None:
        return inv.astype(np.float32)
    if rs.kind == "linear":
        return (inv / rs.factor).astype(np.float32)
    if rs.kind == "yarn":
        return _yarn_inv_freq(inv, rotary_dim, theta, rs).astype(np.float32)
    if rs.kind == "longrope":
        return (inv / np.asarray(rs.rescale(), np.float64)).astype(np.float32)
    low_wavelen = rs.original_max_position / rs.low_freq_factor
    high_wavelen = rs.original_max_position / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (rs.original_max_position / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(inv: np.ndarray, dim: int, theta: float, rs: RopeScaling) -> np.ndarray:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are interpolated (divided
    by the factor), those turning more than beta_fast times kept, a linear ramp over the dimensions between."""
    def dim_of(rotations: float) -> float:  # the dimension whose frequency turns `rotations` times
        return dim * math.log(rs.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(rs.beta_fast), dim_of(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if high == low else high
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    return inv / rs.factor * ramp + inv * (1 - ramp)                                # [rotary_dim/2]


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, scale: float | jax.Array = 1.0) -> jax.Array:
    """Rotate-half RoPE (HF layout) of the first 2 * len(inv_freq) dimensions, the rest passed through (partial
    rotary); cos and sin multiplied by `scale` (YaRN's and LongRoPE's attention factor). x: [T, N, hd],
    positions: [T]."""
    rot = 2 * inv_freq.shape[-1]
    angles = positions[:, None].astype(jnp.float32) * inv_freq                      # [T,rot/2]
    cos, sin = jnp.cos(angles)[:, None, :] * scale, jnp.sin(angles)[:, None, :] * scale
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf[..., :rot], 2, axis=-1)
    rotated = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    return jnp.concatenate(rotated + ([xf[..., rot:]] if rot < x.shape[-1] else []), axis=-1).astype(x.dtype)


# ---- attention -------------------------------------------------------------------------------

class AttentionOp(Protocol):
    """How a layer attends: q [T,H,hd], k and v [T,KV,hd] of the step's tokens, the KV state the
    layers thread through, the layer index and its kind -> (out [T,H,hd], new KV state).
    `sliding` is a Python bool when every layer has the same kind, else a traced bool."""

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, cache: Any, layer: jax.Array,
                 sliding: bool | jax.Array) -> tuple[jax.Array, Any]: ...


class LayerKinds:
    """Per-layer kind (full or sliding attention) as the scanned layer body sees it."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.uniform = len(set(cfg.layer_types)) == 1
        self._sliding = np.asarray([k == "sliding" for k in cfg.layer_types])
        self._inv = {k: rope_inv_freq(cfg.rotary_dim, *cfg.rope(k)) for k in ("full", "sliding")}
        self._scale = {k: scaling.attention_factor if (scaling := cfg.rope(k)[1]) else 1.0 for k in ("full", "sliding")}

    def sliding(self, layer: jax.Array) -> bool | jax.Array:
        return bool(self._sliding[0]) if self.uniform else jnp.asarray(self._sliding)[layer]

    def inv_freq(self, sliding: bool | jax.Array) -> jax.Array:
        if isinstance(sliding, bool):
            return jnp.asarray(self._inv["sliding" if sliding else "full"])
        return jnp.where(sliding, self._inv["sliding"], self._inv["full"])

    def rope_scale(self, sliding: bool | jax.Array) -> float | jax.Array:
        """The factor on cos and sin (YaRN, LongRoPE; else 1)."""
        if isinstance(sliding, bool):
            return self._scale["sliding" if sliding else "full"]
        return self._scale["full"] if self._scale["full"] == self._scale["sliding"] else jnp.where(
            sliding, self._scale["sliding"], self._scale["full"])


class Attention(nnx.Module):
    """GQA self-attention: projections (optional bias), optional q/k RMSNorm, RoPE, the AttentionOp,
    output projection."""

    def __init__(self, cfg: ModelConfig, *, layers: int | None, norm_offset: float = 0.0):
        d, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        bias = cfg.attention_bias
        self.wq = Linear(d, cfg.num_heads * hd, ("embed", "q_heads"), layers=layers, bias=bias)
        self.wk = Linear(d, cfg.num_kv_heads * hd, ("embed", "kv_heads"), layers=layers, bias=bias)
        self.wv = Linear(d, cfg.num_kv_heads * hd, ("embed", "kv_heads"), layers=layers, bias=bias)
        self.wo = Linear(cfg.num_heads * hd, d, ("q_heads", "embed"), layers=layers)
        # per head (over head_dim), or over the whole projection (OLMoE)
        full = cfg.qk_norm_full
        norm = dict(layers=layers, offset=norm_offset)
        q_width, k_width = (cfg.num_heads * hd, cfg.num_kv_heads * hd) if full else (hd, hd)
        q_axis, k_axis = ("q_heads", "kv_heads") if full else ("head_dim", "head_dim")
        self.q_norm = RMSNorm(q_width, cfg.rms_norm_eps, axis=q_axis, **norm) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_width, cfg.rms_norm_eps, axis=k_axis, **norm) if cfg.qk_norm else None
        self.qk_norm_full = full

    def __call__(self, x: jax.Array, positions: jax.Array, inv_freq: jax.Array, attend: AttentionOp,
                 cache: Any, layer: jax.Array, sliding: bool | jax.Array,
                 rope_scale: float | jax.Array = 1.0) -> tuple[jax.Array, Any]:
        t = x.shape[0]
        q, k, v = project(x, (self.wq, self.wk, self.wv))
        if self.q_norm is not None and self.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(t, self.num_heads, self.head_dim)                              # [T,H,hd]
        k = k.reshape(t, self.num_kv_heads, self.head_dim)                           # [T,KV,hd]
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, positions, inv_freq, rope_scale), apply_rope(k, positions, inv_freq, rope_scale)
        out, cache = attend(q, k, v, cache, layer, sliding)                          # [T,H,hd]
        return self.wo(out.reshape(t, -1)), cache


# ---- int8 KV: an orthogonal rotation of head_dim --------------------------------------------

@functools.lru_cache(maxsize=None)
def head_rotation(head_dim: int) -> np.ndarray:
    """A fixed orthogonal R [hd, hd]: the normalized Hadamard matrix when hd is a power of two (every
    entry +-1/sqrt(hd), so one outlier channel of K or V spreads evenly over all channels), else a
    fixed random orthogonal matrix."""
    if head_dim & (head_dim - 1) == 0:
        r = np.ones((1, 1))
        while r.shape[0] < head_dim:
            r = np.block([[r, r], [r, -r]])
        return (r / math.sqrt(head_dim)).astype(np.float32)
    r, tri = np.linalg.qr(np.random.default_rng(0x5EED).standard_normal((head_dim, head_dim)))
    return (r * np.sign(np.diag(tri))[None, :]).astype(np.float32)


def rotate_heads(x: jax.Array, r: np.ndarray, *, inverse: bool = False) -> jax.Array:
    """x [T, N, hd] @ R (inverse: @ R^T), in f32 (full precision on TPU too), back in x's dtype."""
    spec = "tnd,ed->tne" if inverse else "tnd,de->tne"
    return jnp.einsum(spec, x, jnp.asarray(r), preferred_element_type=jnp.float32,
                      precision=jax.lax.Precision.HIGHEST).astype(x.dtype)


_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


class GatedMLP(nnx.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (silu) or GeGLU (gelu_tanh)."""

    def __init__(self, cfg: ModelConfig, *, layers: int | None):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.w_gate = Linear(d, f, ("embed", "mlp"), layers=layers)
        self.w_up = Linear(d, f, ("embed", "mlp"), layers=layers)
        self.w_down = Linear(f, d, ("mlp", "embed"), layers=layers)
        self.act = cfg.hidden_activation

    def __call__(self, x: jax.Array) -> jax.Array:
        mods = (self.w_gate, self.w_up, self.w_down)
        if self.act == "silu" and all(m.b is None for m in mods):
            # a weight form that multiplies the whole MLP (silu(gate) * up formed inside the down
            # projection) returns it, else None
            if (y := ops.gated_down(x, *(m.w.get_value() for m in mods))) is not None:
                return y
        gate, up = project(x, (self.w_gate, self.w_up))                              # [T,F] each
        return self.w_down(_ACTIVATIONS[self.act](gate) * up)


# ---- the layer stack -------------------------------------------------------------------------

def scan_layers(blocks: nnx.Module, body: Callable[[nnx.Module, Any, jax.Array], Any], carry: Any,
                num_layers: int) -> Any:
    """carry = body(block_i, carry, i) for each layer i under lax.scan (compile time flat in depth).
    `blocks` holds every weight stacked [L, ...]; a weight the engine split into per-layer buffers is
    not sliced but picked by index."""
    graphdef, state = nnx.split(blocks)
    leaves, treedef = jax.tree.flatten(state, is_leaf=ops.per_layer)
    stacked = [None if ops.per_layer(leaf) else leaf for leaf in leaves]

    def step(carry, xs):
        sliced, i = xs
        layer = [ops.pick(leaf, i) if ops.per_layer(leaf) else s for leaf, s in zip(leaves, sliced)]
        return body(nnx.merge(graphdef, jax.tree.unflatten(treedef, layer)), carry, i), None

    carry, _ = jax.lax.scan(step, carry, (stacked, jnp.arange(num_layers, dtype=jnp.int32)))
    return carry
