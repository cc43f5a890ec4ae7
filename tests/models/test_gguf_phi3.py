"""Phi-3 / Phi-4-mini GGUF files (general.architecture "phi3") as llama.cpp's converter writes them: q/k/v and
gate/up fused (attn_qkv, ffn_up), RoPE on rope.dimension_count of each head, LongRoPE as two factor tensors and
rope.scaling.attn_factor; a tiny random checkpoint converted here gives transformers' logits, in F32 and Q8_0
(loaded as stored). Phi-4-mini's byte-level vocabulary splits text as GPT-4o's does (pre "gpt-4o")."""
from __future__ import annotations

import json
import math
import os

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file

from slipstream.engine.device.params import prepare_model
from slipstream.models.base import dense_logits
from slipstream.models.gguf_config import config_from_gguf
from slipstream.models.loader import load_gguf
from tests.conftest import build_tiny_hf


def convert(hf_dir: str, path: str, outtype: str = "F32") -> str:
    """hf_dir's checkpoint as convert_hf_to_gguf.py's Phi3MiniModel writes it; Q8_0: the matrices rounded (and
    hf_dir's weights replaced by the rounded values, so transformers reads what the file holds)."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    rope = cfg["rope_parameters"]
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    original, context = cfg["original_max_position_embeddings"], cfg["max_position_embeddings"]
    writer = gguf.GGUFWriter(path, "phi3")
    writer.add_context_length(context)
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_dimension_count(int(rope["partial_rotary_factor"] * hidden) // heads)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_sliding_window(cfg.get("sliding_window") or 0)
    scale = context / original
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<{i}>" for i in range(cfg["vocab_size"])])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.PHI3, cfg["num_hidden_layers"])
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    for name, arr in tensors.items():
        qtype = gguf.GGMLQuantizationType.Q8_0 if outtype == "Q8_0" and arr.ndim == 2 else gguf.GGMLQuantizationType.F32
        data = gguf.quants.quantize(arr.astype(np.float32), qtype)
        tensors[name] = gguf.quants.dequantize(data, qtype).reshape(arr.shape).astype(np.float32)
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)), data,
                          raw_dtype=qtype if qtype != gguf.GGMLQuantizationType.F32 else None)
    save_file(tensors, os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})
    for kind in ("long", "short"):
        writer.add_tensor(f"rope_factors_{kind}.weight", np.asarray(rope[f"{kind}_factor"], np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _hf_logits(hf_dir: str, tokens: np.ndarray) -> np.ndarray:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


TOKENS = np.random.default_rng(0).integers(3, 256, (2, 20)).astype(np.int32)  # past the original context of 4


def test_phi3_gguf_logits_equal_transformers(tmp_path):
    hf_dir = build_tiny_hf(str(tmp_path / "hf"), "phi3")
    cfg, model = load_gguf(convert(hf_dir, str(tmp_path / "phi3.gguf")))
    assert (cfg.architecture, cfg.rotary_dim, cfg.sliding_window, cfg.tie_embeddings) == ("phi3", 12, None, False)
    assert cfg.rope_scaling.kind == "longrope" and cfg.rope_scaling.long and len(cfg.rope_scaling.long_factor) == 6
    np.testing.assert_allclose(np.asarray(nnx.jit(dense_logits)(model, TOKENS)), _hf_logits(hf_dir, TOKENS),
                               atol=1e-4, rtol=0)


def test_phi3_q8_0_gguf_loads_its_fused_rows_as_stored(tmp_path):
    """quantize="q8_0": q/k/v and gate/up cut from the fused Q8_0 tensors row by row, nothing rounded again."""
    hf_dir = build_tiny_hf(str(tmp_path / "hf"), "phi3")
    path = convert(hf_dir, str(tmp_path / "phi3-q8.gguf"), "Q8_0")
    cfg, model = load_gguf(path, quantize="q8_0")
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    fused = load_file(os.path.join(hf_dir, "model.safetensors"))  # the file's values
    for module, rows in ((model.blocks.attn.wk, slice(q, q + kv)), (model.blocks.mlp.w_up, slice(128, 256))):
        name = "self_attn.qkv_proj" if module is model.blocks.attn.wk else "mlp.gate_up_proj"
        want = np.stack([fused[f"model.layers.{i}.{name}.weight"][rows].T for i in range(cfg.num_layers)])
        np.testing.assert_array_equal(np.asarray(module.w.get_value().dequantize()), want)
    got = np.asarray(nnx.jit(dense_logits)(prepare_model(model, "q8_0", jnp.float32), TOKENS))
    want = _hf_logits(hf_dir, TOKENS)
    # the activations are rounded to int8 too (q8_0): the int8 tests' bound on log-probabilities
    assert np.abs(_log_softmax(got) - _log_softmax(want)).max() < 0.02


def _log_softmax(z):
    z = np.asarray(z, np.float64)
    return z - z.max(-1, keepdims=True) - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))


def test_phi3_metadata_without_factors_or_window():
    meta = {"general.architecture": "phi3", "phi3.block_count": 32, "phi3.embedding_length": 3072,
            "phi3.attention.head_count": 32, "phi3.attention.head_count_kv": 32, "phi3.feed_forward_length": 8192,
            "phi3.context_length": 4096, "phi3.rope.dimension_count": 96, "phi3.attention.sliding_window": 2047,
            "phi3.vocab_size": 32064}
    mini = config_from_gguf(meta, has_output_tensor=True)  # Phi-3-mini-4k: its window of 2047
    assert mini.rope_scaling is None and mini.sliding_window == 2047 and mini.rotary_dim == 96
    with pytest.raises(ValueError, match="missing phi3.rope.scaling.original_context_length"):
        config_from_gguf(meta, has_output_tensor=True, rope_factors=([1.0] * 48, [2.0] * 48))
    with pytest.raises(ValueError, match=r"one entry per rotated pair \(48\), got 4"):
        config_from_gguf({**meta, "phi3.rope.scaling.original_context_length": 4096},
                                       has_output_tensor=True, rope_factors=([1.0] * 4, [2.0] * 4))


GPT4O_TEXTS = ["HelloWorld's CAMELCase don'T", "numbers 1234567 and 3.14159", "line one\n\n  indented //\n",
               "naïve ÆRØ Ünïcode 日本語 🚀", "  leading and trailing  ", "x=y+z;\tTabs\r\nCRLF"]


def test_gpt4o_pre_tokenizer_splits_as_transformers(tmp_path, default_gguf_reader):
    """A byte-level vocabulary (the default model's) under pre "gpt-4o" (Phi-4-mini, Llama 4) encodes as
    transformers' GGUF tokenizer does."""
    from transformers import AutoTokenizer

    from slipstream.models.loader import gguf_metadata
    from slipstream.models.registry import load_tokenizer

    meta = gguf_metadata(default_gguf_reader)
    path = str(tmp_path / "gpt4o.gguf")
    writer = gguf.GGUFWriter(path, "phi3")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-4o")
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = load_tokenizer(path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="gpt4o.gguf")
    for text in GPT4O_TEXTS:
        assert ours.encode(text) == theirs(text, add_special_tokens=False)["input_ids"], text
        assert ours.decode(ours.encode(text)) == text
    # the split itself: a word's capitals then its lower case letters, digits by three
    pieces = [p for p, _ in ours._hf.pre_tokenizer.pre_tokenize_str("helloWorld CAMELCase 12345")]
    assert pieces == ["hello", "World", "\u0120CAMELCase", "\u0120", "123", "45"]
