"""Phi-3 / Phi-4-mini: the Llama layout with q/k/v in one fused projection and gate/up in another, split on load
into the Llama modules (a checkpoint name "name[q]" is that part of the fused tensor's rows, models/loader.py), so
quantization and tensor parallelism see plain q/k/v and gate/up weights. Partial rotary (Phi-4-mini) and LongRoPE
come from the config (models/layers.py)."""
from __future__ import annotations

from slipstream.models.base import Weight
from slipstream.models.llama import Llama

_HF, _GG = "model.layers.{i}.", "blk.{i}."
_QKV, _GATE_UP = (_HF + "self_attn.qkv_proj.weight", _GG + "attn_qkv.weight"), (_HF + "mlp.gate_up_proj.weight",
                                                                                  _GG + "ffn_up.weight")


def _part(names: tuple[str, str], part: str) -> tuple[str, str]:
    return names[0] + f"[{part}]", names[1] + f"[{part}]"


class Phi3(Llama):
    WEIGHTS = (
        Weight("embed.table", "model.embed_tokens.weight", "token_embd.weight"),
        Weight("final_norm.w", "model.norm.weight", "output_norm.weight"),
        Weight("lm_head.w", "lm_head.weight", "output.weight", linear=True),  # absent: tied (Phi-4-mini)
        Weight("blocks.attn_norm.w", _HF + "input_layernorm.weight", _GG + "attn_norm.weight"),
        Weight("blocks.mlp_norm.w", _HF + "post_attention_layernorm.weight", _GG + "ffn_norm.weight"),
        Weight("blocks.attn.wq.w", *_part(_QKV, "q"), linear=True),
        Weight("blocks.attn.wk.w", *_part(_QKV, "k"), linear=True),
        Weight("blocks.attn.wv.w", *_part(_QKV, "v"), linear=True),
        Weight("blocks.attn.wo.w", _HF + "self_attn.o_proj.weight", _GG + "attn_output.weight", linear=True),
        Weight("blocks.mlp.w_gate.w", *_part(_GATE_UP, "gate"), linear=True),
        Weight("blocks.mlp.w_up.w", *_part(_GATE_UP, "up"), linear=True),
        Weight("blocks.mlp.w_down.w", _HF + "mlp.down_proj.weight", _GG + "ffn_down.weight", linear=True),
    )
