"""Idefics3 and SmolVLM (HF Idefics3ForConditionalGeneration, SmolVLMForConditionalGeneration): a SigLIP tower with a
post-norm (models/vision.py) whose last layer, pixel-shuffled and projected by one linear (the connector), fills the
prompt's image rows of a Llama text model (SmolLM2, Llama 3: models/llama.py). One encode_images call per tile: the
processor's tiles and global image are separate images of the prompt (server/images.py)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from slipstream.models.base import Weight
from slipstream.models.config import ModelConfig
from slipstream.models.layers import param
from slipstream.models.llama import Llama, llama_weights
from slipstream.models.vision import EMBED, WIDE, VisionTower, _dense, tower_weights

_TEXT = "model.text_model."


def _text_weights() -> tuple[Weight, ...]:
    return tuple(dataclasses.replace(w, hf=_TEXT + w.hf[len("model."):] if w.hf.startswith("model.") else w.hf,
                                     gguf=None) for w in llama_weights())


def pixel_shuffle(x: jax.Array, s: int) -> jax.Array:
    """x [B, N, D] (a square grid of N patches, row-major) -> [B, N / s^2, D * s^2]: each s x s block of patches one
    row, its patches in row-major order along the width (Idefics3Connector.pixel_shuffle)."""
    b, n, d = x.shape
    side = int(round(n ** 0.5))
    x = x.reshape(b, side // s, s, side // s, s, d)                                  # [B,rows,p,cols,q,D]
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(b, n // (s * s), s * s * d)           # [B,rows*cols,(p,q,D)]


class Connector(nnx.Module):
    """Idefics3's connector: the pixel shuffle, then modality_projection (a linear without bias, [out, in])."""

    def __init__(self, scale_factor: int, d_in: int, text_width: int):
        self.scale_factor = scale_factor
        self.w = param((text_width, d_in * scale_factor ** 2), (EMBED, WIDE))

    def __call__(self, x: jax.Array) -> jax.Array:
        return _dense(pixel_shuffle(x, self.scale_factor), self.w.get_value(), None)


class Idefics3(Llama):
    WEIGHTS = (*_text_weights(), *tower_weights("model.vision_model."),
               Weight("connector.w", "model.connector.modality_projection.proj.weight", None))

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.vision = VisionTower(cfg.vision)
        self.connector = Connector(cfg.vision.scale_factor, cfg.vision.hidden_size, cfg.hidden_size)

    def encode_images(self, pixels: jax.Array, dtype=jnp.float32) -> jax.Array:
        """pixels f32[B, 3, H, W] (one tile each) -> the rows each fills in the prompt, [B, num_image_tokens,
        hidden_size]."""
        return self.connector(self.vision(pixels, dtype))
