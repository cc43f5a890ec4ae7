"""A GGUF file's metadata as a ModelConfig: llama.cpp's keys per architecture (llama, qwen2, qwen3, gemma3, phi3 and
the MoE qwen3moe, olmoe, llama with experts), with what this server does not run refused by the key that asks for it."""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from slipstream.models.config import MOE_ARCHITECTURES, ModelConfig
from slipstream.models.rope_config import RopeScaling, yarn_context, yarn_mscale

# GGUF general.architecture -> ours (a "llama" file with experts is Mixtral)
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "olmoe": "olmoe",
                      "gemma3": "gemma3", "phi3": "phi3"}
# whether llama.cpp renormalises the top-k router weights, where the file has no {arch}.expert_weights_norm:
# its converter writes none for these, and its graph fixes the choice per architecture
GGUF_NORM_TOPK = {"llama": True, "qwen3moe": True, "olmoe": False}


def config_from_gguf(meta: Mapping[str, Any], *, has_output_tensor: bool,
                     rope_factors: tuple[Sequence[float], Sequence[float]] | None = None) -> ModelConfig:
    """The ModelConfig of a GGUF file's metadata. rope_factors: the file's rope_factors_short / rope_factors_long
    tensors (Phi-3's LongRoPE), if any."""
    arch = meta.get("general.architecture")

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata is missing {arch}.{key}")
        return value

    moe = _gguf_moe_fields(meta, arch)  # first: an MoE file of an unsupported kind is refused by what it has
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}"
                         " (other architectures load from an HF directory)")
    ours = "mixtral" if arch == "llama" and moe else GGUF_ARCHITECTURES[arch]
    if ours in MOE_ARCHITECTURES and not moe:
        raise ValueError(f"GGUF metadata is missing {arch}.expert_count ({arch} is a mixture of experts)")
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
    eos = meta.get("tokenizer.ggml.eos_token_id")
    fields = dict(
        architecture=ours,
        num_layers=int(get("block_count")),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(meta.get(f"{arch}.attention.key_length") or hidden // heads),
        # an MoE file may leave out the dense width (its layers have none)
        intermediate_size=int(get("feed_forward_length", moe.get("moe_intermediate_size"))),
        vocab_size=int(vocab),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(meta, arch),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings=not has_output_tensor,
        attention_bias=arch == "qwen2",
        qk_norm=arch in ("qwen3", "qwen3moe", "olmoe"),
        qk_norm_full=arch == "olmoe",
        max_position_embeddings=int(get("context_length", 2048)),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        **moe,
    )
    if arch == "gemma3":
        fields.update(_gguf_gemma3_fields(meta, arch, hidden // heads))
    if arch == "phi3":
        fields.update(_gguf_phi3_fields(meta, arch, fields, rope_factors))
    return ModelConfig(**yarn_context(fields))


def _gguf_gemma3_fields(meta: Mapping[str, Any], arch: str, hidden_per_head: int) -> dict:
    """Gemma 3 as llama.cpp reads its files: every sliding_window_pattern-th layer global (6 where the file gives no
    pattern; llama.cpp also takes a list of per-layer flags, true: sliding), sliding layers on rope.freq_base_swa
    (10000 where absent), the attention scale from the model size (27B: hidden / heads, else head_dim: the
    query_pre_attn_scalar of Gemma 3's checkpoints), GeGLU, tied embeddings scaled by sqrt(hidden)."""
    n = int(meta[f"{arch}.block_count"])
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", 6)
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != n:
            raise ValueError(f"GGUF {arch}.attention.sliding_window_pattern lists {len(pattern)} layers, expected {n}")
        kinds = tuple("sliding" if flag else "full" for flag in pattern)
    else:  # llama.cpp's set_swa_pattern: 0 every layer sliding, 1 none
        pattern = int(pattern)
        kinds = tuple("sliding" if pattern == 0 or i % pattern < pattern - 1 else "full" for i in range(n))
    window = meta.get(f"{arch}.attention.sliding_window")
    if window is None and "sliding" in kinds:
        raise ValueError(f"GGUF metadata is missing {arch}.attention.sliding_window")
    if meta.get(f"{arch}.attn_logit_softcapping"):
        raise ValueError(f"GGUF {arch}.attn_logit_softcapping is not supported (Gemma 2 style); Gemma 3 files "
                         "have none")
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden_per_head)
    cap = meta.get(f"{arch}.final_logit_softcapping")
    return dict(layer_types=kinds, sliding_window=int(window) if window else None, qk_norm=True,
                rope_local_theta=float(meta.get(f"{arch}.rope.freq_base_swa") or 10000.0),
                rope_theta=float(meta.get(f"{arch}.rope.freq_base") or 1e6), hidden_activation="gelu_tanh",
                query_pre_attn_scalar=float(hidden_per_head if n == 62 else head_dim),
                final_logit_softcap=float(cap) if cap else None,
                rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon") or 1e-6))


def _gguf_phi3_fields(meta: Mapping[str, Any], arch: str, fields: dict, rope_factors) -> dict:
    """Phi-3 / Phi-4-mini as llama.cpp's converter writes them: RoPE on rope.dimension_count of each head, LongRoPE
    as two factor tensors with its attention factor in rope.scaling.attn_factor (no scaling type), no window when
    sliding_window is 0 (Phi-4) or past the context."""
    rotary = int(meta.get(f"{arch}.rope.dimension_count") or fields["head_dim"])
    window = int(meta.get(f"{arch}.attention.sliding_window") or 0)
    context = fields["max_position_embeddings"]
    out = dict(partial_rotary_factor=rotary / fields["head_dim"],
               sliding_window=window if 0 < window < context else None)
    if rope_factors is not None:
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original is None:
            raise ValueError(f"GGUF metadata is missing {arch}.rope.scaling.original_context_length (LongRoPE)")
        short, long = (tuple(float(v) for v in f) for f in rope_factors)
        out["rope_scaling"] = RopeScaling(
            kind="longrope", factor=context / int(original), original_max_position=int(original),
            attention_factor=float(meta.get(f"{arch}.rope.scaling.attn_factor") or 1.0),
            short_factor=short, long_factor=long, long=context > int(original))
    return out


def _gguf_rope_scaling(meta: Mapping[str, Any], arch: str) -> RopeScaling | None:
    """{arch}.rope.scaling.* as llama.cpp's converter writes them: linear, or YaRN with its original context and
    optional betas. What llama.cpp would apply and transformers has no field for is refused by its key."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    key = f"{arch}.rope.scaling."
    if kind not in ("linear", "yarn"):
        raise ValueError(f"GGUF {key}type {kind!r} is not supported; supported: linear, yarn")
    if meta.get(key + "factor") is None:
        raise ValueError(f"GGUF metadata is missing {key}factor (rope scaling {kind})")
    factor = float(meta[key + "factor"])
    if kind == "linear":
        return RopeScaling(kind="linear", factor=factor)
    defaults = {"attn_factor": 1.0, "yarn_attn_factor": 1.0, "yarn_ext_factor": 1.0, "yarn_log_multiplier": 0.0}
    for name, default in defaults.items():
        value = meta.get(key + name)
        if value is not None and not math.isclose(float(value), default) and not (name == "yarn_ext_factor"
                                                                                  and float(value) < 0):  # unset
            raise ValueError(f"GGUF {key}{name} {value} is not supported; supported: {default} (YaRN as "
                             "transformers computes it from factor and original_context_length)")
    original = meta.get(key + "original_context_length") or meta.get(f"{arch}.context_length")  # llama.cpp's default
    if original is None:
        raise ValueError(f"GGUF metadata is missing {key}original_context_length (rope scaling yarn)")
    return RopeScaling(kind="yarn", factor=factor, original_max_position=int(original),
                       beta_fast=float(meta.get(key + "yarn_beta_fast") or 32.0),
                       beta_slow=float(meta.get(key + "yarn_beta_slow") or 1.0), attention_factor=yarn_mscale(factor))


def _gguf_moe_fields(meta: Mapping[str, Any], arch: str) -> dict:
    """The sparse-MoE fields of a GGUF file ({} without {arch}.expert_count): Qwen3-MoE (qwen3moe), Mixtral (llama)
    and OLMoE (olmoe) as llama.cpp's converter writes them. Refused by name: shared experts (qwen2moe, deepseek2),
    a router other than softmax (sigmoid: deepseek2, llama4), scaled router weights and leading dense layers."""
    experts = int(meta.get(f"{arch}.expert_count") or 0)
    if not experts:
        return {}
    # qwen2moe files give their one shared expert by its width only
    if meta.get(f"{arch}.expert_shared_count") or meta.get(f"{arch}.expert_shared_feed_forward_length"):
        raise ValueError(f"GGUF {arch}: shared experts are not supported (Qwen2-MoE / DeepSeek style); supported "
                         "MoE files: qwen3moe, olmoe, llama with experts (Mixtral)")
    gating = int(meta.get(f"{arch}.expert_gating_func") or 1)
    if gating != 1:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE: 1 softmax, 2 sigmoid
        raise ValueError(f"GGUF {arch}: expert_gating_func {gating} (2: sigmoid) is not supported; supported: "
                         "1 (softmax over the router's logits)")
    scale = float(meta.get(f"{arch}.expert_weights_scale") or 1.0)
    if scale != 1.0:
        raise ValueError(f"GGUF {arch}: expert_weights_scale {scale} is not supported; supported: 1.0")
    dense = int(meta.get(f"{arch}.leading_dense_block_count") or 0)
    step = int(meta.get(f"{arch}.moe_every_n_layers") or meta.get(f"{arch}.interleave_moe_layer_step") or 1)
    if dense or step != 1:
        raise ValueError(f"GGUF {arch}: some layers have a dense MLP (leading_dense_block_count {dense}, an MoE layer "
                         f"every {step}); Slipstream serves MoE files whose every layer is sparse")
    norm = meta.get(f"{arch}.expert_weights_norm", GGUF_NORM_TOPK.get(arch, False))
    # Mixtral and OLMoE files give the experts' width as feed_forward_length (they have no other MLP)
    width = meta.get(f"{arch}.expert_feed_forward_length") or meta.get(f"{arch}.feed_forward_length")
    used = meta.get(f"{arch}.expert_used_count")
    for key, value in (("expert_feed_forward_length", width), ("expert_used_count", used)):
        if value is None:
            raise ValueError(f"GGUF metadata is missing {arch}.{key}")
    return dict(num_experts=experts, num_experts_per_tok=int(used), moe_intermediate_size=int(width),
                norm_topk_prob=bool(norm))
