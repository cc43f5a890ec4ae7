"""A tiny random Idefics3 (transformers' Idefics3ForConditionalGeneration: a 2-layer SigLIP tower with a post-norm on
32x32 tiles in 8x8 patches, pixel-shuffled by 2 into 4 rows per tile, a 2-layer Llama) saved as an HF directory; and
transformers' own logits for it."""
from __future__ import annotations

import numpy as np

IMAGE_TOKEN = 299     # <image>
IMAGE_ROWS = 4        # (32 / 8)^2 patches / 2^2


def build_tiny_idefics3(path: str, *, seed: int = 0, smolvlm: bool = False) -> str:
    import torch
    import transformers

    torch.manual_seed(seed)
    text = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                    rms_norm_eps=1e-5, bos_token_id=2, eos_token_id=1)
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                 patch_size=8)
    if smolvlm:
        cfg = transformers.SmolVLMConfig(text_config=text, vision_config=transformers.SmolVLMVisionConfig(**sizes),
                                         image_token_id=IMAGE_TOKEN, scale_factor=2)
        model = transformers.SmolVLMForConditionalGeneration(cfg).eval()
    else:
        cfg = transformers.Idefics3Config(text_config=text, vision_config=transformers.Idefics3VisionConfig(**sizes),
                                          image_token_id=IMAGE_TOKEN, scale_factor=2)
        model = transformers.Idefics3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        # random init leaves norms at 1, biases at 0 and the text model's weights at 0.02: attention near uniform,
        # where an image barely moves a greedy reply. Make them matter.
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias") or "connector" in name:
                p.normal_(0, 0.5)
            elif "text_model" in name or "lm_head" in name:
                p.normal_(0, 0.6)
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_model(path: str):
    import torch
    import transformers

    return transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(model, ids: list[int], pixels: np.ndarray | None) -> np.ndarray:
    """transformers' logits [T, V] of a prompt whose image rows are already expanded (pixels [tiles, 3, H, W], in the
    order of their rows in the prompt)."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]),
                    pixel_values=None if pixels is None else torch.tensor(pixels, dtype=torch.float32)[None])
    return out.logits[0].numpy()


def hf_greedy(model, ids: list[int], pixels: np.ndarray, n: int) -> list[int]:
    """transformers' greedy continuation (EOS not special: the engine's ignore_eos), a full forward per token."""
    ids = list(ids)
    for _ in range(n):
        ids.append(int(hf_logits(model, ids, pixels)[-1].argmax()))
    return ids[-n:]
