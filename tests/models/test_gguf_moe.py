"""Mixture-of-experts GGUF files (Qwen3-MoE, Mixtral, OLMoE) as llama.cpp's converter writes them: each tiny
random checkpoint converted here with the gguf package (its tensor names, experts stacked one tensor per layer,
Mixtral's Q/K rows permuted; F32, F16 and Q8_0 tensors) gives transformers' logits on the same weights, and
MoE files of kinds Slipstream does not serve are refused by what they have."""
from __future__ import annotations

import json
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

LOGPROB_TOL = 0.02  # tests/quantization/test_int8_engine.py's bound on int8 weights' log-probabilities
ARCH = {"qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE, "mixtral": gguf.MODEL_ARCH.LLAMA, "olmoe": gguf.MODEL_ARCH.OLMOE}
# one tensor type per family: Q8_0 (with F16 where a row is not whole blocks), F16, F32
OUTTYPE = {"qwen3_moe": "Q8_0", "mixtral": "F16", "olmoe": "F32"}
EXPERT_PROJ = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "olmoe": ("gate_proj", "up_proj", "down_proj"),
               "mixtral": ("w1", "w3", "w2")}


def _qtype(name: str, arr: np.ndarray, outtype: str) -> gguf.GGMLQuantizationType:
    """llama.cpp's choice: norms and the router F32; a Q8_0 file's other tensors Q8_0 where each row is whole
    blocks of 32, else F16."""
    t = gguf.GGMLQuantizationType
    if arr.ndim == 1 or name.endswith("gate.weight") or outtype == "F32":
        return t.F32
    if outtype == "Q8_0" and arr.shape[-1] % 32 == 0:
        return t.Q8_0
    return t.F16


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: rotate-half Q/K rows to the interleaved RoPE layout."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert(hf_dir: str, family: str, path: str, *, per_expert: bool = False) -> str:
    """hf_dir's checkpoint as llama.cpp's convert_hf_to_gguf.py writes it in OUTTYPE[family] (per_expert: older
    Mixtral files' one tensor per expert). hf_dir's weights are replaced by the file's (rounded) values, so
    transformers reads what the file holds."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    hf = load_file(os.path.join(hf_dir, "model.safetensors"))
    outtype, arch = OUTTYPE[family], ARCH[family]
    stored = {}  # HF name -> (data as the file stores it, its type)
    for name, arr in hf.items():
        qtype = _qtype(name, arr, outtype)
        stored[name] = (gguf.quants.quantize(arr, qtype), qtype)
        hf[name] = gguf.quants.dequantize(stored[name][0], qtype).reshape(arr.shape).astype(np.float32)
    save_file(hf, os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})

    layers, experts = cfg["num_hidden_layers"], cfg.get("num_experts") or cfg["num_local_experts"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_block_count(layers)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_expert_count(experts)
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if "moe_intermediate_size" in cfg:  # Qwen2MoeModel's (and so Qwen3-MoE's) own key
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("head_dim"):
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<{i}>" for i in range(cfg["vocab_size"])])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])

    names = gguf.get_tensor_name_map(arch, layers)
    prefix = "block_sparse_moe" if family == "mixtral" else "mlp"

    def add(hf_name: str, data: np.ndarray, qtype) -> None:
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        writer.add_tensor(name, data, raw_dtype=None if data.dtype != np.uint8 else qtype)

    for name, (data, qtype) in stored.items():
        if ".experts." in name:
            continue
        if family == "mixtral" and name.endswith(("q_proj.weight", "k_proj.weight")):
            data = _permute(data, heads if "q_proj" in name else kv_heads)  # rows only: a Q8_0 block stays whole
        add(name, data, qtype)
    for i in range(layers):
        for proj in EXPERT_PROJ[family]:
            each = [stored[f"model.layers.{i}.{prefix}.experts.{e}.{proj}.weight"] for e in range(experts)]
            if per_expert:  # llama.cpp's names before the stacked tensors: blk.{i}.ffn_gate.{e}.weight
                kind = {"w1": "gate", "w3": "up", "w2": "down"}[proj]
                for e, (data, qtype) in enumerate(each):
                    writer.add_tensor(f"blk.{i}.ffn_{kind}.{e}.weight", data,
                                      raw_dtype=None if data.dtype != np.uint8 else qtype)
            else:
                add(f"model.layers.{i}.{prefix}.experts.{proj}.weight", np.stack([d for d, _ in each]), each[0][1])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def family_files(tmp_path_factory):
    """family -> (the GGUF file, transformers' logits of _tokens() on the weights it holds), built once for the
    module."""
    built = {}

    def get(family: str) -> tuple[str, np.ndarray]:
        if family not in built:
            root = tmp_path_factory.mktemp(family)
            hf_dir = _sharpen_attention(build_tiny_hf(str(root / "hf"), family))
            path = convert(hf_dir, family, str(root / f"{family}.gguf"))
            built[family] = path, _hf_logits(hf_dir, _tokens())
        return built[family]

    return get


def _sharpen_attention(hf_dir: str) -> str:
    """Q and K scaled up: the random init's attention scores are near 0, where a wrong RoPE layout (Mixtral's
    permuted rows left as stored) moves the logits by less than the tolerance."""
    weights = os.path.join(hf_dir, "model.safetensors")
    tensors = load_file(weights)
    for name in tensors:
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            tensors[name] = tensors[name] * 8
    save_file(tensors, weights, metadata={"format": "pt"})
    return hf_dir


def _tokens():
    return np.random.default_rng(0).integers(3, 256, (2, 16)).astype(np.int32)


def _hf_logits(hf_dir: str, tokens: np.ndarray) -> np.ndarray:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe"])
def test_moe_gguf_logits_equal_transformers(family_files, family):
    path, want = family_files(family)
    cfg, model = load_gguf(path)
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok) == (family, 4, 2)
    # llama.cpp renormalises Qwen3-MoE's and Mixtral's top-k router weights, not OLMoE's
    assert cfg.norm_topk_prob == (family != "olmoe") and cfg.qk_norm_full == (family == "olmoe")
    np.testing.assert_allclose(np.asarray(nnx.jit(dense_logits)(model, _tokens())), want, atol=1e-4, rtol=0)


def test_older_mixtral_files_with_one_tensor_per_expert_load_the_same_weights(family_files, tmp_path):
    path, _ = family_files("mixtral")
    legacy = convert(os.path.join(os.path.dirname(path), "hf"), "mixtral", str(tmp_path / "per-expert.gguf"),
                     per_expert=True)
    assert "blk.0.ffn_gate.3.weight" in {t.name for t in gguf.GGUFReader(legacy).tensors}
    (_, stacked), (_, per_expert) = load_gguf(path), load_gguf(legacy)
    a, b = _weights(stacked), _weights(per_expert)
    assert a.keys() == b.keys() and ("blocks", "mlp", "w_down") in a
    for key, value in a.items():
        np.testing.assert_array_equal(value, b[key], err_msg=str(key))


def _weights(model) -> dict:
    """Path -> the weight as a host array (an expert stack's w)."""
    out = {}
    for key, var in nnx.to_flat_state(nnx.state(model)):
        value = var.get_value()
        out[key] = np.asarray(getattr(value, "w", value))
    return out


def _log_softmax(z):
    z = np.asarray(z, np.float64)
    return z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)


def test_q8_0_file_loads_quantized_close_to_float(family_files):
    """quantize="q8_0" (the CPU default's family): the Q8_0 linears as stored, the experts rounded to per-channel
    int8 one expert at a time as they are read; log-probabilities within the int8 tests' bound of transformers' on
    the file's values."""
    path, want = family_files("qwen3_moe")
    _, quantized = load_gguf(path, quantize="q8_0")
    assert quantized.blocks.mlp.w_gate.get_value().w.dtype == jnp.int8
    ref = _log_softmax(want)
    got = _log_softmax(nnx.jit(dense_logits)(prepare_model(quantized, "q8_0", jnp.float32), _tokens()))
    assert 1e-6 < np.abs(got - ref).max() < LOGPROB_TOL


def _write_metadata_only(path: str, arch: str, **keys) -> str:
    writer = gguf.GGUFWriter(path, arch)
    for key, value in keys.items():
        (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(f"{arch}.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_shared_expert_file_is_refused_by_name(tmp_path):
    """A Qwen2-MoE file (qwen2moe: one shared expert beside the routed ones, given by its width)."""
    path = _write_metadata_only(str(tmp_path / "qwen2moe.gguf"), "qwen2moe", block_count=2, embedding_length=64,
                                expert_count=4, expert_used_count=2, expert_feed_forward_length=32,
                                expert_shared_feed_forward_length=64)
    with pytest.raises(ValueError, match="qwen2moe: shared experts are not supported"):
        load_gguf(path)


MOE_META = {"general.architecture": "qwen3moe", "qwen3moe.block_count": 2, "qwen3moe.embedding_length": 64,
            "qwen3moe.attention.head_count": 4, "qwen3moe.attention.head_count_kv": 2, "qwen3moe.vocab_size": 256,
            "qwen3moe.expert_count": 4, "qwen3moe.expert_used_count": 2, "qwen3moe.expert_feed_forward_length": 32}


@pytest.mark.parametrize("change, message", [
    ({"qwen3moe.expert_shared_count": 2}, "shared experts are not supported"),
    ({"qwen3moe.expert_gating_func": 2}, r"expert_gating_func 2 \(2: sigmoid\) is not supported"),
    ({"qwen3moe.expert_weights_scale": 2.5}, "expert_weights_scale 2.5 is not supported"),
    ({"qwen3moe.leading_dense_block_count": 1}, "some layers have a dense MLP"),
    ({"qwen3moe.expert_used_count": None}, "missing qwen3moe.expert_used_count"),
    ({"qwen3moe.expert_count": None}, "missing qwen3moe.expert_count"),
    ({"general.architecture": "qwen2moe"}, "GGUF architecture 'qwen2moe' is not supported"),
])
def test_unsupported_moe_metadata_is_refused_by_name(change, message):
    meta = {k: v for k, v in {**MOE_META, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        config_from_gguf(meta, has_output_tensor=True)


def test_expert_weights_norm_in_the_file_wins_over_the_architectures_default():
    cfg = config_from_gguf({**MOE_META, "qwen3moe.expert_weights_norm": False}, has_output_tensor=True)
    assert cfg.norm_topk_prob is False and cfg.moe_intermediate_size == 32 and cfg.intermediate_size == 32
