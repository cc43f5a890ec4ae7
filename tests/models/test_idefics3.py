"""Idefics3 / SmolVLM against transformers on a tiny random checkpoint: the tower and connector's rows per tile, and a
prompt with a split image (two tiles and the global image, text tokens between them) through the engine's ragged paged
steps in chunks that split the tiles, within 1e-4 in f32."""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest
from flax import nnx

from slipstream.models.loader import load_hf_dir
from tests.models.idefics3_helpers import IMAGE_ROWS, IMAGE_TOKEN, build_tiny_idefics3, hf_logits, hf_model

FAKE, GLOBAL, ROW_1_COL_1, ROW_1_COL_2, NEWLINE = 290, 291, 292, 293, 294  # ordinary tokens of the tiny vocab


@pytest.fixture(scope="module")
def idefics3_dir(tmp_path_factory) -> str:
    return build_tiny_idefics3(str(tmp_path_factory.mktemp("idefics3")))


def _tiles(seed: int, n: int, size: int = 32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, size, size)).astype(np.float32)


@pytest.mark.parametrize("smolvlm, image_size", [(False, 32), (True, 32), (False, 36)])
def test_tile_rows_match_transformers(tmp_path, smolvlm, image_size):
    import torch

    path = build_tiny_idefics3(str(tmp_path / "m"), smolvlm=smolvlm, image_size=image_size)
    cfg, model = load_hf_dir(path)
    assert (cfg.architecture, cfg.vision.num_image_tokens, cfg.vision.scale_factor) == ("idefics3", IMAGE_ROWS, 2)
    tiles = _tiles(0, 3, image_size)
    ours = np.asarray(nnx.jit(lambda m, p: m.encode_images(p))(model, tiles))
    with torch.no_grad():
        ref = hf_model(path).model.get_image_features(pixel_values=torch.tensor(tiles)[None]).pooler_output
    ref = np.concatenate([r.numpy() for r in ref]).reshape(3, IMAGE_ROWS, cfg.hidden_size)
    assert ours.shape == ref.shape
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_config_refuses_another_text_model(idefics3_dir):
    from slipstream.models.config import ModelConfig

    with open(os.path.join(idefics3_dir, "config.json")) as f:
        raw = json.load(f)
    raw["text_config"]["model_type"] = "mistral"
    with pytest.raises(ValueError, match="Idefics3 text model 'mistral' is not supported"):
        ModelConfig.from_hf_dict(raw)
    raw["text_config"]["model_type"] = "llama"
    raw["scale_factor"] = 3  # 4 patches a side
    with pytest.raises(ValueError, match="scale_factor 3 must be a positive integer dividing the 4 patches"):
        ModelConfig.from_hf_dict(raw)


@pytest.mark.parametrize("raw", [{"vision_config": {"image_size": 256}}, {"text_config": {"model_type": "llama", "hidden_size": 64,
                                                        "num_attention_heads": 4, "vocab_size": 300},
                                        "vision_config": {"model_type": "idefics3", "hidden_size": 64},
                                        "scale_factor": 7, "image_token_id": 299}])
def test_a_config_reads_as_transformers_reads_it(raw):
    """What a config.json leaves out takes transformers' defaults (LlamaConfig's, Idefics3VisionConfig's; without a
    text_config, rms_norm_eps 1e-5 where LlamaConfig's is 1e-6)."""
    import transformers

    from slipstream.models.config import ModelConfig

    ours = ModelConfig.from_hf_dict({"architectures": ["Idefics3ForConditionalGeneration"], **raw})
    hf = transformers.Idefics3Config(**raw)
    text, vision = hf.text_config, hf.vision_config
    assert (ours.num_layers, ours.hidden_size, ours.num_heads, ours.intermediate_size, ours.vocab_size,
            ours.rms_norm_eps, ours.max_position_embeddings, ours.rope_theta, ours.bos_token_id, ours.eos_token_ids,
            ours.tie_embeddings, ours.image_token_id) == (
        text.num_hidden_layers, text.hidden_size, text.num_attention_heads, text.intermediate_size, text.vocab_size,
        text.rms_norm_eps, text.max_position_embeddings, text.rope_parameters["rope_theta"], text.bos_token_id,
        (text.eos_token_id,), hf.tie_word_embeddings, hf.image_token_id)
    v = ours.vision
    assert (v.hidden_size, v.intermediate_size, v.num_layers, v.num_heads, v.image_size, v.patch_size,
            v.layer_norm_eps, v.scale_factor) == (
        vision.hidden_size, vision.intermediate_size, vision.num_hidden_layers, vision.num_attention_heads,
        vision.image_size, vision.patch_size, vision.layer_norm_eps, hf.scale_factor)


def _split_image_prompt() -> tuple[list[int], list[int]]:
    """Idefics3Processor's layout of an image split into 1x2 tiles plus the global image, between words: the ids and
    each tile's first row."""
    ids, offsets = [2, 3, 17], []
    for row_col in (ROW_1_COL_1, ROW_1_COL_2):
        ids += [FAKE, row_col]
        offsets.append(len(ids))
        ids += [IMAGE_TOKEN] * IMAGE_ROWS
    ids += [NEWLINE, NEWLINE, FAKE, GLOBAL]
    offsets.append(len(ids))
    ids += [IMAGE_TOKEN] * IMAGE_ROWS + [FAKE, 40, 99, 60, 4]
    return ids, offsets


def test_prompt_with_tiles_through_ragged_steps_matches_transformers(idefics3_dir):
    """Chunks of 5 tokens: every tile's 4 rows are split over two chunks; each chunk's last logits equal
    transformers' at that position, and a second sequence without an image runs in the same steps."""
    from slipstream.engine.api import StepBatch, StepSeq, image_rows
    from slipstream.engine.device.runner import EngineConfig, JaxEngine
    from slipstream.engine.request import ImageInput

    cfg, model = load_hf_dir(idefics3_dir)
    engine = JaxEngine(cfg, model, EngineConfig(max_slots=2, page_size=8, max_seq_len=64, num_pages=16,
                                                max_num_batched_tokens=16, quantize="none"), precompile=False)
    tiles = _tiles(1, 3)
    ids, offsets = _split_image_prompt()
    images = [ImageInput(t, at, IMAGE_ROWS, hashlib.sha256(t.tobytes()).digest()) for t, at in zip(tiles, offsets)]
    text_ids = [2, 3, 9, 10, 11, 12, 13, 14, 15, 16, 4]
    hf = hf_model(idefics3_dir)
    ref = hf_logits(hf, ids, tiles)
    text_ref = hf_logits(hf, text_ids, None)
    assert np.abs(hf_logits(hf, ids, tiles[::-1].copy()) - ref)[-1].max() > 1e-2  # the tiles' order matters
    step = 5
    for start in range(0, len(ids), step):
        end = min(start + step, len(ids))
        seqs = [StepSeq(slot=0, token_ids=ids[start:end], start_pos=start, page_ids=(1, 2, 3, 4), sample=True,
                        images=image_rows(images, start, end))]
        if start < len(text_ids):
            t_end = min(start + step, len(text_ids))
            seqs.append(StepSeq(slot=1, token_ids=text_ids[start:t_end], start_pos=start, page_ids=(5, 6),
                                sample=True))
        logits = engine.model_logits(StepBatch(tuple(seqs)))
        np.testing.assert_allclose(logits[0], ref[end - 1], atol=1e-4, rtol=0)
        if start < len(text_ids):
            np.testing.assert_allclose(logits[1], text_ref[t_end - 1], atol=1e-4, rtol=0)
    assert engine.images.encoded == 3  # once per tile, though each spans two chunks
