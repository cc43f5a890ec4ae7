"""SmoothQuant folding: exact in float, and it is what makes w8a8 hold up against activation outliers."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from engine.runner import prepare_params
from models.calibration import activation_stats, smooth_for_mode
from models.llama import forward_dense
from quantization import QuantizedWeight, quantize
from quantization.smoothing import INPUTS, smooth
from tests.conftest import build_tiny_hf

TOKENS = np.random.default_rng(0).integers(3, 256, (1, 48)).astype(np.int32)


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    from models.loader import load_hf_dir

    return load_hf_dir(build_tiny_hf(str(tmp_path_factory.mktemp("tiny-qwen2")), "qwen2"))


def _with_outliers(params: dict, factor: float = 60.0) -> dict:
    """The same float model, but channel 3 of each norm's output (the q/k/v and gate/up input) is
    `factor` times larger, with the weight rows reading it divided to match (SmolLM2-like outliers)."""
    lp = dict(params["layers"])
    up = jnp.ones(lp["attn_norm"].shape[-1]).at[3].set(factor)
    for norm, weights in (("attn_norm", ("wq", "wk", "wv")), ("mlp_norm", ("w_gate", "w_up"))):
        lp[norm] = lp[norm] * up
        for name in weights:
            lp[name] = lp[name] / up[:, None]
    return {**params, "layers": lp}


def _logits(params, cfg):
    return np.asarray(forward_dense(params, cfg, jnp.asarray(TOKENS)))


@pytest.mark.parametrize("model", ["tiny_model", "tiny_qwen2"])
def test_smoothing_leaves_float_logits_unchanged(model, request):
    cfg, params = request.getfixturevalue(model)  # both GQA (4 heads over 2); qwen2 has q/k/v biases
    params = _with_outliers(params)
    smoothed, factors = smooth(params, activation_stats(params, cfg, jnp.asarray(TOKENS)), alpha=0.5,
                               num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads)
    # the factors are far from 1, so a wrong fold (rows vs columns, head grouping, bias) shows
    for name, _ in INPUTS:
        assert float(jnp.max(factors[name]) / jnp.min(factors[name])) > 3, name
    np.testing.assert_allclose(_logits(smoothed, cfg), _logits(params, cfg), atol=1e-4)


def test_smoothing_brings_w8a8_closer_to_f32_with_activation_outliers(tiny_model):
    cfg, params = tiny_model
    params = _with_outliers(params)
    ref = _logits(params, cfg)
    plain = np.abs(_logits(quantize(params, "w8a8"), cfg) - ref).mean()
    smoothed = smooth_for_mode(params, cfg, "w8a8", TOKENS[0])
    err = np.abs(_logits(quantize(smoothed, "w8a8"), cfg) - ref).mean()
    assert err < 0.5 * plain, (err, plain)


def test_prepare_params_smooths_with_tokens_and_passes_prepared_params_through(tiny_model):
    cfg, params = tiny_model
    params = _with_outliers(params)
    with pytest.warns(UserWarning, match="not smoothed"):
        plain = prepare_params(params, cfg, "w8a8", jnp.float32)
    prepared = prepare_params(params, cfg, "w8a8", jnp.float32, calibration_tokens=list(TOKENS[0]))
    assert isinstance(prepared["layers"]["wq"], QuantizedWeight)
    assert not np.allclose(prepared["layers"]["attn_norm"], plain["layers"]["attn_norm"])
    again = prepare_params(prepared, cfg, "w8a8", jnp.float32)  # what JaxEngine does with them
    assert again["layers"]["wq"] is prepared["layers"]["wq"]
    with pytest.raises(ValueError, match="already quantized as w8a8"):
        prepare_params(prepared, cfg, "w8a16", jnp.float32)


def test_calibration_rejects_tokens_outside_the_vocabulary(tiny_model):
    cfg, params = tiny_model
    with pytest.raises(ValueError, match=r"token ids in \[0, 256\)"):
        smooth_for_mode(params, cfg, "w8a8", [5, 300])
    with pytest.raises(ValueError, match="int8 modes"):
        smooth_for_mode(params, cfg, "none", [5, 6])
