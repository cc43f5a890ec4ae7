"""Gemma 3 (text; an HF directory or a gemma3 GGUF): embeddings scaled by sqrt(hidden); (1 + w) RMSNorms, also on
q/k and after the attention and the MLP ("sandwich" norms); local sliding-window and global layers interleaved, each
kind with its own RoPE base; GeGLU; tied embeddings; optional final logit soft-capping."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from slipstream.models import layers
from slipstream.models.base import CausalLM, Weight
from slipstream.models.config import ModelConfig

_HF, _GG = "model.layers.{i}.", "blk.{i}."  # GGUF: llama.cpp's names; its norm weights hold 1 + w (models/loader.py)


class Gemma3Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, layers_: int):
        norm = dict(eps=cfg.rms_norm_eps, layers=layers_, offset=1.0)
        d = cfg.hidden_size
        self.attn_norm = layers.RMSNorm(d, **norm)
        self.post_attn_norm = layers.RMSNorm(d, **norm)
        self.pre_mlp_norm = layers.RMSNorm(d, **norm)
        self.post_mlp_norm = layers.RMSNorm(d, **norm)
        self.attn = layers.Attention(cfg, layers=layers_, norm_offset=1.0)
        self.mlp = layers.GatedMLP(cfg, layers=layers_)

    def __call__(self, x: jax.Array, positions: jax.Array, attend: layers.AttentionOp, cache: Any,
                 layer: jax.Array, kinds: layers.LayerKinds) -> tuple[jax.Array, Any]:
        sliding = kinds.sliding(layer)
        h, cache = self.attn(self.attn_norm(x), positions, kinds.inv_freq(sliding), attend, cache, layer, sliding,
                             kinds.rope_scale(sliding))
        x = x + self.post_attn_norm(h)
        return x + self.post_mlp_norm(self.mlp(self.pre_mlp_norm(x))), cache           # [T,D]


class Gemma3(CausalLM):
    WEIGHTS = (
        Weight("embed.table", "model.embed_tokens.weight", "token_embd.weight"),
        Weight("final_norm.w", "model.norm.weight", "output_norm.weight"),
        Weight("blocks.attn_norm.w", _HF + "input_layernorm.weight", _GG + "attn_norm.weight"),
        Weight("blocks.post_attn_norm.w", _HF + "post_attention_layernorm.weight", _GG + "post_attention_norm.weight"),
        Weight("blocks.pre_mlp_norm.w", _HF + "pre_feedforward_layernorm.weight", _GG + "ffn_norm.weight"),
        Weight("blocks.post_mlp_norm.w", _HF + "post_feedforward_layernorm.weight", _GG + "post_ffw_norm.weight"),
        Weight("blocks.attn.wq.w", _HF + "self_attn.q_proj.weight", _GG + "attn_q.weight", linear=True),
        Weight("blocks.attn.wk.w", _HF + "self_attn.k_proj.weight", _GG + "attn_k.weight", linear=True),
        Weight("blocks.attn.wv.w", _HF + "self_attn.v_proj.weight", _GG + "attn_v.weight", linear=True),
        Weight("blocks.attn.wo.w", _HF + "self_attn.o_proj.weight", _GG + "attn_output.weight", linear=True),
        Weight("blocks.attn.q_norm.w", _HF + "self_attn.q_norm.weight", _GG + "attn_q_norm.weight"),
        Weight("blocks.attn.k_norm.w", _HF + "self_attn.k_norm.weight", _GG + "attn_k_norm.weight"),
        Weight("blocks.mlp.w_gate.w", _HF + "mlp.gate_proj.weight", _GG + "ffn_gate.weight", linear=True),
        Weight("blocks.mlp.w_up.w", _HF + "mlp.up_proj.weight", _GG + "ffn_up.weight", linear=True),
        Weight("blocks.mlp.w_down.w", _HF + "mlp.down_proj.weight", _GG + "ffn_down.weight", linear=True),
        Weight("lm_head.w", "lm_head.weight", "output.weight", linear=True),
    )

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.embed = layers.Embed(cfg.vocab_size, cfg.hidden_size)
        self.blocks = Gemma3Block(cfg, layers_=cfg.num_layers)
        self.final_norm = layers.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=1.0)
        # tied: None, a data slot the engine may fill with int8 rows of the embedding
        self.lm_head = nnx.data(None) if cfg.tie_embeddings else layers.Linear(
            cfg.hidden_size, cfg.vocab_size, ("embed", "vocab"))

    def embed_tokens(self, tokens, dtype):
        # HF multiplies by sqrt(hidden) rounded to the activation dtype
        return self.embed(tokens, dtype) * jnp.asarray(self.cfg.hidden_size ** 0.5, dtype)

    def block(self, blk, x, positions, attend, cache, layer):
        return blk(x, positions, attend, cache, layer, layers.LayerKinds(self.cfg))
