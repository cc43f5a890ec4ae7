"""Every architecture's forward pass against transformers on tiny random checkpoints, through both the
dense reference and the engine's ragged paged steps."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from flax import nnx

from slipstream.models.base import dense_logits
from slipstream.models.loader import load_hf_dir
from tests.conftest import build_tiny_hf

FAMILIES = [("llama", False), ("llama", True), ("llama3", False), ("llama_yarn", False),
            ("qwen3_yarn", False), ("phi3", False), ("phi3_short", True), ("mistral", False), ("qwen2", True),
            ("qwen3", False), ("gemma3", True), ("qwen3_moe", False), ("mixtral", False), ("olmoe", False)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_llama_dir):
    """family, tie -> a tiny random checkpoint's directory, saved once for the run (Gemma 3's is tied
    whatever tie says; its logits, ragged-step and no-copy tests read one checkpoint, Qwen3's two tests
    another); tests only read them."""
    built = {("llama", False): tiny_llama_dir}

    def get(family: str, tie: bool = False) -> str:
        if (family, tie) not in built:
            built[family, tie] = build_tiny_hf(str(tmp_path_factory.mktemp(f"{family}-{tie}")), family, tie=tie)
        return built[family, tie]

    return get


def _batch(rng, lengths, width):
    tokens = np.zeros((len(lengths), width), np.int32)
    valid = np.zeros((len(lengths), width), bool)
    for i, n in enumerate(lengths):
        tokens[i, :n] = rng.integers(3, 256, n)
        valid[i, :n] = True
    return tokens, valid


def _hf_logits(path, tokens, lengths):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for i, n in enumerate(lengths):
        with torch.no_grad():
            out.append(hf(torch.tensor(tokens[i:i + 1, :n], dtype=torch.long)).logits[0].numpy())
    return out


@pytest.mark.parametrize("family,tie", FAMILIES)
def test_logits_match_transformers(checkpoint, family, tie):
    path = checkpoint(family, tie)
    cfg, model = load_hf_dir(path)
    assert cfg.tie_embeddings == tie
    lengths = [12, 7, 20]  # a right-padded batch; the sliding window of 8 is crossed
    tokens, valid = _batch(np.random.default_rng(0), lengths, 20)
    ours = np.asarray(nnx.jit(dense_logits)(model, tokens, valid))
    for i, (n, ref) in enumerate(zip(lengths, _hf_logits(path, tokens, lengths))):
        np.testing.assert_allclose(ours[i, :n], ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["gemma3", "qwen3", "phi3", "qwen3_moe", "mixtral", "olmoe"])
def test_engine_ragged_steps_match_transformers(checkpoint, family):
    """Chunked prefill of two sequences in mixed steps through the paged cache: each chunk's last
    logits equal HF's at that position (Gemma 3: both layer kinds, past its window of 8; the MoE families:
    each step's tokens routed together, through the engine's block loop over sorted rows)."""
    from slipstream.engine.api import StepBatch, StepSeq
    from slipstream.engine.device.runner import EngineConfig, JaxEngine

    path = checkpoint(family, family == "gemma3")
    cfg, model = load_hf_dir(path)
    engine = JaxEngine(cfg, model, EngineConfig(max_slots=2, page_size=8, max_seq_len=64, num_pages=16,
                                                max_num_batched_tokens=16, quantize="none"), precompile=False)
    lengths = [21, 13]
    tokens, _ = _batch(np.random.default_rng(1), lengths, 21)
    refs = _hf_logits(path, tokens, lengths)
    pages = [[1, 2, 3], [4, 5]]
    done = [0, 0]
    while done != lengths:
        seqs = []
        for s in range(2):
            n = min(5 if s == 0 else 4, lengths[s] - done[s])
            if n:
                seqs.append(StepSeq(s, tokens[s, done[s]:done[s] + n].tolist(), done[s], pages[s], sample=True))
        logits = engine.model_logits(StepBatch(seqs))
        for row, seq in zip(logits, seqs):
            end = seq.start_pos + len(seq.token_ids)
            np.testing.assert_allclose(row, refs[seq.slot][end - 1], atol=1e-4, rtol=0)
            done[seq.slot] = end


def test_bf16_forward_is_close_to_f32(tiny_llama_dir):
    import jax.numpy as jnp

    _, model = load_hf_dir(tiny_llama_dir)
    tokens = np.arange(3, 19, dtype=np.int32)[None]
    f32 = np.asarray(nnx.jit(dense_logits)(model, tokens))
    _, model16 = load_hf_dir(tiny_llama_dir, dtype="bfloat16")
    bf16 = np.asarray(nnx.jit(dense_logits, static_argnames="dtype")(model16, tokens, dtype=jnp.bfloat16))
    assert np.abs(bf16 - f32).max() < 0.1 * np.abs(f32).max()
    assert (bf16.argmax(-1) == f32.argmax(-1)).mean() > 0.9


def test_unknown_architecture_is_named_with_the_supported_ones(tmp_path):
    import json

    from slipstream.models.loader import ModelLoadError

    path = build_tiny_hf(str(tmp_path), "llama")
    with open(f"{path}/config.json") as f:
        data = json.load(f)
    data["architectures"] = ["FalconForCausalLM"]
    with open(f"{path}/config.json", "w") as f:
        json.dump(data, f)
    with pytest.raises((ValueError, ModelLoadError), match="FalconForCausalLM.*Gemma3ForCausalLM"):
        load_hf_dir(path)


def test_gemma3_step_copies_no_cache(checkpoint):
    """Both layer kinds under one layer scan: the compiled step holds no cache-sized copy (a branch
    between two attention calls made XLA copy the cache 4 times per step)."""
    import re

    from slipstream.engine.device.runner import EngineConfig, JaxEngine

    cfg, model = load_hf_dir(checkpoint("gemma3", True))
    assert set(cfg.layer_types) == {"sliding", "full"}
    engine = JaxEngine(cfg, model, EngineConfig(max_slots=2, page_size=8, max_seq_len=64, num_pages=16,
                                                max_num_batched_tokens=16, quantize="none"), precompile=False)
    hlo = engine._model_jit.lower(*engine._model_args(16)).compile().as_text()
    dims = ",".join(map(str, engine._cache_spec["k"].shape))
    copies = [line.strip() for line in hlo.splitlines()
              if re.search(r"\bcopy(-start)?\(", line) and f"[{dims}]" in line.split("=", 1)[1].split("copy")[0]]
    assert not copies, "cache-sized copies in the compiled step:\n" + "\n".join(copies)


def test_longrope_for_a_short_context_gives_transformers_short_factor_logits(checkpoint):
    """Phi's LongRoPE: a server whose sequences stay within the original context (ModelConfig.for_context) rotates
    with the short factors, as transformers does for such a sequence; the long ones give other logits."""
    path = checkpoint("phi3")
    cfg, model = load_hf_dir(path)  # a context of 512 past the original 4: the long factors
    tokens = np.random.default_rng(2).integers(3, 256, (1, 4)).astype(np.int32)
    ref = _hf_logits(path, tokens, [4])[0]
    long = np.asarray(nnx.jit(dense_logits)(model, tokens))[0]
    model.cfg = cfg.for_context(4)
    short = np.asarray(nnx.jit(dense_logits)(model, tokens))[0]
    np.testing.assert_allclose(short, ref, atol=1e-4, rtol=0)
    assert np.abs(long - ref).max() > 1e-3  # 80x the tolerance at these 4 positions


def test_an_engine_serving_a_short_context_runs_longrope_with_the_short_factors(checkpoint):
    """The engine rotates by the context it serves (max_seq_len), not by the model's longest: sequences that stay
    within Phi's original context give transformers' logits."""
    from slipstream.engine.api import StepBatch, StepSeq
    from slipstream.engine.device.runner import EngineConfig, JaxEngine

    path = checkpoint("phi3")
    cfg, model = load_hf_dir(path)
    tokens = np.random.default_rng(2).integers(3, 256, (1, 4)).astype(np.int32)
    ref = _hf_logits(path, tokens, [4])[0]
    engine = JaxEngine(cfg, model, EngineConfig(max_slots=1, page_size=4, max_seq_len=4, num_pages=3,
                                                max_num_batched_tokens=4, quantize="none"), precompile=False)
    (logits,) = engine.model_logits(StepBatch([StepSeq(0, tokens[0].tolist(), 0, [1], sample=True)]))
    np.testing.assert_allclose(logits, ref[3], atol=1e-4, rtol=0)
