"""RoPE frequency scaling as a model's config asks for it (linear, llama3, YaRN, LongRoPE), read from an HF
config's rope_scaling; models/layers.py computes the frequencies, models/gguf_config.py reads GGUF files' keys."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping


ROPE_KINDS = ("linear", "llama3", "yarn", "longrope")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling, as transformers computes it: plain linear position interpolation ("linear"),
    Llama 3's ("llama3"), YaRN's blend of interpolated and original frequencies ("yarn": Qwen2.5 / Qwen3 long
    context) or LongRoPE's per-frequency factors ("longrope": Phi-3 / Phi-4). YaRN and LongRoPE also scale cos and
    sin by attention_factor."""

    kind: str  # one of ROPE_KINDS
    factor: float = 1.0
    low_freq_factor: float = 1.0   # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position: int = 8192  # llama3, yarn, longrope: the context the model was pretrained on
    beta_fast: float = 32.0        # yarn: the ramp between extrapolated and interpolated frequencies
    beta_slow: float = 1.0
    truncate: bool = True          # yarn: the ramp's ends rounded to whole dimensions
    attention_factor: float = 1.0  # yarn, longrope: cos and sin multiplied by it
    # longrope: each frequency divided by its factor; the long ones when the model's context
    # (max_position_embeddings) passes original_max_position, as llama.cpp picks them for its context
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    long: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"rope_scaling type {self.kind!r} is not supported; supported: {', '.join(ROPE_KINDS)}")
        if not self.factor > 0:
            raise ValueError(f"rope_scaling factor must be > 0, got {self.factor}")
        if self.kind == "longrope" and (not self.short_factor or len(self.short_factor) != len(self.long_factor)):
            raise ValueError("longrope rope_scaling needs short_factor and long_factor of one length (rotary dim / 2), "
                             f"got {len(self.short_factor)} and {len(self.long_factor)}")

    def rescale(self) -> tuple[float, ...]:
        """longrope: the factors each frequency is divided by."""
        return self.long_factor if self.long else self.short_factor


def rope_scaling_from_hf(rs: Mapping[str, Any] | None, cfg: Mapping[str, Any]) -> RopeScaling | None:
    """A config's rope_scaling (or transformers 5's rope_parameters) as transformers' _compute_*_parameters read it;
    cfg: the whole config (Phi-3 keeps original_max_position_embeddings there)."""
    if not rs:
        return None
    kind = rs.get("rope_type") or rs.get("type")
    if kind in (None, "default"):
        return None
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    original = int(cfg.get("original_max_position_embeddings") or rs.get("original_max_position_embeddings")
                   or (8192 if kind == "llama3" else max_pos))
    if kind == "llama3":
        return RopeScaling(
            kind="llama3", factor=float(rs["factor"]),
            low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
            original_max_position=original)
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(rs["factor"]))
    if kind in ("yarn", "longrope", "su"):
        factor = float(rs.get("factor") or max_pos / original)
        attention = rs.get("attention_factor")
        if kind == "yarn":
            if attention is None:
                mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")
                attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all
                             else yarn_mscale(factor))
            return RopeScaling(kind="yarn", factor=factor, original_max_position=original,
                               beta_fast=float(rs.get("beta_fast") or 32), beta_slow=float(rs.get("beta_slow") or 1),
                               truncate=bool(rs.get("truncate", True)), attention_factor=float(attention))
        if attention is None:
            attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        return RopeScaling(kind="longrope", factor=factor, original_max_position=original,
                           attention_factor=float(attention), short_factor=tuple(map(float, rs["short_factor"])),
                           long_factor=tuple(map(float, rs["long_factor"])), long=max_pos > original)
    if kind == "dynamic":
        raise ValueError("rope_scaling type 'dynamic' is not supported: its frequencies change with each sequence's "
                         "length, which keys already in the KV cache cannot follow; supported: "
                         f"{', '.join(ROPE_KINDS)}")
    raise ValueError(f"rope_scaling type {kind!r} is not supported; supported: {', '.join(ROPE_KINDS)}")


def yarn_context(fields: dict) -> dict:
    """YaRN stretches the original context by its factor (Qwen2.5 / Qwen3: 32k to 128k) where the config's
    max_position_embeddings (a GGUF's context_length) stays the unscaled one: the model's context is the longer of
    the two, as vLLM derives it."""
    rs = fields.get("rope_scaling")
    if rs is not None and rs.kind == "yarn":
        stretched = int(rs.original_max_position * rs.factor)
        fields["max_position_embeddings"] = max(fields["max_position_embeddings"], stretched)
    return fields


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale for a context factor (its paper's 0.1 ln(s) + 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
