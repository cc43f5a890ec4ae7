"""A tiny random LLaVA (transformers' LlavaForConditionalGeneration: a 2-layer CLIP tower on 32x32 images in 8x8
patches, a 2-layer Llama) saved as an HF directory with a word-level tokenizer, llava-1.5's chat template (image parts
as <image>), and a CLIP preprocessor config; and transformers' own pixels and logits for it."""
from __future__ import annotations

import json
import os

import numpy as np

IMAGE_TOKEN = 255     # <image>
IMAGE_ROWS = 16       # (32 / 8)^2 patches; the class token's row dropped ("default" selection)
WORDS = [f"w{i}" for i in range(5, 255)]  # ids 5..254; 0 <pad>, 1 <eos>, 2 <bos>, 3 USER:, 4 ASSISTANT:
# llava-hf/llava-1.5-7b-hf's chat_template.json (the processor's): every message's content read as parts, and
# transformers' {% generation %} tag
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")


def build_tiny_llava(path: str, *, seed: int = 0, feature_layer: int | list[int] = -2,
                     strategy: str = "default", tower: str = "clip", text_model: str = "llama") -> str:
    import torch
    import transformers

    torch.manual_seed(seed)
    text_sizes = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=2,
                      eos_token_id=1)
    text = (transformers.LlamaConfig(**text_sizes) if text_model == "llama"
            else transformers.Qwen2Config(**text_sizes))  # q/k/v biases
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                 patch_size=8)
    vision = (transformers.CLIPVisionConfig(**sizes, projection_dim=16) if tower == "clip"
              else transformers.SiglipVisionConfig(**sizes))
    cfg = transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_index=IMAGE_TOKEN,
                                   vision_feature_layer=feature_layer, vision_feature_select_strategy=strategy,
                                   projector_hidden_act="gelu", image_seq_length=IMAGE_ROWS)
    model = transformers.LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        # random init leaves norms at 1, biases at 0 and the text model's weights at 0.02: attention near uniform,
        # where an image barely moves a greedy reply, which repeats a token. Make them matter.
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias") or "projector" in name:
                p.normal_(0, 0.5)
            elif "language_model" in name:
                p.normal_(0, 0.6)
    model.save_pretrained(path, safe_serialization=True)
    _save_tokenizer(path)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump({"image_processor_type": "CLIPImageProcessor", "do_resize": True, "size": {"shortest_edge": 32},
                   "resample": 3, "do_center_crop": True, "crop_size": {"height": 32, "width": 32},
                   "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                   "image_mean": [0.48145466, 0.4578275, 0.40821073],
                   "image_std": [0.26862954, 0.26130258, 0.27577711], "do_convert_rgb": True}, f)
    return path


def _save_tokenizer(path: str) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "USER:": 3, "ASSISTANT:": 4,
             **{w: i for i, w in enumerate(WORDS, start=5)}, "<image>": IMAGE_TOKEN}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens([AddedToken("<image>", special=True)])
    tok.save(f"{path}/tokenizer.json")
    with open(f"{path}/tokenizer_config.json", "w") as f:
        json.dump({"eos_token": "<eos>", "bos_token": "<bos>", "add_bos_token": False}, f)
    with open(f"{path}/chat_template.json", "w") as f:
        json.dump({"chat_template": CHAT_TEMPLATE}, f)


def hf_model(path: str):
    import torch
    import transformers

    return transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(model, ids: list[int], pixels: np.ndarray | None) -> np.ndarray:
    """transformers' logits [T, V] of a prompt whose image placeholders are already expanded (pixels [B, 3, H, W])."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]),
                    pixel_values=None if pixels is None else torch.tensor(pixels, dtype=torch.float32))
    return out.logits[0].numpy()


def hf_greedy(model, ids: list[int], pixels: np.ndarray, n: int) -> list[int]:
    """transformers' greedy continuation (EOS not special: the engine's ignore_eos), a full forward per token."""
    ids = list(ids)
    for _ in range(n):
        ids.append(int(hf_logits(model, ids, pixels)[-1].argmax()))
    return ids[-n:]


def prompt_with_image(words_before: list[int], words_after: list[int]) -> tuple[list[int], int]:
    """Token ids with one image's expanded placeholders between two word runs, and the image's first position."""
    return [*words_before, *[IMAGE_TOKEN] * IMAGE_ROWS, *words_after], len(words_before)
