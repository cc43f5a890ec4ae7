"""Vision towers (a ViT: CLIP's, SigLIP's or Idefics3's) and LLaVA's projector, as NNX modules over plain weights.

The tower takes preprocessed pixels [B, 3, H, W] (models/image_processor.py) and returns the hidden states of its
feature layers; the projector maps them into the text model's embedding space. Weights keep the checkpoint's
[out, in] layout and the activation dtype: the engine's quantized modes round the text model only. The engine
runs this as its own jitted program per image size (engine/device/vision_program.py), never inside a step.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from slipstream.models.base import Weight
from slipstream.models.config import VisionConfig
from slipstream.models.layers import LAYERS, param

EMBED, WIDE = "embed", "head_dim"  # logical axes: replicated under tensor parallelism (a tower is small)


def vision_weights(tower: str, projector: str) -> tuple[Weight, ...]:
    """LLaVA's tower and projector weights, under the checkpoint prefixes `tower` (e.g. "vision_tower.vision_model.")
    and `projector`."""
    return (*tower_weights(tower),
            Weight("projector.w1", projector + "linear_1.weight", None),
            Weight("projector.b1", projector + "linear_1.bias", None),
            Weight("projector.w2", projector + "linear_2.weight", None),
            Weight("projector.b2", projector + "linear_2.bias", None))


def tower_weights(tower: str) -> tuple[Weight, ...]:
    """The tower's weights under the checkpoint prefix `tower`; a weight the config leaves out (CLIP's class token and
    pre-norm, SigLIP's patch bias, Idefics3's post-norm) is skipped."""
    layer = tower + "encoder.layers.{i}."
    stacked = "vision.num_layers"
    return (
        Weight("vision.patch_w", tower + "embeddings.patch_embedding.weight", None),
        Weight("vision.patch_b", tower + "embeddings.patch_embedding.bias", None),
        Weight("vision.class_embedding", tower + "embeddings.class_embedding", None),
        Weight("vision.position_embedding", tower + "embeddings.position_embedding.weight", None),
        Weight("vision.pre_norm_w", tower + "pre_layrnorm.weight", None),
        Weight("vision.pre_norm_b", tower + "pre_layrnorm.bias", None),
        *(Weight(f"vision.layers.{name}", layer + hf, None, stacked_by=stacked) for name, hf in (
            ("norm1_w", "layer_norm1.weight"), ("norm1_b", "layer_norm1.bias"),
            ("norm2_w", "layer_norm2.weight"), ("norm2_b", "layer_norm2.bias"),
            ("wq", "self_attn.q_proj.weight"), ("bq", "self_attn.q_proj.bias"),
            ("wk", "self_attn.k_proj.weight"), ("bk", "self_attn.k_proj.bias"),
            ("wv", "self_attn.v_proj.weight"), ("bv", "self_attn.v_proj.bias"),
            ("wo", "self_attn.out_proj.weight"), ("bo", "self_attn.out_proj.bias"),
            ("fc1_w", "mlp.fc1.weight"), ("fc1_b", "mlp.fc1.bias"),
            ("fc2_w", "mlp.fc2.weight"), ("fc2_b", "mlp.fc2.bias"))),
        Weight("vision.post_norm_w", tower + "post_layernorm.weight", None),
        Weight("vision.post_norm_b", tower + "post_layernorm.bias", None),
    )


def _activation(name: str):
    return {"quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
            "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
            "gelu": lambda x: jax.nn.gelu(x, approximate=False)}[name]


def _dense(x: jax.Array, w: jax.Array, b: jax.Array | None) -> jax.Array:
    """x [..., in] @ w[out, in]^T (+ b), f32 accumulation, in x's dtype."""
    y = jnp.einsum("...i,oi->...o", x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y if b is None else y + b.astype(jnp.float32)).astype(x.dtype)


def layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + eps) * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


class VisionTower(nnx.Module):
    """A ViT: patch embedding (a stride-p convolution, as a matmul over flattened patches), position embeddings,
    pre-norm encoder layers (LayerNorm, bidirectional attention, MLP), run up to the deepest feature layer."""

    def __init__(self, cfg: VisionConfig):
        self.cfg = cfg
        d, f, p, n = cfg.hidden_size, cfg.intermediate_size, cfg.patch_size, cfg.num_layers
        self.patch_w = param((d, 3, p, p), (EMBED, WIDE, WIDE, WIDE))
        self.patch_b = param((d,), (EMBED,)) if cfg.kind == "siglip" else None
        self.class_embedding = param((d,), (EMBED,)) if cfg.class_token else None
        self.position_embedding = param((cfg.num_patches + cfg.class_token, d), (WIDE, EMBED))
        self.pre_norm_w = param((d,), (EMBED,)) if cfg.kind == "clip" else None
        self.pre_norm_b = param((d,), (EMBED,)) if cfg.kind == "clip" else None
        self.post_norm_w = param((d,), (EMBED,)) if cfg.post_norm else None
        self.post_norm_b = param((d,), (EMBED,)) if cfg.post_norm else None
        self.layers = VisionLayers(d, f, n)

    def __call__(self, pixels: jax.Array, dtype) -> jax.Array:
        """pixels f32[B, 3, H, W] -> the feature layers' hidden states concatenated, [B, N, D * len(feature_layers)]
        (N: patches, plus the class token's row first where the tower has one; the last layer's post-normed where
        the tower has a post-norm)."""
        cfg = self.cfg
        p = cfg.patch_size
        b, c, h, w = pixels.shape
        h, w = h // p * p, w // p * p  # a "valid" convolution: pixels past the last whole patch are left out
        patches = pixels[:, :, :h, :w].astype(dtype).reshape(b, c, h // p, p, w // p, p)
        patches = patches.transpose(0, 2, 4, 1, 3, 5).reshape(b, (h // p) * (w // p), c * p * p)      # [B,N,3pp]
        weight = self.patch_w.get_value()
        x = _dense(patches, weight.reshape(weight.shape[0], -1),
                   None if self.patch_b is None else self.patch_b.get_value())                          # [B,N,D]
        if self.class_embedding is not None:
            cls = jnp.broadcast_to(self.class_embedding.get_value().astype(dtype), (b, 1, x.shape[-1]))
            x = jnp.concatenate([cls, x], axis=1)
        x = x + self.position_embedding.get_value().astype(dtype)[None]
        if self.pre_norm_w is not None:
            x = layer_norm(x, self.pre_norm_w.get_value(), self.pre_norm_b.get_value(), cfg.layer_norm_eps)
        act = _activation(cfg.activation)
        heads = cfg.num_heads
        first = x
        only_ends = all(i in (0, cfg.num_layers) for i in cfg.feature_layers)  # no layer's output kept but the last

        def layer(x, lw):
            h = layer_norm(x, lw["norm1_w"], lw["norm1_b"], cfg.layer_norm_eps)
            q, k, v = (_dense(h, lw[f"w{n}"], lw[f"b{n}"]).reshape(*h.shape[:-1], heads, -1)
                       for n in "qkv")                                                             # [B,N,H,hd]
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
            probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
            out = jnp.einsum("bhqk,bkhd->bqhd", probs, v, preferred_element_type=jnp.float32).astype(x.dtype)
            x = x + _dense(out.reshape(x.shape), lw["wo"], lw["bo"])
            h = layer_norm(x, lw["norm2_w"], lw["norm2_b"], cfg.layer_norm_eps)
            x = x + _dense(act(_dense(h, lw["fc1_w"], lw["fc1_b"])), lw["fc2_w"], lw["fc2_b"])
            return x, None if only_ends else x

        stacked = {name: getattr(self.layers, name).get_value() for name in VisionLayers.NAMES}
        x, every = jax.lax.scan(layer, x, stacked)                                            # every: [L,B,N,D]
        if self.post_norm_w is not None:  # the only feature layer is the last (VisionConfig checks)
            x = layer_norm(x, self.post_norm_w.get_value(), self.post_norm_b.get_value(), cfg.layer_norm_eps)

        def state(i: int) -> jax.Array:
            return first if i == 0 else x if i == cfg.num_layers else every[i - 1]

        return jnp.concatenate([state(i) for i in cfg.feature_layers], axis=-1)


class VisionLayers(nnx.Module):
    """The encoder layers' weights, stacked [L, ...] (checkpoint layout: matmul weights [out, in])."""

    NAMES = ("norm1_w", "norm1_b", "norm2_w", "norm2_b", "wq", "bq", "wk", "bk", "wv", "bv", "wo", "bo",
             "fc1_w", "fc1_b", "fc2_w", "fc2_b")

    def __init__(self, d: int, f: int, n: int):
        vec, mat = ((n, d), (LAYERS, EMBED)), ((n, d, d), (LAYERS, EMBED, WIDE))
        for name in ("norm1_w", "norm1_b", "norm2_w", "norm2_b", "bq", "bk", "bv", "bo", "fc2_b"):
            setattr(self, name, param(*vec))
        for name in ("wq", "wk", "wv", "wo"):
            setattr(self, name, param(*mat))
        self.fc1_w = param((n, f, d), (LAYERS, WIDE, EMBED))
        self.fc1_b = param((n, f), (LAYERS, WIDE))
        self.fc2_w = param((n, d, f), (LAYERS, EMBED, WIDE))


class Projector(nnx.Module):
    """LLaVA's multi-modal projector: linear, activation, linear (into the text model's width)."""

    def __init__(self, cfg: VisionConfig, text_width: int):
        d_in = cfg.hidden_size * len(cfg.feature_layers)
        self.activation = cfg.projector_activation
        self.w1 = param((text_width, d_in), (EMBED, WIDE))
        self.b1 = param((text_width,), (EMBED,)) if cfg.projector_bias else None
        self.w2 = param((text_width, text_width), (EMBED, WIDE))
        self.b2 = param((text_width,), (EMBED,)) if cfg.projector_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        bias = lambda b: None if b is None else b.get_value()
        h = _activation(self.activation)(_dense(x, self.w1.get_value(), bias(self.b1)))
        return _dense(h, self.w2.get_value(), bias(self.b2))
