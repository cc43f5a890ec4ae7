"""Our forward pass against transformers on tiny random checkpoints of each supported family."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from models.llama import forward_dense
from models.loader import load_hf_dir
from tests.conftest import build_tiny_hf


@pytest.mark.parametrize("family,tie", [("llama", False), ("llama", True), ("llama3", False),
                                        ("mistral", False), ("qwen2", True)])
def test_logits_match_transformers(tmp_path, family, tie):
    import transformers

    path = build_tiny_hf(str(tmp_path), family, tie=tie)
    cfg, params = load_hf_dir(path)
    assert cfg.tie_embeddings == tie
    rng = np.random.default_rng(0)
    lengths = [12, 7, 20]  # a right-padded batch; mistral's window of 8 is crossed
    tokens = np.zeros((3, 20), np.int32)
    valid = np.zeros((3, 20), bool)
    for i, n in enumerate(lengths):
        tokens[i, :n] = rng.integers(3, 256, n)
        valid[i, :n] = True
    ours = np.asarray(forward_dense(params, cfg, tokens, valid))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for i, n in enumerate(lengths):
        with torch.no_grad():
            ref = hf(torch.tensor(tokens[i:i + 1, :n], dtype=torch.long)).logits[0].numpy()
        np.testing.assert_allclose(ours[i, :n], ref, atol=1e-4, rtol=0)


def test_bf16_forward_is_close_to_f32(tiny_llama_dir):
    import jax.numpy as jnp

    cfg, params = load_hf_dir(tiny_llama_dir)
    tokens = np.arange(3, 19, dtype=np.int32)[None]
    f32 = np.asarray(forward_dense(params, cfg, tokens))
    _, params16 = load_hf_dir(tiny_llama_dir, dtype="bfloat16")
    bf16 = np.asarray(forward_dense(params16, cfg, tokens, dtype=jnp.bfloat16))
    assert np.abs(bf16 - f32).max() < 0.1 * np.abs(f32).max()
    assert (bf16.argmax(-1) == f32.argmax(-1)).mean() > 0.9
