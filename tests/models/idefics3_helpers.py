"""A tiny random Idefics3 (transformers' Idefics3ForConditionalGeneration: a 2-layer SigLIP tower with a post-norm on
32x32 tiles in 8x8 patches, pixel-shuffled by 2 into 4 rows per tile, a 2-layer Llama) saved as an HF directory; and
transformers' own logits for it."""
from __future__ import annotations

import numpy as np

from tests.models import llava_helpers

IMAGE_TOKEN = 299     # <image>
IMAGE_ROWS = 4        # (32 / 8)^2 patches / 2^2


def build_tiny_idefics3(path: str, *, seed: int = 0, smolvlm: bool = False, image_size: int = 32) -> str:
    """image_size 36: 4 whole patches a side and 4 pixels left out, as SmolVLM-Instruct's 384 px in 14 px patches."""
    import torch
    import transformers

    torch.manual_seed(seed)
    text = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                    rms_norm_eps=1e-5, bos_token_id=2, eos_token_id=1)
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 image_size=image_size, patch_size=8)
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
    order of their rows in the prompt: one image of tiles)."""
    return llava_helpers.hf_logits(model, ids, None if pixels is None else pixels[None])


def hf_greedy(model, ids: list[int], pixels: np.ndarray, n: int) -> list[int]:
    return llava_helpers.hf_greedy(model, ids, pixels[None], n)


# the tiny tokenizer's vocabulary: words, and Idefics3's tokens where SmolVLM's tokenizer has added tokens
ROW_COL = {f"<row_{r}_col_{c}>": 250 + 6 * (r - 1) + (c - 1) for r in range(1, 7) for c in range(1, 7)}  # 250..285
SPECIAL = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<end_of_utterance>": 288, "<fake_token_around_image>": 290,
           "<global-img>": 291, "<image>": IMAGE_TOKEN, **ROW_COL}
VOCAB = {**SPECIAL, "User:": 3, "Assistant:": 4, "\n": 286, "\n\n": 287,
         **{f"w{i}": i for i in (*range(5, 250), 289, *range(292, 299))}}
# SmolVLM-Instruct's chat template, spaces where its turns have none (the tiny tokenizer splits words at spaces)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize }}:{% for line in message['content'] %}"
    "{% if line['type'] == 'text' %} {{ line['text'] }}{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}"
    "{% endfor %}<end_of_utterance> {% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
PREPROCESSOR = {"image_processor_type": "Idefics3ImageProcessor", "do_convert_rgb": True, "do_image_splitting": True,
                "do_normalize": True, "do_pad": True, "do_rescale": True, "do_resize": True,
                "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "max_image_size": {"longest_edge": 32},
                "resample": 1, "rescale_factor": 1 / 255, "size": {"longest_edge": 64}}


def save_processor_files(path: str, *, splitting: bool = True) -> str:
    """A word-level tokenizer with Idefics3's image tokens as special tokens (newlines kept as tokens), the chat
    template, and Idefics3's preprocessor config (32x32 tiles, the longest edge 64: at most 2x2 tiles)."""
    import json

    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    assert len(set(VOCAB.values())) == len(VOCAB) == 300
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(" +"), behavior="removed")
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.save(f"{path}/tokenizer.json")
    with open(f"{path}/tokenizer_config.json", "w") as f:
        json.dump({"eos_token": "<end_of_utterance>", "bos_token": "<bos>", "add_bos_token": False}, f)
    with open(f"{path}/chat_template.json", "w") as f:
        json.dump({"chat_template": CHAT_TEMPLATE}, f)
    with open(f"{path}/preprocessor_config.json", "w") as f:
        json.dump({**PREPROCESSOR, "do_image_splitting": splitting}, f)
    return path


def hf_processor(path: str):
    """transformers' Idefics3Processor over the directory's tokenizer and preprocessor config."""
    import json

    import transformers

    with open(f"{path}/preprocessor_config.json") as f:
        raw = json.load(f)
    images = transformers.Idefics3ImageProcessorPil(**{k: v for k, v in raw.items() if k != "image_processor_type"})
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=f"{path}/tokenizer.json", bos_token="<bos>",
                                                     eos_token="<end_of_utterance>", pad_token="<pad>")
    return transformers.Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=IMAGE_ROWS,
                                          chat_template=CHAT_TEMPLATE)
