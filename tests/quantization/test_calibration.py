"""Calibration statistics are per-channel maxima of each linear's input, checked against transformers'
own forward; the shipped calibration text is not the eval text."""
from __future__ import annotations

import os
import re

import jax.numpy as jnp
import numpy as np

from models.calibration import activation_stats, calibration_text

TOKENS = np.random.default_rng(1).integers(3, 256, (2, 40)).astype(np.int32)
EVAL_TEXT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "data", "eval.txt")


def _hf_input_maxima(model_dir: str) -> dict[str, np.ndarray]:
    """max |input| per channel of every linear group, recorded with hooks on the HF model."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    seen: dict[str, list[np.ndarray]] = {}

    def hook(name):
        def record(module, args):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1]).abs().amax(0).numpy()
            seen.setdefault(name, []).append(x)
        return record

    for layer in model.model.layers:
        layer.self_attn.q_proj.register_forward_pre_hook(hook("attn_in"))
        layer.self_attn.o_proj.register_forward_pre_hook(hook("attn_out"))
        layer.mlp.gate_proj.register_forward_pre_hook(hook("mlp_in"))
        layer.mlp.down_proj.register_forward_pre_hook(hook("mlp_hidden"))
    model.lm_head.register_forward_pre_hook(hook("final"))
    with torch.no_grad():
        model(torch.as_tensor(TOKENS, dtype=torch.long))
    return {name: np.stack(xs) if name != "final" else xs[0] for name, xs in seen.items()}


def test_stats_are_per_channel_maxima_of_each_linear_input(tiny_llama_dir, tiny_model):
    cfg, params = tiny_model
    stats = activation_stats(params, cfg, jnp.asarray(TOKENS))
    expected = _hf_input_maxima(tiny_llama_dir)
    for name, want in expected.items():
        got = np.asarray(stats[name])
        assert got.shape == want.shape, name
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=name)


def test_gram_is_the_sum_of_outer_products(tiny_model):
    cfg, params = tiny_model
    stats = activation_stats(params, cfg, jnp.asarray(TOKENS), gram=True)
    # layer 0's q/k/v input is the normed embedding: computable directly
    x = np.asarray(params["embed"])[TOKENS].reshape(-1, cfg.hidden_size)
    x = x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_norm_eps) * np.asarray(params["layers"]["attn_norm"][0])
    np.testing.assert_allclose(stats["attn_in_gram"][0], x.T @ x, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(stats["attn_in"][0], np.abs(x).max(0), rtol=1e-5)


def test_calibration_text_is_shipped_and_shares_no_passage_with_the_eval_text():
    cal = calibration_text()
    words = lambda s: re.findall(r"[a-z']+", s.lower())  # noqa: E731
    with open(EVAL_TEXT, encoding="utf-8") as f:
        ev = words(f.read())
    cw = words(cal)
    assert len(cw) > 400
    n = 8
    eval_grams = {tuple(ev[i:i + n]) for i in range(len(ev) - n)}
    shared = [cw[i:i + n] for i in range(len(cw) - n) if tuple(cw[i:i + n]) in eval_grams]
    assert not shared, shared[:3]
