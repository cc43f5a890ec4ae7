"""Loaders: sharded safetensors, GGUF, and clear errors for broken files."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from models.config import ModelConfig
from models.loader import ModelLoadError, load_gguf, load_hf_dir, load_model


def test_sharded_safetensors_equal_single_file(tmp_path, tiny_llama_dir):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    _, a = load_hf_dir(tiny_llama_dir)
    _, b = load_hf_dir(str(sharded))
    for key in ("wq", "w_down", "attn_norm"):
        np.testing.assert_array_equal(np.asarray(a["layers"][key]), np.asarray(b["layers"][key]))


def test_truncated_safetensors_names_the_file(tmp_path, tiny_llama_dir):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, broken)
    weights = broken / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_hf_dir(str(broken))


def test_wrong_shape_names_tensor_and_shapes(tmp_path, tiny_llama_dir):
    broken = tmp_path / "wrong"
    shutil.copytree(tiny_llama_dir, broken)
    cfg = json.loads((broken / "config.json").read_text())
    cfg["intermediate_size"] = 96  # the file holds 128
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"mlp.gate_proj.weight has shape \(128, 64\), expected \(96, 64\)"):
        load_hf_dir(str(broken))


def test_missing_tensor_is_named(tmp_path, tiny_llama_dir):
    from safetensors.numpy import load_file, save_file

    broken = tmp_path / "missing"
    shutil.copytree(tiny_llama_dir, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="model.layers.1.self_attn.v_proj.weight"):
        load_hf_dir(str(broken))


def test_config_validation_says_what_to_change():
    with pytest.raises(ValueError, match="num_heads .9. must be a multiple of num_kv_heads .2."):
        ModelConfig(num_layers=1, hidden_size=8, num_heads=9, num_kv_heads=2, head_dim=8,
                    intermediate_size=8, vocab_size=8)
    with pytest.raises(ValueError, match="missing required field 'hidden_size'"):
        ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1})
    with pytest.raises(ValueError, match="not supported"):
        ModelConfig.from_hf_dict({"architectures": ["GPT2LMHeadModel"]})


def test_corrupt_and_truncated_gguf(tmp_path, default_model_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="garbage.gguf"):
        load_gguf(str(garbage))
    truncated = tmp_path / "truncated.gguf"
    with open(default_model_path, "rb") as f:
        truncated.write_bytes(f.read(os.path.getsize(default_model_path) // 3))
    with pytest.raises(ModelLoadError, match="truncated.gguf"):
        load_gguf(str(truncated))
    with pytest.raises(ModelLoadError, match="no such file"):
        load_model(str(tmp_path / "nope.gguf"))
