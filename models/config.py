"""Model configuration: one frozen dataclass built from an HF config.json or GGUF metadata.

`architecture` picks the module tree (models/architectures.py); the differences inside a family
(Llama 2/3, Mistral, Qwen2, SmolLM2; Gemma 3's two layer kinds) are fields here.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

# RopeScaling and ROPE_KINDS are read from here too (models/layers.py, tests)
from slipstream.models.rope_config import ROPE_KINDS, RopeScaling, rope_scaling_from_hf, yarn_context  # noqa: F401


# HF "architectures" entries and model_type values -> our architecture names
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                    "Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3", "Qwen3MoeForCausalLM": "qwen3_moe",
                    "MixtralForCausalLM": "mixtral", "OlmoeForCausalLM": "olmoe", "Phi3ForCausalLM": "phi3"}
HF_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3",
                  "qwen3_moe": "qwen3_moe", "mixtral": "mixtral", "olmoe": "olmoe", "phi3": "phi3"}
MOE_ARCHITECTURES = ("qwen3_moe", "mixtral", "olmoe")
LAYER_KINDS = ("full", "sliding")
# HF architectures that pair a vision tower with one of our text models (models/llava.py, models/idefics3.py)
VISION_LANGUAGE = {"LlavaForConditionalGeneration": "llava", "Idefics3ForConditionalGeneration": "idefics3",
                   "SmolVLMForConditionalGeneration": "idefics3"}
# Idefics3's and SmolVLM's model_type (a config.json without architectures)
_IDEFICS3_TYPES = ("idefics3", "smolvlm")
# their tower's model_type (a SigLIP with a post-norm) and Idefics3VisionConfig's defaults
_IDEFICS3_TOWERS = ("idefics3_vision", "smolvlm_vision", "idefics3", "smolvlm")
_IDEFICS3_VISION_DEFAULTS = dict(hidden_size=1152, intermediate_size=3072, num_hidden_layers=12,
                                 num_attention_heads=16, image_size=224, patch_size=32,
                                 hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)
# vision towers: HF vision_config model_type -> ours
VISION_TOWERS = {"clip_vision_model": "clip", "siglip_vision_model": "siglip"}
VISION_ACTIVATIONS = {"quick_gelu": "quick_gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
# transformers' LlamaConfig defaults: llava-1.5's config.json leaves them out of its text_config
_LLAMA_DEFAULTS = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                       vocab_size=32000, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2)
# and CLIPVisionConfig's (its vision_config leaves these out)
_CLIP_DEFAULTS = dict(hidden_act="quick_gelu", layer_norm_eps=1e-5)


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionConfig:
    """A vision tower (a ViT: CLIP or SigLIP) and the projector that maps its features into the text model's
    embedding space (LLaVA's two-layer MLP; Idefics3's pixel shuffle and a linear when scale_factor > 1). Only the
    layers up to the deepest feature layer are built and run."""

    kind: str                        # "clip" (a class token, a pre-norm) or "siglip"
    hidden_size: int
    intermediate_size: int
    num_heads: int
    image_size: int                  # square input, pixels
    patch_size: int
    num_layers: int                  # layers run: up to the deepest of feature_layers
    feature_layers: tuple[int, ...]  # hidden states concatenated as the features (0: the embeddings' output)
    drop_cls: bool = True            # "default" feature selection: the class token's row is dropped
    layer_norm_eps: float = 1e-5
    activation: str = "quick_gelu"   # of the tower's MLP: quick_gelu, gelu_tanh or gelu
    projector_activation: str = "gelu"
    projector_bias: bool = True
    post_norm: bool = False          # the last layer's output through the tower's post_layernorm (Idefics3)
    scale_factor: int = 1            # Idefics3's pixel shuffle: each s x s block of patches one row, s*s wider

    def __post_init__(self) -> None:
        if self.kind not in VISION_TOWERS.values():
            raise ValueError(f"vision tower {self.kind!r} is not supported; supported: {', '.join(VISION_TOWERS)}")
        for name in ("hidden_size", "intermediate_size", "num_heads", "image_size", "patch_size", "num_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"vision config {name} must be a positive integer, got {value!r}")
        # an image_size that is not a multiple of patch_size leaves its last pixels out of every patch (a "valid"
        # convolution: SmolVLM-Instruct's 384 px in 14 px patches are 27 a side)
        if self.image_size < self.patch_size or self.hidden_size % self.num_heads:
            raise ValueError(f"vision config: image_size {self.image_size} must be at least patch_size "
                             f"{self.patch_size}, and hidden_size {self.hidden_size} a multiple of num_heads "
                             f"{self.num_heads}")
        if not self.feature_layers or max(self.feature_layers) != self.num_layers or min(self.feature_layers) < 0:
            raise ValueError(f"vision config: feature_layers {self.feature_layers} must be hidden-state indices "
                             f"whose deepest is num_layers ({self.num_layers})")
        for name in ("activation", "projector_activation"):
            if getattr(self, name) not in VISION_ACTIVATIONS.values():
                raise ValueError(f"vision config {name} {getattr(self, name)!r} is not supported; supported: "
                                 f"{', '.join(VISION_ACTIVATIONS)}")
        side = self.image_size // self.patch_size
        if not isinstance(self.scale_factor, int) or self.scale_factor < 1 or side % self.scale_factor:
            raise ValueError(f"vision config: scale_factor {self.scale_factor!r} must be a positive integer dividing "
                             f"the {side} patches of an image's side")
        if self.scale_factor > 1 and (self.class_token or self.feature_layers != (self.num_layers,)):
            raise ValueError("vision config: a pixel shuffle (scale_factor > 1) takes a SigLIP tower's last layer")
        if self.post_norm and self.feature_layers != (self.num_layers,):
            raise ValueError("vision config: post_norm normalizes the last layer's output: feature_layers must be "
                             f"({self.num_layers},)")
        if self.drop_cls and not self.class_token:
            raise ValueError("vision_feature_select_strategy 'default' drops the class token, which a SigLIP tower "
                             "does not have: use 'full'")

    @property
    def class_token(self) -> bool:
        return self.kind == "clip"

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_image_tokens(self) -> int:
        """Rows an image fills in the prompt: its features' rows (after the pixel shuffle)."""
        return (self.num_patches + self.class_token - self.drop_cls) // self.scale_factor ** 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    architecture: str = "llama"           # a key of models.architectures.ARCHITECTURES
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    partial_rotary_factor: float = 1.0     # RoPE on the first head_dim * this dimensions (Phi-4-mini: 0.75)
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    attention_bias: bool = False          # Qwen2: bias on q/k/v projections
    sliding_window: int | None = None     # Mistral: attend to the last N positions only
    # per layer "full" or "sliding" (Gemma 3 interleaves them); empty: every layer sliding when
    # sliding_window is set, else full
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (Gemma 3), unscaled
    qk_norm: bool = False                  # RMSNorm over head_dim on q and k (Qwen3, Gemma 3)
    qk_norm_full: bool = False             # with qk_norm: over the whole q / k projection, not per head (OLMoE)
    # sparse mixture of experts in every layer's MLP (0: a dense gated MLP): each token's num_experts_per_tok
    # experts of the router's softmax, weighted by their probabilities (renormalised over the chosen ones
    # when norm_topk_prob); each expert a gated MLP of moe_intermediate_size
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    hidden_activation: str = "silu"        # of the gated MLP: silu (SwiGLU) or gelu_tanh (GeGLU)
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (default head_dim)
    final_logit_softcap: float | None = None    # logits = cap * tanh(logits / cap)
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # a vision-language model (architecture "llava" or "idefics3"): its tower and projector, and the prompt's image
    # placeholder
    vision: VisionConfig | None = None
    image_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model config {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not (0 < self.partial_rotary_factor <= 1) or self.rotary_dim % 2 or not self.rotary_dim:
            raise ValueError(f"partial_rotary_factor must be in (0, 1] and rotate an even number of head_dim's "
                             f"{self.head_dim} dimensions, got {self.partial_rotary_factor}")
        rs = self.rope_scaling
        if rs is not None and rs.kind == "longrope" and len(rs.short_factor) != self.rotary_dim // 2:
            raise ValueError(f"longrope short_factor and long_factor need one entry per rotated pair ("
                             f"{self.rotary_dim // 2}), got {len(rs.short_factor)}")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ValueError(f"rope_theta must be a positive number, got {self.rope_theta}")
        if not (0 < self.rms_norm_eps < 1):
            raise ValueError(f"rms_norm_eps must be in (0, 1), got {self.rms_norm_eps}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if not self.layer_types:
            kind = "sliding" if self.sliding_window else "full"
            object.__setattr__(self, "layer_types", (kind,) * self.num_layers)
        if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(LAYER_KINDS):
            raise ValueError(f"layer_types must list {self.num_layers} entries of {LAYER_KINDS}, "
                             f"got {self.layer_types!r}")
        if "sliding" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding layers need a sliding_window")
        if self.hidden_activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"hidden_activation must be silu or gelu_tanh, got {self.hidden_activation!r}")
        if self.num_experts < 0:
            raise ValueError(f"num_experts must be >= 0 (0: dense MLPs), got {self.num_experts}")
        if self.num_experts and not (1 <= self.num_experts_per_tok <= self.num_experts
                                     and self.moe_intermediate_size >= 1):
            raise ValueError(f"a sparse MoE needs 1 <= num_experts_per_tok <= num_experts ({self.num_experts}) and "
                             f"moe_intermediate_size >= 1, got {self.num_experts_per_tok} and "
                             f"{self.moe_intermediate_size}")
        if (self.vision is None) != (self.image_token_id is None):
            raise ValueError("a vision-language model needs both a vision config and an image token id")

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def sm_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def for_context(self, max_seq_len: int) -> "ModelConfig":
        """This config for sequences of at most max_seq_len tokens: LongRoPE's long factors only where that passes
        the original context, as llama.cpp picks them by its context size (transformers picks them per sequence, so
        a server of short contexts gives its logits with the short factors, and one of long contexts one set of
        frequencies for every key in the cache)."""
        rs = self.rope_scaling
        if rs is None or rs.kind != "longrope":
            return self
        long = max_seq_len > rs.original_max_position
        return dataclasses.replace(self, rope_scaling=dataclasses.replace(rs, long=long))

    def window(self, kind: str) -> int | None:
        return self.sliding_window if kind == "sliding" else None

    def rope(self, kind: str) -> tuple[float, RopeScaling | None]:
        """(base, scaling) of the RoPE of a layer kind."""
        if kind == "sliding" and self.rope_local_theta is not None:
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling

    # ---- constructors -------------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        names = cfg.get("architectures") or []
        if any(VISION_LANGUAGE.get(n) == "idefics3" for n in names) or (
                not names and cfg.get("model_type") in _IDEFICS3_TYPES):
            return _idefics3(cfg)
        if any(n in VISION_LANGUAGE for n in names) or cfg.get("model_type") in VISION_LANGUAGE.values():
            return _vision_language(cfg)
        arch = next((HF_ARCHITECTURES[n] for n in names if n in HF_ARCHITECTURES), None)
        if arch is None and not names:
            arch = HF_MODEL_TYPES.get(cfg.get("model_type", "llama"))
        if arch is None:
            named = names[0] if names else cfg.get("model_type")
            raise ValueError(f"architecture {named!r} is not supported; supported: "
                             f"{', '.join(HF_ARCHITECTURES)} (model_type {', '.join(HF_MODEL_TYPES)})")
        try:
            return cls(**_hf_fields(cfg, arch))
        except KeyError as e:
            raise ValueError(f"config.json is missing required field {e.args[0]!r}") from None

    @classmethod
    def from_hf_json(cls, path: str | os.PathLike) -> "ModelConfig":
        try:
            with open(path) as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf_dict(data)


def _hf_fields(cfg: Mapping[str, Any], arch: str) -> dict:
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    eos = cfg.get("eos_token_id")
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or rope
    if arch == "phi3" and (scaling.get("rope_type") or scaling.get("type")) in ("su", "yarn"):
        scaling = {**scaling, "rope_type": "longrope"}  # Phi-3's older names of LongRoPE (transformers reads them so)
    fields = dict(
        architecture=arch,
        num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rope_scaling=rope_scaling_from_hf(scaling, cfg),
        partial_rotary_factor=float(cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", arch == "gemma3")),
        attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
        sliding_window=cfg.get("sliding_window") or None,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        qk_norm=arch in ("qwen3", "gemma3"),
    )
    if arch in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window", False):
        fields["sliding_window"] = None
    if arch == "phi3" and (fields["sliding_window"] or 0) >= fields["max_position_embeddings"]:
        fields["sliding_window"] = None  # Phi-3.5 / Phi-4-mini: a window past the context is none
    if cfg.get("hidden_act", "silu") not in ("silu", "swish") and arch != "gemma3":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported for {arch}; supported: silu")
    if arch == "gemma3":
        fields.update(_gemma3_fields(cfg, rope))
    elif fields["sliding_window"] and cfg.get("layer_types"):
        fields["layer_types"] = _layer_kinds(cfg["layer_types"])
    if arch in MOE_ARCHITECTURES:
        fields.update(_moe_fields(cfg, arch))
    return yarn_context(fields)


def _vision_language(cfg: Mapping[str, Any]) -> ModelConfig:
    """LLaVA: a text model we serve (Llama, Mistral, Qwen2) after a CLIP or SigLIP tower and an MLP projector."""
    text = dict(cfg.get("text_config") or {})
    text_type = text.get("model_type", "llama")
    if text_type not in ("llama", "mistral", "qwen2"):
        raise ValueError(f"LLaVA text model {text_type!r} is not supported; supported: llama, mistral, qwen2")
    if text_type == "llama":
        text = {**_LLAMA_DEFAULTS, **text}
    text_arch = HF_MODEL_TYPES[text_type]
    vision = dict(cfg.get("vision_config") or {})
    kind = VISION_TOWERS.get(vision.get("model_type", "clip_vision_model"))
    if kind is None:
        raise ValueError(f"vision tower {vision.get('model_type')!r} is not supported; supported: "
                         f"{', '.join(VISION_TOWERS)}")
    if kind == "clip":
        vision = {**_CLIP_DEFAULTS, **vision}
    try:
        depth = int(vision["num_hidden_layers"])
        layer = cfg.get("vision_feature_layer", -2)
        indices = tuple(i % (depth + 1) for i in (layer if isinstance(layer, list) else [layer]))
        activation = vision.get("hidden_act", "gelu_pytorch_tanh")
        projector_act = cfg.get("projector_hidden_act", "gelu")
        for act in (activation, projector_act):
            if act not in VISION_ACTIVATIONS:
                raise ValueError(f"vision activation {act!r} is not supported; supported: "
                                 f"{', '.join(VISION_ACTIVATIONS)}")
        strategy = cfg.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported; supported: default, full")
        tower = VisionConfig(
            kind=kind, hidden_size=int(vision["hidden_size"]), intermediate_size=int(vision["intermediate_size"]),
            num_heads=int(vision["num_attention_heads"]), image_size=int(vision["image_size"]),
            patch_size=int(vision["patch_size"]), num_layers=max(indices), feature_layers=indices,
            drop_cls=strategy == "default", layer_norm_eps=float(vision.get("layer_norm_eps", 1e-6)),
            activation=VISION_ACTIVATIONS[activation], projector_activation=VISION_ACTIVATIONS[projector_act],
            projector_bias=bool(cfg.get("multimodal_projector_bias", True)))
        fields = _hf_fields(text, text_arch)
    except KeyError as e:
        raise ValueError(f"config.json is missing required field {e.args[0]!r}") from None
    image_token = cfg.get("image_token_id", cfg.get("image_token_index"))
    if image_token is None:
        raise ValueError("config.json is missing required field 'image_token_index' (LLaVA's image placeholder)")
    if cfg.get("tie_word_embeddings") is not None and "tie_word_embeddings" not in text:
        fields["tie_embeddings"] = bool(cfg["tie_word_embeddings"])
    return ModelConfig(**{**fields, "architecture": "llava"}, vision=tower, image_token_id=int(image_token))


def _idefics3(cfg: Mapping[str, Any]) -> ModelConfig:
    """Idefics3 / SmolVLM: a Llama text model (SmolLM2's, Llama 3's) after a SigLIP tower with a post-norm, whose
    last layer is pixel-shuffled by scale_factor and projected by one linear."""
    # transformers' defaults: LlamaConfig's for what text_config leaves out, and rms_norm_eps 1e-5 without one
    text = {**_LLAMA_DEFAULTS, **(cfg.get("text_config") or {"rms_norm_eps": 1e-5})}
    if text.get("model_type", "llama") != "llama":
        raise ValueError(f"Idefics3 text model {text['model_type']!r} is not supported; supported: llama")
    vision = {**_IDEFICS3_VISION_DEFAULTS, **(cfg.get("vision_config") or {})}
    if vision.get("model_type", "idefics3_vision") not in _IDEFICS3_TOWERS:
        raise ValueError(f"Idefics3 vision tower {vision['model_type']!r} is not supported; supported: "
                         f"{', '.join(_IDEFICS3_TOWERS[:2])}")
    activation = vision["hidden_act"]
    if activation not in VISION_ACTIVATIONS:
        raise ValueError(f"vision activation {activation!r} is not supported; supported: "
                         f"{', '.join(VISION_ACTIVATIONS)}")
    try:
        depth = int(vision["num_hidden_layers"])
        tower = VisionConfig(
            kind="siglip", hidden_size=int(vision["hidden_size"]), intermediate_size=int(vision["intermediate_size"]),
            num_heads=int(vision["num_attention_heads"]), image_size=int(vision["image_size"]),
            patch_size=int(vision["patch_size"]), num_layers=depth, feature_layers=(depth,), drop_cls=False,
            layer_norm_eps=float(vision["layer_norm_eps"]), activation=VISION_ACTIVATIONS[activation],
            projector_bias=False, post_norm=True, scale_factor=int(cfg.get("scale_factor", 2)))
        fields = _hf_fields(text, "llama")
    except KeyError as e:
        raise ValueError(f"config.json is missing required field {e.args[0]!r}") from None
    if cfg.get("tie_word_embeddings") is not None and "tie_word_embeddings" not in text:
        fields["tie_embeddings"] = bool(cfg["tie_word_embeddings"])
    return ModelConfig(**{**fields, "architecture": "idefics3"}, vision=tower,
                       image_token_id=int(cfg.get("image_token_id", 128257)))


def _moe_fields(cfg: Mapping[str, Any], arch: str) -> dict:
    """The sparse-MoE fields of Qwen3-MoE, Mixtral and OLMoE configs. Every layer must be sparse: a config
    that makes some layers dense (Qwen3-MoE's decoder_sparse_step / mlp_only_layers) is refused, as are
    shared experts (Qwen2-MoE style) and OLMoE's clip_qkv."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    n = int(cfg["num_hidden_layers"])
    step = int(cfg.get("decoder_sparse_step") or 1)
    only_dense = set(cfg.get("mlp_only_layers") or ())
    dense = [i for i in range(n) if i in only_dense or not (experts > 0 and (i + 1) % step == 0)]
    if dense:
        raise ValueError(f"{arch}: layers {dense} have a dense MLP (num_experts {experts}, decoder_sparse_step "
                         f"{step}, mlp_only_layers {sorted(only_dense)}); Slipstream serves MoE configs whose every "
                         "layer is sparse (decoder_sparse_step 1, mlp_only_layers [])")
    if cfg.get("shared_expert_intermediate_size") or cfg.get("n_shared_experts"):
        raise ValueError(f"{arch}: shared experts are not supported (Qwen2-MoE / DeepSeek style)")
    if cfg.get("clip_qkv") is not None:
        raise ValueError(f"{arch}: clip_qkv {cfg['clip_qkv']} is not supported (OLMoE-1B-7B leaves it null)")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{arch}: expert activation {act!r} is not supported; supported: silu")
    mixtral = arch == "mixtral"
    return dict(num_experts=experts, num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg["intermediate_size" if arch != "qwen3_moe" else "moe_intermediate_size"]),
                # Mixtral renormalises always (a softmax over the chosen logits)
                norm_topk_prob=True if mixtral else bool(cfg.get("norm_topk_prob", False)),
                qk_norm=not mixtral, qk_norm_full=arch == "olmoe")


def _layer_kinds(hf_types) -> tuple[str, ...]:
    kinds = {"full_attention": "full", "sliding_attention": "sliding"}
    unknown = sorted(set(hf_types) - set(kinds))
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported; supported: {', '.join(kinds)}")
    return tuple(kinds[t] for t in hf_types)


def _gemma3_fields(cfg: Mapping[str, Any], rope: Mapping[str, Any]) -> dict:
    """Gemma 3: two RoPEs (global layers scaled, sliding layers on their own base), layer kinds from
    layer_types or every sliding_window_pattern-th layer global, GeGLU, soft-capped logits."""
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping is not supported (Gemma 2 style); Gemma 3 configs leave it null")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not supported: Slipstream serves causal decoders")
    n = int(cfg["num_hidden_layers"])
    if cfg.get("layer_types"):
        kinds = _layer_kinds(cfg["layer_types"])
    else:
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        kinds = tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(n))
    if "full_attention" in rope:  # transformers 5: one RoPE per layer type
        full, local = rope["full_attention"], rope.get("sliding_attention") or {}
        theta, scaling = float(full.get("rope_theta", 1e6)), rope_scaling_from_hf(full, cfg)
        local_theta = float(local.get("rope_theta", 1e4))
    else:
        theta = float(cfg.get("rope_theta", 1e6))
        scaling = rope_scaling_from_hf(cfg.get("rope_scaling"), cfg)
        local_theta = float(cfg.get("rope_local_base_freq", 1e4))
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"Gemma 3 hidden_activation {act!r} is not supported; supported: gelu_pytorch_tanh")
    cap = cfg.get("final_logit_softcapping")
    return dict(layer_types=kinds, rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta,
                hidden_activation="gelu_tanh", query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256),
                final_logit_softcap=float(cap) if cap else None,
                sliding_window=int(cfg["sliding_window"]) if "sliding" in kinds else cfg.get("sliding_window"))
