"""The embedded default model (SmolLM2-135M-Instruct GGUF): our loader + forward vs transformers."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from models.llama import forward_dense
from models.loader import load_gguf
from models.registry import load_tokenizer

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n"]


def greedy_dense(params, cfg, ids: list[int], new_tokens: int, width: int = 96) -> list[int]:
    """Greedy decoding by recomputing a fixed-width padded window (one compile, no cache)."""
    step = jax.jit(lambda p, t, v: forward_dense(p, cfg, t, v))
    ids = list(ids)
    out = []
    for _ in range(new_tokens):
        tokens = np.zeros((1, width), np.int32)
        tokens[0, :len(ids)] = ids
        valid = np.arange(width)[None] < len(ids)
        logits = step(params, jnp.asarray(tokens), jnp.asarray(valid))
        row = np.array(logits[0, len(ids) - 1])
        row[list(cfg.eos_token_ids)] = -np.inf  # as transformers' min_new_tokens does
        nxt = int(row.argmax())
        out.append(nxt)
        ids.append(nxt)
    return out


@pytest.fixture(scope="module")
def hf_model(default_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.dirname(default_model_path),
                                                gguf_file=os.path.basename(default_model_path),
                                                dtype=torch.float32).eval()


def test_greedy_tokens_equal_transformers(default_model_path, hf_model):
    cfg, params = load_gguf(default_model_path)
    tok = load_tokenizer(default_model_path)
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        ours = greedy_dense(params, cfg, ids, 32)
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                    min_new_tokens=32, pad_token_id=2)[0, len(ids):].tolist()
        assert ours == ref, prompt
