"""Qwen3: the Llama layout without q/k/v bias, with an RMSNorm over head_dim on q and k before RoPE
(ModelConfig.qk_norm, built by models/layers.Attention)."""
from __future__ import annotations

from slipstream.models.base import Weight
from slipstream.models.llama import Llama, llama_weights

QK_NORMS = (
    Weight("blocks.attn.q_norm.w", "model.layers.{i}.self_attn.q_norm.weight", "blk.{i}.attn_q_norm.weight"),
    Weight("blocks.attn.k_norm.w", "model.layers.{i}.self_attn.k_norm.weight", "blk.{i}.attn_k_norm.weight"),
)


class Qwen3(Llama):
    WEIGHTS = llama_weights(QK_NORMS)
