"""Qwen3-MoE and OLMoE: Qwen3's attention with q/k RMSNorms (per head in Qwen3-MoE; over the whole q / k
projection in OLMoE: ModelConfig.qk_norm_full) and a sparse-MoE MLP (models/moe.py) under the same checkpoint
names (mlp.gate, mlp.experts.{e}.gate_proj / up_proj / down_proj)."""
from __future__ import annotations

from slipstream.models.moe import moe_weights
from slipstream.models.qwen3 import QK_NORMS
from slipstream.models.llama import Llama, llama_weights


class Qwen3Moe(Llama):
    WEIGHTS = llama_weights((*QK_NORMS, *moe_weights("mlp.", "gate_proj", "up_proj", "down_proj")))
