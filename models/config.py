"""Llama-family model configuration: one frozen dataclass built from an HF config.json or GGUF metadata.

Family differences (Llama 2/3, Mistral, Qwen2, SmolLM2) are flags here, never separate model code.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama-3 style frequency scaling ("llama3") or plain linear position interpolation."""

    kind: str  # "llama3" or "linear"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ("llama3", "linear"):
            raise ValueError(f"rope_scaling type {self.kind!r} is not supported; use 'llama3' or 'linear'")
        if self.factor <= 0:
            raise ValueError(f"rope_scaling factor must be > 0, got {self.factor}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    attention_bias: bool = False          # Qwen2: bias on q/k/v projections
    sliding_window: int | None = None     # Mistral: attend to the last N positions only
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

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
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ValueError(f"rope_theta must be a positive number, got {self.rope_theta}")
        if not (0 < self.rms_norm_eps < 1):
            raise ValueError(f"rms_norm_eps must be in (0, 1), got {self.rms_norm_eps}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    # ---- constructors -------------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        supported = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
        if arch not in supported:
            raise ValueError(f"architecture {arch!r} is not supported; supported: {', '.join(supported)}")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            qwen = arch == "Qwen2ForCausalLM"
            window = cfg.get("sliding_window")
            if qwen and not cfg.get("use_sliding_window", False):
                window = None
            return cls(
                num_layers=int(cfg["num_hidden_layers"]),
                hidden_size=hidden,
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                intermediate_size=int(cfg["intermediate_size"]),
                vocab_size=int(cfg["vocab_size"]),
                rope_theta=float(cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
                rope_scaling=_rope_scaling_from_hf(cfg.get("rope_scaling") or cfg.get("rope_parameters")),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", qwen)),
                sliding_window=int(window) if window else None,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
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

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], *, has_output_tensor: bool) -> "ModelConfig":
        arch = meta.get("general.architecture")
        if arch not in ("llama", "qwen2"):
            raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: llama, qwen2")

        def get(key: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise ValueError(f"GGUF metadata is missing {arch}.{key}")
            return value

        hidden = int(get("embedding_length"))
        heads = int(get("attention.head_count"))
        vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
        eos = meta.get("tokenizer.ggml.eos_token_id")
        scaling = None
        if meta.get(f"{arch}.rope.scaling.type") == "linear":
            scaling = RopeScaling(kind="linear", factor=float(get("rope.scaling.factor")))
        return cls(
            num_layers=int(get("block_count")),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=int(meta.get(f"{arch}.attention.key_length") or hidden // heads),
            intermediate_size=int(get("feed_forward_length")),
            vocab_size=int(vocab),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            tie_embeddings=not has_output_tensor,
            attention_bias=arch == "qwen2",
            max_position_embeddings=int(get("context_length", 2048)),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
        )


def _rope_scaling_from_hf(rs: Mapping[str, Any] | None) -> RopeScaling | None:
    if not rs:
        return None
    kind = rs.get("rope_type") or rs.get("type")
    if kind in (None, "default"):
        return None
    if kind == "llama3":
        return RopeScaling(
            kind="llama3", factor=float(rs["factor"]),
            low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
            original_max_position=int(rs.get("original_max_position_embeddings", 8192)))
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(rs["factor"]))
    raise ValueError(f"rope_scaling type {kind!r} is not supported; use 'llama3' or 'linear'")
