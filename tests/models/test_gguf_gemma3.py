"""Gemma 3 GGUF files (general.architecture "gemma3", the text model) as llama.cpp's converter writes them: a tiny
random transformers checkpoint converted here with the gguf package (llama.cpp's tensor names, norm weights stored
as 1 + w, no output tensor: tied; no layer pattern in the file: every 6th layer global; the sliding layers' RoPE
base 10000) gives transformers' logits; and Gemma's SentencePiece vocabulary (no space prefix, control turn
markers, runs of spaces as user-defined tokens) encodes as llama.cpp does."""
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
from slipstream.models.gguf_config import config_from_gguf
from slipstream.models.loader import load_gguf
from slipstream.models.registry import load_tokenizer
from tests.models.test_gguf_spm_tokenizer import WHITESPACE_PIECES, _train, llama_cpp_encode

LAYERS = 6  # one of each kind under Gemma 3's pattern: layers 0-4 sliding, layer 5 global


def build_hf(path: str) -> str:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=2,
        eos_token_id=1, pad_token_id=0, tie_word_embeddings=True, sliding_window=8, query_pre_attn_scalar=16,
        sliding_window_pattern=6, final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}})
    cfg.architectures = ["Gemma3ForCausalLM"]
    model = transformers.Gemma3ForCausalLM(cfg)
    with torch.no_grad():  # random init leaves the norms at 0 (a scale of 1); make them matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0, 0.5)
    model.eval().save_pretrained(path, safe_serialization=True)
    return path


def convert(hf_dir: str, path: str) -> str:
    """hf_dir's checkpoint as convert_hf_to_gguf.py's Gemma3Model writes it (F32)."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    full = cfg["rope_parameters"]["full_attention"]
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_rope_freq_base(full["rope_theta"])  # the global layers'
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(full["factor"])
    writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    writer.add_sliding_window(cfg["sliding_window"])
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"<{i}>" for i in range(cfg["vocab_size"])])
    writer.add_token_scores([0.0] * cfg["vocab_size"])
    writer.add_token_types([1] * cfg["vocab_size"])
    writer.add_add_space_prefix(False)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, cfg["num_hidden_layers"])
    for name, arr in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        if name == "lm_head.weight":
            continue
        if name.endswith("norm.weight"):
            arr = arr + 1  # Gemma3RMSNorm's (1 + w), stored added
        new = names.get_name(name, try_suffixes=(".weight",))
        assert new is not None, name
        writer.add_tensor(new, arr.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    hf_dir = build_hf(str(root / "hf"))
    return hf_dir, convert(hf_dir, str(root / "gemma3.gguf"))


def test_gemma3_gguf_logits_equal_transformers(converted):
    import transformers

    hf_dir, path = converted
    cfg, model = load_gguf(path)
    assert cfg.layer_types == ("sliding",) * 5 + ("full",) and cfg.tie_embeddings and cfg.sliding_window == 8
    assert (cfg.rope_local_theta, cfg.rope_theta, cfg.rope_scaling.kind, cfg.sm_scale) == (1e4, 1e6, "linear", 0.25)
    tokens = np.random.default_rng(0).integers(3, 256, (2, 20)).astype(np.int32)  # past the window of 8
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(np.asarray(nnx.jit(dense_logits)(model, tokens)), want, atol=1e-4, rtol=0)


def test_gemma3_metadata_as_llama_cpp_reads_it():
    meta = {"general.architecture": "gemma3", "gemma3.block_count": 62, "gemma3.embedding_length": 5376,
            "gemma3.attention.head_count": 32, "gemma3.attention.head_count_kv": 16, "gemma3.attention.key_length": 128,
            "gemma3.feed_forward_length": 21504, "gemma3.attention.sliding_window": 1024, "gemma3.vocab_size": 262208}
    big = config_from_gguf(meta, has_output_tensor=False)
    assert big.query_pre_attn_scalar == 168 and big.head_dim == 128  # 27B: hidden / heads, as its checkpoint says
    assert big.layer_types.count("full") == 10 and big.layer_types[5] == "full" and big.rope_local_theta == 1e4
    small = config_from_gguf({**meta, "gemma3.block_count": 26, "gemma3.attention.sliding_window_pattern":
                                            [True, False] * 13}, has_output_tensor=False)
    assert small.query_pre_attn_scalar == 128 and small.layer_types[:3] == ("sliding", "full", "sliding")
    with pytest.raises(ValueError, match="sliding_window_pattern lists 4 layers, expected 26"):
        config_from_gguf({**meta, "gemma3.block_count": 26,
                                        "gemma3.attention.sliding_window_pattern": [True] * 4}, has_output_tensor=False)
    with pytest.raises(ValueError, match="missing gemma3.attention.sliding_window"):
        config_from_gguf({k: v for k, v in meta.items() if "sliding" not in k}, has_output_tensor=False)


# ---- Gemma's tokenizer ----------------------------------------------------------------------------------------

CONTROL = ["<start_of_turn>", "<end_of_turn>"]
SPACES = [" " * n for n in (2, 3, 4)]  # Gemma's runs of spaces: user-defined tokens spelled with real spaces


def gemma_vocab() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, types) laid out as Gemma 3's: <pad> <eos> <bos> <unk>, the turn markers, the byte tokens,
    the merged pieces (score: minus the merge rank), the characters, then the runs of spaces."""
    merged, chars = _train()
    merged = [m for m in merged if m not in WHITESPACE_PIECES]
    t = gguf.TokenType
    tokens = (["<pad>", "<eos>", "<bos>", "<unk>"] + CONTROL + [f"<0x{b:02X}>" for b in range(256)] + merged + chars
              + SPACES)
    scores = [0.0] * (6 + 256) + [-float(i) for i in range(len(merged) + len(chars))] + [-1000.0] * len(SPACES)
    types = ([t.CONTROL, t.CONTROL, t.CONTROL, t.UNKNOWN] + [t.CONTROL] * 2 + [t.BYTE] * 256
             + [t.NORMAL] * (len(merged) + len(chars)) + [t.USER_DEFINED] * len(SPACES))
    return tokens, scores, [int(x) for x in types]


def write_tokenizer(path: str, tokens, scores, types, *, add_eos: bool = False) -> str:
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(add_eos)
    writer.add_add_space_prefix(False)
    writer.add_chat_template("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
                             "{{ m['content'] }}<end_of_turn>\n{% endfor %}<start_of_turn>model\n")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def vocab():
    return gemma_vocab()


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory, vocab):
    return write_tokenizer(str(tmp_path_factory.mktemp("gemma-tok") / "gemma3-tok.gguf"), *vocab)


TEXTS = ["Hello world", " the fox", "The quick brown fox jumps over the lazy dog.", "runs of     spaces  and\ttabs",
         "line one\n\n  indented", "Un café crème à côté, déjà vu!", "emoji 😀 done", "",
         "<start_of_turn>user\nWhat is a fox?<end_of_turn>\n<start_of_turn>model\n"]


@pytest.mark.parametrize("text", TEXTS)
def test_gemma_tokenizer_encodes_as_llama_cpp(tokenizer_file, vocab, text):
    tok = load_tokenizer(tokenizer_file)
    assert tok.encode(text) == [2] + llama_cpp_encode(*vocab, text, add_bos=False, add_space_prefix=False)  # <bos> 2
    assert tok.decode(tok.encode(text)) == text.replace("<start_of_turn>", "").replace("<end_of_turn>", "")


def test_gemma_chat_prompt_and_special_tokens(tokenizer_file, vocab):
    tokens = vocab[0]
    tok = load_tokenizer(tokenizer_file)
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos, tok.add_eos_id) == (2, {1}, True, None)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi  there"}])
    ids = tok.encode(prompt, add_special_tokens=False)  # the template writes <bos> itself
    assert ids[:2] == [2, tokens.index("<start_of_turn>")] and tokens.index("  ") in ids
    assert ids.count(tokens.index("<start_of_turn>")) == 2 and ids.count(tokens.index("<end_of_turn>")) == 1
    assert ids == llama_cpp_encode(*vocab, prompt, add_bos=False, add_space_prefix=False)


def test_add_eos_token_is_honoured(tmp_path, vocab):
    tok = load_tokenizer(write_tokenizer(str(tmp_path / "eos.gguf"), *vocab, add_eos=True))
    ids = tok.encode("the fox")
    assert ids[0] == 2 and ids[-1] == 1 and ids[1:-1] == tok.encode("the fox", add_special_tokens=False)


# transformers' GGUF Gemma tokenizer reads the space runs as "▁▁" pieces merged with the word after them (" " +
# "▁indented"), llama.cpp matches them whole in the text first ("  " + "indented"); elsewhere they agree
@pytest.mark.parametrize("text", [text for text in TEXTS if "  " not in text])
def test_gemma_tokenizer_encodes_as_transformers(tokenizer_file, text):
    from transformers import AutoTokenizer

    ours = load_tokenizer(tokenizer_file)
    theirs = AutoTokenizer.from_pretrained(os.path.dirname(tokenizer_file), gguf_file=os.path.basename(tokenizer_file))
    assert ours.encode(text) == theirs(text)["input_ids"]
