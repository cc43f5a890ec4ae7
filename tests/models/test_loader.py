"""Loaders: sharded safetensors, GGUF, and clear errors for broken files."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from flax import nnx

from slipstream.models.config import ModelConfig
from slipstream.models.loader import ModelLoadError, load_gguf, load_hf_dir, load_model


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
    state_a, state_b = dict(nnx.to_flat_state(nnx.state(a))), dict(nnx.to_flat_state(nnx.state(b)))
    assert state_a.keys() == state_b.keys() and ("blocks", "attn", "wq", "w") in state_a
    for path, var in state_a.items():
        np.testing.assert_array_equal(np.asarray(var.get_value()), np.asarray(state_b[path].get_value()))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3"])
def test_every_weight_has_logical_axes_and_the_checkpoint_value(tmp_path, family):
    """The architecture's declaration names each weight once: loaded [in, out] from the checkpoint's
    [out, in], stacked over layers, with a logical axis name per dimension."""
    import torch
    import transformers

    from tests.conftest import build_tiny_hf

    path = build_tiny_hf(str(tmp_path), family)
    cfg, model = load_hf_dir(path)
    hf = dict(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).named_parameters())
    declared = {tuple(w.path.split(".")): w for w in type(model).WEIGHTS}
    for path_, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        w = declared[path_]
        value = np.asarray(var.get_value())
        axes = var.get_metadata()["out_sharding"]
        assert len(axes) == value.ndim and (axes[0] == "layers") == w.per_layer, (path_, axes)
        want = np.stack([hf[w.hf.format(i=i)].detach().numpy() for i in range(cfg.num_layers)]) \
            if w.per_layer else hf[w.hf].detach().numpy()
        np.testing.assert_array_equal(value, np.swapaxes(want, -1, -2) if w.linear else want)


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
