"""RoPE scaling in GGUF files: a tiny random Qwen3 with YaRN (Qwen3's long-context setting) converted as llama.cpp's
converter writes it ({arch}.rope.scaling.type "yarn", factor, original_context_length) gives transformers' logits;
YaRN variants llama.cpp applies and transformers has no field for are refused by their key."""
from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file

from slipstream.models.base import dense_logits
from slipstream.models.config import ModelConfig
from slipstream.models.gguf_config import config_from_gguf
from slipstream.models.loader import load_gguf
from tests.conftest import build_tiny_hf


def convert_qwen3(hf_dir: str, path: str) -> str:
    """A Qwen3 checkpoint as convert_hf_to_gguf.py writes it (F32; Qwen3's Q/K rows are not permuted)."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    rope = cfg["rope_parameters"]
    writer = gguf.GGUFWriter(path, "qwen3")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<{i}>" for i in range(cfg["vocab_size"])])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, cfg["num_hidden_layers"])
    for name, arr in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        new = names.get_name(name, try_suffixes=(".weight",))
        assert new is not None, name
        writer.add_tensor(new, arr.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_yarn_qwen3_gguf_logits_equal_transformers(tmp_path):
    import transformers

    hf_dir = build_tiny_hf(str(tmp_path / "hf"), "qwen3_yarn")
    cfg, model = load_gguf(convert_qwen3(hf_dir, str(tmp_path / "qwen3-yarn.gguf")))
    scaling = cfg.rope_scaling
    assert (scaling.kind, scaling.factor, scaling.original_max_position) == ("yarn", 4.0, 64)
    assert scaling.attention_factor == pytest.approx(1 + 0.1 * np.log(4.0))
    tokens = np.random.default_rng(0).integers(3, 256, (2, 24)).astype(np.int32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(np.asarray(nnx.jit(dense_logits)(model, tokens)), want, atol=1e-4, rtol=0)


META = {"general.architecture": "qwen3", "qwen3.block_count": 2, "qwen3.embedding_length": 64,
        "qwen3.attention.head_count": 4, "qwen3.feed_forward_length": 128, "qwen3.vocab_size": 256,
        "qwen3.context_length": 131072, "qwen3.rope.scaling.type": "yarn", "qwen3.rope.scaling.factor": 4.0}


def test_yarn_metadata_defaults_and_betas():
    cfg = config_from_gguf({**META, "qwen3.rope.scaling.yarn_beta_fast": 16.0,
                                          "qwen3.rope.scaling.yarn_ext_factor": -1.0}, has_output_tensor=True)
    # no original_context_length: llama.cpp takes the training context
    assert (cfg.rope_scaling.original_max_position, cfg.rope_scaling.beta_fast, cfg.rope_scaling.beta_slow) == (
        131072, 16.0, 1.0)
    qwen = config_from_gguf({**META, "qwen3.context_length": 40960,
                                           "qwen3.rope.scaling.original_context_length": 32768}, has_output_tensor=True)
    assert qwen.max_position_embeddings == 131072  # the context YaRN stretches 32k to


@pytest.mark.parametrize("change, message", [
    ({"qwen3.rope.scaling.yarn_log_multiplier": 0.1}, "yarn_log_multiplier 0.1 is not supported"),
    ({"qwen3.rope.scaling.yarn_attn_factor": 0.8}, "yarn_attn_factor 0.8 is not supported"),
    ({"qwen3.rope.scaling.yarn_ext_factor": 0.5}, "yarn_ext_factor 0.5 is not supported"),
    ({"qwen3.rope.scaling.type": "longrope"}, "scaling.type 'longrope' is not supported; supported: linear, yarn"),
    ({"qwen3.rope.scaling.factor": None}, "missing qwen3.rope.scaling.factor"),
])
def test_unsupported_rope_metadata_is_refused_by_key(change, message):
    meta = {k: v for k, v in {**META, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        config_from_gguf(meta, has_output_tensor=True)


def test_hf_rope_kinds_named_when_refused():
    base = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1,
            "intermediate_size": 8, "vocab_size": 8}
    with pytest.raises(ValueError, match="'dynamic' is not supported: its frequencies change with each sequence's "
                                         "length.*supported: linear, llama3, yarn, longrope"):
        ModelConfig.from_hf_dict({**base, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    with pytest.raises(ValueError, match="'ntk' is not supported; supported: linear, llama3, yarn, longrope"):
        ModelConfig.from_hf_dict({**base, "rope_scaling": {"rope_type": "ntk", "factor": 2.0}})
    # Qwen3's long-context setting: 40960 positions in the config, YaRN's 4 x 32768 served
    yarn = ModelConfig.from_hf_dict({**base, "max_position_embeddings": 40960, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}})
    assert yarn.rope_scaling.attention_factor == pytest.approx(1 + 0.1 * np.log(4.0))
    assert yarn.max_position_embeddings == 131072
    factors = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    for name in ("su", "yarn"):  # Phi-3's older names of LongRoPE
        phi = ModelConfig.from_hf_dict({**base, "architectures": ["Phi3ForCausalLM"], "max_position_embeddings": 8192,
                                        "original_max_position_embeddings": 4096,
                                        "rope_scaling": {"type": name, **factors}})
        assert phi.rope_scaling.kind == "longrope" and phi.rope_scaling.long
