"""Llama family as an NNX module tree: Llama 1-3.x (RoPE scaling), SmolLM2, Mistral (sliding window),
Qwen2 (q/k/v bias); with ModelConfig.num_experts a sparse-MoE MLP (models/moe.py: Mixtral, Qwen3-MoE, OLMoE).
Pre-norm blocks: x += attn(norm(x)); x += swiglu(norm(x))."""
from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from slipstream.models import layers, moe
from slipstream.models.base import CausalLM, Weight
from slipstream.models.config import ModelConfig


def llama_weights(extra: tuple[Weight, ...] = ()) -> tuple[Weight, ...]:
    """The Llama layout's weights; `extra` adds an architecture's own (e.g. Qwen3's q/k norms)."""
    hf, gg = "model.layers.{i}.", "blk.{i}."
    return (
        Weight("embed.table", "model.embed_tokens.weight", "token_embd.weight"),
        Weight("final_norm.w", "model.norm.weight", "output_norm.weight"),
        Weight("lm_head.w", "lm_head.weight", "output.weight", linear=True),  # absent: tied
        Weight("blocks.attn_norm.w", hf + "input_layernorm.weight", gg + "attn_norm.weight"),
        Weight("blocks.mlp_norm.w", hf + "post_attention_layernorm.weight", gg + "ffn_norm.weight"),
        Weight("blocks.attn.wq.w", hf + "self_attn.q_proj.weight", gg + "attn_q.weight", linear=True, rope_permute="q"),
        Weight("blocks.attn.wk.w", hf + "self_attn.k_proj.weight", gg + "attn_k.weight", linear=True, rope_permute="k"),
        Weight("blocks.attn.wv.w", hf + "self_attn.v_proj.weight", gg + "attn_v.weight", linear=True),
        Weight("blocks.attn.wo.w", hf + "self_attn.o_proj.weight", gg + "attn_output.weight", linear=True),
        Weight("blocks.attn.wq.b", hf + "self_attn.q_proj.bias", gg + "attn_q.bias", rope_permute="q"),
        Weight("blocks.attn.wk.b", hf + "self_attn.k_proj.bias", gg + "attn_k.bias", rope_permute="k"),
        Weight("blocks.attn.wv.b", hf + "self_attn.v_proj.bias", gg + "attn_v.bias"),
        Weight("blocks.mlp.w_gate.w", hf + "mlp.gate_proj.weight", gg + "ffn_gate.weight", linear=True),
        Weight("blocks.mlp.w_up.w", hf + "mlp.up_proj.weight", gg + "ffn_up.weight", linear=True),
        Weight("blocks.mlp.w_down.w", hf + "mlp.down_proj.weight", gg + "ffn_down.weight", linear=True),
        *extra,
    )


class LlamaBlock(nnx.Module):
    """One decoder layer (all layers' weights stacked [L, ...])."""

    def __init__(self, cfg: ModelConfig, *, layers_: int):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.attn_norm = layers.RMSNorm(d, eps, layers=layers_)
        self.attn = layers.Attention(cfg, layers=layers_)
        self.mlp_norm = layers.RMSNorm(d, eps, layers=layers_)
        self.mlp = moe.SparseMoE(cfg, layers_=layers_) if cfg.num_experts else layers.GatedMLP(cfg, layers=layers_)

    def __call__(self, x: jax.Array, positions: jax.Array, attend: layers.AttentionOp, cache: Any,
                 layer: jax.Array, kinds: layers.LayerKinds) -> tuple[jax.Array, Any]:
        sliding = kinds.sliding(layer)
        h, cache = self.attn(self.attn_norm(x), positions, kinds.inv_freq(sliding), attend, cache, layer, sliding,
                             kinds.rope_scale(sliding))
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), cache                                  # [T,D]


class Llama(CausalLM):
    WEIGHTS = llama_weights()

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.embed = layers.Embed(cfg.vocab_size, cfg.hidden_size)
        self.blocks = LlamaBlock(cfg, layers_=cfg.num_layers)
        self.final_norm = layers.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # tied: None, a data slot the engine may fill with int8 rows of the embedding
        self.lm_head = nnx.data(None) if cfg.tie_embeddings else layers.Linear(
            cfg.hidden_size, cfg.vocab_size, ("embed", "vocab"))

    def block(self, blk, x, positions, attend, cache, layer):
        return blk(x, positions, attend, cache, layer, layers.LayerKinds(self.cfg))
