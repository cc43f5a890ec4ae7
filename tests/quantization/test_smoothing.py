"""SmoothQuant folding: exact in float, and it is what makes w8a8 hold up against activation outliers."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from engine.params import prepare_params
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


def test_prepare_params_smooths_with_tokens_and_refuses_quantized_params(tiny_model):
    cfg, params = tiny_model
    params = _with_outliers(params)
    with pytest.warns(UserWarning, match="not smoothed"):
        plain = prepare_params(params, cfg, "w8a8", jnp.float32)
    prepared = prepare_params(params, cfg, "w8a8", jnp.float32, calibration_tokens=list(TOKENS[0]))
    assert isinstance(prepared["layers"]["wq"], QuantizedWeight)
    assert not np.allclose(prepared["layers"]["attn_norm"], plain["layers"]["attn_norm"])
    with pytest.raises(ValueError, match="already quantized"), pytest.warns(UserWarning):
        prepare_params(prepared, cfg, "w8a8", jnp.float32)


def test_calibration_rejects_tokens_outside_the_vocabulary(tiny_model):
    cfg, params = tiny_model
    with pytest.raises(ValueError, match=r"token ids in \[0, 256\)"):
        smooth_for_mode(params, cfg, "w8a8", [5, 300])
    with pytest.raises(ValueError, match="int8 modes"):
        smooth_for_mode(params, cfg, "none", [5, 6])


def test_alpha_search_is_closer_to_f32_than_a_fixed_alpha(tiny_model):
    from quantization.smoothing import ALPHA_GRID, MODE_ALPHA, _fake_w8a8, search_alpha, smoothing_factors

    cfg, params = tiny_model
    params = _with_outliers(params, factor=200.0)
    stats = activation_stats(params, cfg, jnp.asarray(TOKENS), samples=32)
    xs = {name: stats[name + "_x"] for name, _ in INPUTS}
    chosen = search_alpha(params["layers"], stats, xs, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads)

    def error(alpha):  # the w8a8 output error of the q/k/v group, summed over layers
        s = smoothing_factors(params["layers"], stats, alpha, num_heads=cfg.num_heads,
                              num_kv_heads=cfg.num_kv_heads)["attn_in"]
        w = jnp.concatenate([params["layers"][n] for n in ("wq", "wk", "wv")], -1)
        return float(jnp.sum((_fake_w8a8(xs["attn_in"] / s[:, None], w * s[:, :, None])
                              - jnp.einsum("lnc,lco->lno", xs["attn_in"], w)) ** 2))

    # the search's pick is the grid's best for this loss, measurably better than the tuned fixed alpha
    assert error(chosen) <= min(error(a) for a in ALPHA_GRID) * 1.0001
    assert error(chosen) < 0.999 * error(MODE_ALPHA["w8a8"]["attn_in"]), (error(chosen), chosen)


def test_w8a8_keeps_the_outlier_layers_w_down_at_w8a16(tiny_model):
    from models.calibration import outlier_layers

    cfg, params = tiny_model
    lp = dict(params["layers"])
    # layer 1's MLP hidden channel 5 fires 500x harder; w_down's row reading it shrinks to match
    up = jnp.ones(lp["w_up"].shape[1:]).at[:, 5].set(500.0)
    lp["w_up"] = lp["w_up"].at[1].multiply(up)
    lp["w_down"] = lp["w_down"].at[1, 5].divide(500.0)
    params = {**params, "layers": lp}
    stats = activation_stats(params, cfg, jnp.asarray(TOKENS))
    keep = outlier_layers(np.asarray(stats["mlp_hidden"]), 1)
    assert keep.tolist() == [i == 1 for i in range(cfg.num_layers)]
    prepared = prepare_params(params, cfg, "w8a8", jnp.float32, calibration_tokens=list(TOKENS[0]))
    assert np.asarray(prepared["layers"]["w_down"].keep_a16).tolist() == keep.tolist()
    # the kept layer's matmul runs w8a16: closer to float than an all-w8a8 copy of the same weights
    ref = _logits(params, cfg)
    mixed = np.abs(_logits(prepared, cfg) - ref).mean()
    lp_all = dict(prepared["layers"])
    lp_all["w_down"] = QuantizedWeight(q=lp_all["w_down"].q, scale=lp_all["w_down"].scale, mode="w8a8")
    all_a8 = np.abs(_logits({**prepared, "layers": lp_all}, cfg) - ref).mean()
    assert mixed < all_a8, (mixed, all_a8)
