"""Architecture presets with dummy weights: every shipped config parses to the public model's numbers,
every weight's shape follows from them (abstractly, nothing allocated), the synthetic tokenizer has
exactly vocab_size tokens, random weights give finite, varied logits, and a preset without
--load-format dummy fails with a message that says what to do."""
from __future__ import annotations

import json
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest

from slipstream.models.architectures import build_abstract
from slipstream.models.base import dense_logits
from slipstream.models.config import ModelConfig
from slipstream.models.dummy import dummy_model
from slipstream.models.dummy_tokenizer import IM_END, IM_START, synthetic_tokenizer
from slipstream.models.registry import PRESET_DIR, architecture_presets, load_tokenizer, resolve_model

# name: (architecture, layers, hidden, heads, kv heads, head_dim, intermediate, vocab, tied, full layers)
PUBLIC = {
    "llama-3.1-8b": ("llama", 32, 4096, 32, 8, 128, 14336, 128256, False, 32),
    "llama-3.2-1b": ("llama", 16, 2048, 32, 8, 64, 8192, 128256, True, 16),
    "qwen3-0.6b": ("qwen3", 28, 1024, 16, 8, 128, 3072, 151936, True, 28),
    "qwen3-8b": ("qwen3", 36, 4096, 32, 8, 128, 12288, 151936, False, 36),
    "gemma-3-1b": ("gemma3", 26, 1152, 4, 1, 256, 6912, 262144, True, 4),
    "gemma-3-4b": ("gemma3", 34, 2560, 8, 4, 256, 10240, 262208, True, 5),
    "mistral-7b": ("llama", 32, 4096, 32, 8, 128, 14336, 32768, False, 32),
    "qwen3-30b-a3b": ("qwen3_moe", 48, 2048, 32, 4, 128, 6144, 151936, False, 48),
    "mixtral-8x7b": ("mixtral", 32, 4096, 32, 8, 128, 14336, 32000, False, 32),
    "olmoe-1b-7b": ("olmoe", 16, 2048, 16, 16, 128, 1024, 50304, False, 16),
    "phi-4-mini": ("phi3", 32, 3072, 24, 8, 128, 8192, 200064, True, 32),
    "llava-1.5-7b": ("llava", 32, 4096, 32, 32, 128, 11008, 32064, False, 32),
    "smolvlm-256m": ("idefics3", 30, 576, 9, 3, 64, 1536, 49280, False, 30),
}
# MoE presets: (experts, experts per token, expert width, top-k weights renormalised)
EXPERTS = {"qwen3-30b-a3b": (128, 8, 768, True), "mixtral-8x7b": (8, 2, 14336, True), "olmoe-1b-7b": (64, 8, 1024, False)}
# the dummy-weight tests' vocabulary: a multiple of the q8 kernel's 16-column tiles, like every preset's
VOCAB = 1024
# parameters of the public models (embedding counted once when tied), from their model cards
PARAMS_BILLIONS = {"llama-3.1-8b": 8.03, "llama-3.2-1b": 1.24, "qwen3-0.6b": 0.60, "qwen3-8b": 8.19,
                   "gemma-3-1b": 1.00, "gemma-3-4b": 3.88, "mistral-7b": 7.25, "qwen3-30b-a3b": 30.5,
                   "mixtral-8x7b": 46.7, "olmoe-1b-7b": 6.92, "phi-4-mini": 3.84,
                   "llava-1.5-7b": 7.06, "smolvlm-256m": 0.256}


def preset(name: str) -> ModelConfig:
    return ModelConfig.from_hf_json(os.path.join(PRESET_DIR, f"{name}.json"))


def shrunk_dir(tmp_path, name: str, vocab_size: int | None = None) -> str:
    """The preset's config.json with few layers and a small width: its architecture, head_dim,
    vocabulary (unless vocab_size is given), RoPE, layer kinds and special ids kept (Gemma 3: 6 layers,
    one of them global)."""
    with open(os.path.join(PRESET_DIR, f"{name}.json")) as f:
        top = cfg = json.load(f)
    if "text_config" in cfg:  # a vision-language model: its text model shrunk, and a 2-layer tower on small images
        cfg = top["text_config"]  # (LLaVA's 28x28: 4 patches; SmolVLM's 64x64: 16 patches, one row after its shuffle)
        top["vision_config"].update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    image_size=64 if top["model_type"] == "idefics3" else 28)
    ratio = cfg["num_attention_heads"] // cfg["num_key_value_heads"]
    if cfg["model_type"] == "phi3":  # its head_dim, whose rotated part LongRoPE's factors cover
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    heads = min(cfg["num_attention_heads"], 4)
    cfg.update(num_hidden_layers=6 if cfg["model_type"] == "gemma3_text" else 2, hidden_size=64,
               intermediate_size=128, num_attention_heads=heads, num_key_value_heads=max(1, heads // ratio))
    if "moe_intermediate_size" in cfg:  # the experts' own width (their count and top-k kept)
        cfg["moe_intermediate_size"] = 32
    if vocab_size is not None:
        cfg["vocab_size"] = vocab_size
        if top.get("image_token_index", 0) >= vocab_size:
            top["image_token_index"] = vocab_size - 1
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(top))
    return str(path)


def test_every_public_architecture_is_shipped():
    assert architecture_presets() == sorted(PUBLIC)


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_preset_config_has_the_public_numbers(name):
    cfg = preset(name)
    arch, layers, hidden, heads, kv, hd, inter, vocab, tied, full = PUBLIC[name]
    got = (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
           cfg.intermediate_size, cfg.vocab_size, cfg.tie_embeddings, cfg.layer_types.count("full"))
    assert got == PUBLIC[name]
    if arch == "gemma3":  # every 6th layer global, the rest sliding
        assert cfg.layer_types[5] == "full" and cfg.layer_types[0] == "sliding" and cfg.sliding_window
        assert cfg.rope_local_theta == 10000 and cfg.final_logit_softcap is None
    if name.startswith("llama-3"):
        assert cfg.rope_scaling.kind == "llama3" and cfg.rope_theta == 500000
    if arch == "phi3":  # RoPE on 96 of 128 dimensions, LongRoPE's long factors past 4k; its 256k window is none
        assert cfg.rotary_dim == 96 and cfg.sliding_window is None and cfg.rope_scaling.long
        assert not cfg.for_context(4096).rope_scaling.long and cfg.for_context(4097).rope_scaling.long
        assert cfg.rope_scaling.attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    moe = (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob)
    assert moe == EXPERTS.get(name, (0, 0, 0, False))
    assert cfg.qk_norm_full == (arch == "olmoe")


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_every_weight_shape_follows_from_the_config(name):
    """Abstract module state (no memory): each checkpoint tensor's [out, in] shape against the config."""
    cfg = preset(name)
    model = build_abstract(cfg)
    d, hd, layers = cfg.hidden_size, cfg.head_dim, cfg.num_layers
    q, kv, f = cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.moe_intermediate_size or cfg.intermediate_size
    qn, kn = (q, kv) if cfg.qk_norm_full else (hd, hd)
    expected = {"q_proj.weight": (q, d), "k_proj.weight": (kv, d), "v_proj.weight": (kv, d),
                "o_proj.weight": (d, q), "gate_proj.weight": (f, d), "up_proj.weight": (f, d),
                "down_proj.weight": (d, f), "w1.weight": (f, d), "w3.weight": (f, d), "w2.weight": (d, f),
                "gate.weight": (cfg.num_experts, d), "q_norm.weight": (qn,), "k_norm.weight": (kn,),
                "layernorm.weight": (d,), "embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,),
                "lm_head.weight": (cfg.vocab_size, d), "qkv_proj.weight[q]": (q, d), "qkv_proj.weight[k]": (kv, d),
                "qkv_proj.weight[v]": (kv, d), "gate_up_proj.weight[gate]": (f, d), "gate_up_proj.weight[up]": (f, d)}
    state = _weights(model)
    params = sum(math.prod(leaf.shape) for leaf in state.values())
    seen = 0
    v = cfg.vision
    if cfg.architecture == "llava":  # the tower's layers up to its feature layer (CLIP ViT-L/14 at 336 px: 23 of 24)
        assert state["vision.layers.wq"].shape == (v.num_layers, v.hidden_size, v.hidden_size) and v.num_layers == 23
        assert state["vision.position_embedding"].shape == (577, v.hidden_size) and v.num_image_tokens == 576
        assert state["projector.w1"].shape == (d, v.hidden_size)
    if cfg.architecture == "idefics3":  # SigLIP B/16 at 512 px, every layer and the post-norm; 4x4 shuffled: 64 rows
        assert state["vision.layers.wq"].shape == (12, 768, 768) and state["vision.post_norm_w"].shape == (768,)
        assert state["vision.position_embedding"].shape == (1024, 768) and v.num_image_tokens == 64
        assert state["connector.w"].shape == (d, 768 * 16)
    for w in type(model).WEIGHTS:
        leaf = state.get(w.path)
        if leaf is None or not w.path.split(".")[0] in ("embed", "final_norm", "lm_head", "blocks"):
            continue
        seen += 1
        want = next(shape for suffix, shape in expected.items() if w.hf.endswith(suffix))
        one = tuple(leaf.shape[2:] if w.experts else leaf.shape[1:] if w.per_layer else leaf.shape)
        assert (tuple(reversed(one)) if w.linear else one) == want, w.hf
        if w.per_layer:
            assert leaf.shape[0] == layers
        if w.experts:  # one checkpoint tensor per expert: [L, E, in, out]
            assert leaf.shape[1] == cfg.num_experts and "{e}" in w.hf
    assert seen >= 11
    assert params / 1e9 == pytest.approx(PARAMS_BILLIONS[name], rel=0.02)


@pytest.mark.parametrize("name", ["gemma-3-4b", "llama-3.1-8b", "qwen3-8b", "mistral-7b"])
def test_synthetic_tokenizer_has_the_vocabulary_and_round_trips(name):
    cfg = preset(name)
    tok = synthetic_tokenizer(cfg)
    assert tok.vocab_size == cfg.vocab_size
    assert len({tok.id_to_token(i) for i in range(cfg.vocab_size)}) == cfg.vocab_size
    text = "Hello, world!\n  Ünïcode 日本語 🚀\ttabs and spaces  "
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode())  # merged tokens, not one per byte
    assert set(cfg.eos_token_ids) <= tok.eos_token_ids
    assert tok.bos_token_id == cfg.bos_token_id
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == f"{IM_START}user\nhi{IM_END}\n{IM_START}assistant\n"
    chat_ids = tok.encode(chat, add_special_tokens=False)
    assert chat_ids[0] == tok._hf.token_to_id(IM_START) and cfg.eos_token_ids[0] in chat_ids
    rng = np.random.default_rng(0)
    assert tok.decode(rng.integers(0, cfg.vocab_size, 50).tolist())  # random ids decode to text


def test_preset_tokenizer_is_what_serving_loads():
    """`slipstream bench --model qwen3-0.6b` counts tokens with the tokenizer the dummy server uses."""
    from slipstream.server.bench.run import load_tokenizer as bench_tokenizer

    path = resolve_model("qwen3-0.6b", "dummy")
    served, counted = load_tokenizer(path), bench_tokenizer("qwen3-0.6b")
    assert served.vocab_size == counted.vocab_size == 151936
    assert served.encode("some text") == counted.encode("some text")


def test_preset_without_dummy_load_format_fails_clearly(capsys):
    with pytest.raises(FileNotFoundError, match="--load-format dummy"):
        resolve_model("llama-3.1-8b")
    from slipstream.server.cli import main

    # --compile-cache "": the engine builder would otherwise point this process's XLA cache at the user's
    # (~/.cache/slipstream/jax) before failing, and the run's later programs would load from or go there
    assert main(["generate", "--model", "llama-3.1-8b", "--prompt", "hi", "--compile-cache", ""]) == 2
    err = capsys.readouterr().err
    assert "architecture preset" in err and "--load-format dummy" in err


def test_dummy_needs_a_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(tmp_path), "dummy")
    with pytest.raises(ValueError, match="load format"):
        resolve_model("qwen3-0.6b", "safetensors")


# q8_0-a16 (the CPU's default) for each architecture tied and untied; mistral-7b's and gemma-3-1b's draws
# are llama-3.1-8b's and gemma-3-4b's at other sizes (test_presets_serve.py serves mistral-7b and
# gemma-3-4b in q8_0-a16)
Q8_DRAWN = ("llama-3.1-8b", "llama-3.2-1b", "qwen3-0.6b", "qwen3-8b", "gemma-3-4b")


@pytest.mark.parametrize("name, quantize", [*((n, "q8_0-a16") for n in Q8_DRAWN),
                                            ("gemma-3-1b", "none"), ("qwen3-0.6b", "none"),
                                            ("llama-3.2-1b", "int8"), ("llama-3.1-8b", "int8"),
                                            ("qwen3-0.6b", "int8-channel"), ("olmoe-1b-7b", "q8_0-a16"),
                                            ("qwen3-30b-a3b", "int8"), ("mixtral-8x7b", "none"),
                                            ("phi-4-mini", "q8_0-a16"), ("llava-1.5-7b", "q8_0-a16"),
                                            ("smolvlm-256m", "none")])
def test_dummy_weights_have_the_declared_shapes_and_give_varied_logits(tmp_path, name, quantize):
    # one vocabulary for all (the presets' own are checked above and served in test_presets_serve.py): the
    # embedding's and LM head's draws and the logits' programs compile once for the file
    cfg = ModelConfig.from_hf_json(os.path.join(shrunk_dir(tmp_path, name, vocab_size=VOCAB), "config.json"))
    abstract = build_abstract(cfg)
    model = dummy_model(cfg, quantize=quantize)
    want = {path: leaf.shape for path, leaf in _weights(abstract).items()}
    got = {path: leaf.shape for path, leaf in _weights(model).items()}
    if cfg.tie_embeddings and quantize != "none":
        assert got.pop("lm_head.w") == (cfg.hidden_size, cfg.vocab_size)  # int8 rows of the table, exact
        head = np.asarray(model.lm_head.w.get_value().dequantize())[:, :256]
        np.testing.assert_array_equal(head, np.asarray(model.embed.table.get_value())[:256].T)
    assert got == want
    if cfg.num_experts:  # experts drawn as int8 with one scale in every quantized mode, else floats
        experts = model.blocks.mlp.w_up.get_value()
        assert (experts.scale is not None) == (quantize != "none")
        assert experts.w.dtype == (np.int8 if quantize != "none" else np.float32)
        assert not np.array_equal(np.asarray(experts.w[0, 0]), np.asarray(experts.w[0, 1]))  # each its own draw
    elif quantize != "none":
        from slipstream.quantization import Int8Weight, QuantizedWeight

        kind = Int8Weight if quantize.startswith("int8") else QuantizedWeight
        assert isinstance(model.blocks.mlp.w_up.w.get_value(), kind)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 12)), jnp.int32)
    logits = np.asarray(dense_logits(model, tokens))
    assert np.isfinite(logits).all()
    assert 0.1 < logits.std() < 100
    assert len(set(logits.argmax(-1).ravel().tolist())) > 4  # not one token everywhere


@pytest.mark.parametrize("mode", ["q8_0", "int8", "int8-channel"])
def test_other_int8_formats_are_drawn_a_layer_at_a_time(mode):
    """A quantized format drawn from a float layer is rounded by quantization's public functions one
    layer at a time (the TPU's int8 modes in one program: tests/models/test_dummy_int8.py)."""
    from slipstream.models.dummy import _draw_quantized

    w = _draw_quantized(np.random.default_rng(0), (3, 64, 32), mode, jnp.float32)
    assert w.shape == (3, 64, 32)
    dense = np.asarray(w.dequantize())
    assert not np.allclose(dense[0], dense[1])  # each layer its own weights
    assert dense.std() == pytest.approx(1 / 8, rel=0.1)  # N(0, 1/fan_in)


def _weights(model) -> dict:
    from flax import nnx

    return {".".join(map(str, path)): var.get_value() for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
