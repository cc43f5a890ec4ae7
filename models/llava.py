"""LLaVA (HF LlavaForConditionalGeneration): a vision tower (CLIP or SigLIP, models/vision.py) whose feature layer,
through a two-layer MLP projector, fills the prompt's image placeholder rows of a Llama-family text model (Llama,
Mistral, Qwen2: models/llama.py). The text model's step is Llama's, with the image rows as an input
(CausalLM.hidden's `embeds`); the tower runs apart, once per image (`encode_images`)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from slipstream.models.config import ModelConfig
from slipstream.models.llama import Llama, llama_weights
from slipstream.models.vision import Projector, VisionTower, vision_weights

_TEXT = "model.language_model."   # transformers >= 4.52's layout, the declared names
_TOWER = "model.vision_tower.vision_model."
_PROJECTOR = "model.multi_modal_projector."


def _text_weights():
    out = []
    for w in llama_weights():
        name = _TEXT + w.hf[len("model."):] if w.hf.startswith("model.") else w.hf
        out.append(dataclasses.replace(w, hf=name, gguf=None))
    return tuple(out)


class Llava(Llama):
    WEIGHTS = (*_text_weights(), *vision_weights(_TOWER, _PROJECTOR))
    # the Hub's llava-hf checkpoints (transformers < 4.52), and transformers 5's save_pretrained (its tower
    # without the vision_model level)
    HF_ALIASES = (("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
                  (_TOWER, "vision_tower.vision_model."), (_TOWER, "vision_tower."),
                  (_PROJECTOR, "multi_modal_projector."))

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.vision = VisionTower(cfg.vision)
        self.projector = Projector(cfg.vision, cfg.hidden_size)

    def encode_images(self, pixels: jax.Array, dtype=jnp.float32) -> jax.Array:
        """pixels f32[B, 3, H, W] (models/image_processor.py) -> the rows each image fills in the prompt,
        [B, num_image_tokens, hidden_size]."""
        features = self.vision(pixels, dtype)
        if self.cfg.vision.drop_cls:  # "default" selection: the class token's row is not an image token
            features = features[:, 1:]
        return self.projector(features)
