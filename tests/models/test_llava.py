"""LLaVA against transformers on a tiny random checkpoint: the tower and projector's image rows, and a prompt with an
image through the engine's ragged paged steps (the image split over two prefill chunks), within 1e-4 in f32."""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest
from flax import nnx

from slipstream.models.loader import load_hf_dir
from tests.models.llava_helpers import IMAGE_ROWS, build_tiny_llava, hf_logits, hf_model, prompt_with_image


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory) -> str:
    return build_tiny_llava(str(tmp_path_factory.mktemp("llava")))


def _pixels(seed: int, n: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, 32, 32)).astype(np.float32)


@pytest.mark.parametrize("tower, feature_layer, strategy", [("clip", -2, "default"), ("clip", [0, -1], "full"),
                                                           ("siglip", -1, "full")])
def test_image_rows_match_transformers(tmp_path, tower, feature_layer, strategy):
    import torch

    path = build_tiny_llava(str(tmp_path / "m"), feature_layer=feature_layer, strategy=strategy, tower=tower)
    cfg, model = load_hf_dir(path)
    assert cfg.vision.kind == tower
    assert cfg.vision.num_image_tokens == IMAGE_ROWS + (tower == "clip" and strategy == "full")
    pixels = _pixels(0, 2)
    ours = np.asarray(nnx.jit(lambda m, p: m.encode_images(p))(model, pixels))
    with torch.no_grad():
        ref = hf_model(path).model.get_image_features(pixel_values=torch.tensor(pixels)).pooler_output
    ref = np.stack([r.numpy() for r in ref])
    assert ours.shape == (2, cfg.vision.num_image_tokens, cfg.hidden_size)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_hub_layout_loads_the_same_weights(llava_dir, tmp_path):
    """The Hub's llava-hf checkpoints name the tower vision_tower.vision_model.*; transformers 5 saves vision_tower.*."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(os.path.join(llava_dir, "model.safetensors"))
    assert any(k.startswith("vision_tower.embeddings.") for k in tensors)
    renamed = {k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in tensors.items()}
    os.makedirs(tmp_path / "hub")
    save_file(renamed, str(tmp_path / "hub" / "model.safetensors"))
    with open(os.path.join(llava_dir, "config.json")) as f:
        (tmp_path / "hub" / "config.json").write_text(f.read())
    _, a = load_hf_dir(llava_dir)
    _, b = load_hf_dir(str(tmp_path / "hub"))
    pixels = _pixels(3)
    encode = nnx.jit(lambda m, p: m.encode_images(p))
    np.testing.assert_array_equal(np.asarray(encode(a, pixels)), np.asarray(encode(b, pixels)))


def test_config_needs_a_supported_tower(llava_dir, tmp_path):
    from slipstream.models.config import ModelConfig

    with open(os.path.join(llava_dir, "config.json")) as f:
        raw = json.load(f)
    raw["vision_config"]["model_type"] = "pixtral"
    with pytest.raises(ValueError, match="vision tower 'pixtral' is not supported"):
        ModelConfig.from_hf_dict(raw)


@pytest.mark.parametrize("text_model", ["llama", "qwen2"])
def test_prompt_with_an_image_through_ragged_steps_matches_transformers(llava_dir, tmp_path, text_model):
    """Chunks of 8 tokens: the 16 image rows (from position 5) are split over three chunks; each chunk's last logits
    equal transformers' at that position, and a second sequence without an image runs in the same steps."""
    if text_model != "llama":
        llava_dir = build_tiny_llava(str(tmp_path / text_model), text_model=text_model)
    from slipstream.engine.api import StepBatch, StepSeq, image_rows
    from slipstream.engine.device.runner import EngineConfig, JaxEngine
    from slipstream.engine.request import ImageInput

    cfg, model = load_hf_dir(llava_dir)
    assert cfg.attention_bias == (text_model == "qwen2")
    engine = JaxEngine(cfg, model, EngineConfig(max_slots=2, page_size=8, max_seq_len=64, num_pages=16,
                                                max_num_batched_tokens=16, quantize="none"), precompile=False)
    pixels = _pixels(1)
    ids, offset = prompt_with_image([2, 3, 17, 40, 99], [60, 61, 4])
    image = ImageInput(pixels[0], offset, IMAGE_ROWS, hashlib.sha256(pixels.tobytes()).digest())
    text_ids = [2, 3, 9, 10, 11, 12, 13, 14, 15, 16, 4]
    hf = hf_model(llava_dir)
    ref = hf_logits(hf, ids, pixels)
    text_ref = hf_logits(hf, text_ids, None)
    assert np.abs(hf_logits(hf, ids, _pixels(2)) - ref)[-1].max() > 1e-2  # another image moves them 100x the tolerance
    for start in range(0, len(ids), 8):
        end = min(start + 8, len(ids))
        seqs = [StepSeq(slot=0, token_ids=ids[start:end], start_pos=start, page_ids=(1, 2, 3), sample=True,
                        images=image_rows([image], start, end))]
        if start < len(text_ids):
            t_end = min(start + 8, len(text_ids))
            seqs.append(StepSeq(slot=1, token_ids=text_ids[start:t_end], start_pos=start, page_ids=(4, 5),
                                sample=True))
        logits = engine.model_logits(StepBatch(tuple(seqs)))
        np.testing.assert_allclose(logits[0], ref[end - 1], atol=1e-4, rtol=0)
        if start < len(text_ids):
            np.testing.assert_allclose(logits[1], text_ref[t_end - 1], atol=1e-4, rtol=0)
    assert engine.images.encoded == 1  # once for its three chunks


def test_the_hubs_llava_config_parses_as_the_preset():
    """llava-hf/llava-1.5-7b-hf's config.json leaves its text model's sizes to LlamaConfig's defaults."""
    from slipstream.models.config import ModelConfig
    from slipstream.models.registry import PRESET_DIR

    hub = {"architectures": ["LlavaForConditionalGeneration"], "ignore_index": -100, "image_token_index": 32000,
           "model_type": "llava", "pad_token_id": 32001, "projector_hidden_act": "gelu",
           "text_config": {"_name_or_path": "lmsys/vicuna-7b-v1.5", "architectures": ["LlamaForCausalLM"],
                           "max_position_embeddings": 4096, "model_type": "llama", "rms_norm_eps": 1e-05,
                           "torch_dtype": "float16", "vocab_size": 32064},
           "tie_word_embeddings": False, "torch_dtype": "float16",
           "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                             "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                             "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
           "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064}
    cfg = ModelConfig.from_hf_dict(hub)
    assert cfg == ModelConfig.from_hf_json(os.path.join(PRESET_DIR, "llava-1.5-7b.json"))
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.image_token_id) == (32, 4096, 32064, 32000)
    assert (cfg.vision.num_layers, cfg.vision.num_image_tokens, cfg.vision.activation) == (23, 576, "quick_gelu")
