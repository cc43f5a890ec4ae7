"""quantize_weight / quantize / weight_bytes: error bounds and what the params transform touches."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from quantization.weights import MODES, QuantizedWeight, quantize, quantize_weight, weight_bytes

L, D, H, KV, HD, F, V = 2, 32, 4, 2, 8, 48, 64


def tiny_params(*, tied: bool = False, bias: bool = False, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)

    def f(*shape):
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32))

    layers = {
        "attn_norm": f(L, D), "mlp_norm": f(L, D),
        "wq": f(L, D, H * HD), "wk": f(L, D, KV * HD), "wv": f(L, D, KV * HD),
        "wo": f(L, H * HD, D), "w_gate": f(L, D, F), "w_up": f(L, D, F), "w_down": f(L, F, D),
    }
    if bias:
        layers.update(bq=f(L, H * HD), bk=f(L, KV * HD), bv=f(L, KV * HD))
    params = {"embed": f(V, D), "layers": layers, "final_norm": f(D)}
    if not tied:
        params["lm_head"] = f(D, V)
    return params


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
@pytest.mark.parametrize("shape", [(16, 8), (3, 40, 24)])
def test_round_trip_error_is_at_most_half_a_step_per_column(mode, shape):
    rng = np.random.default_rng(1)
    w = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 10, shape[-1])
    qw = quantize_weight(jnp.asarray(w), mode)
    assert qw.q.dtype == jnp.int8 and qw.q.shape == shape
    assert qw.scale.dtype == jnp.float32 and qw.scale.shape == shape[:-2] + shape[-1:]
    scale = np.asarray(qw.scale)
    np.testing.assert_allclose(scale, np.abs(w).max(axis=-2) / 127, rtol=1e-6)
    err = np.abs(w - np.asarray(qw.dequantize()))
    assert np.all(err <= scale[..., None, :] / 2 * (1 + 1e-5))
    # Each column uses the full int8 range, so no precision is wasted.
    assert np.all(np.abs(np.asarray(qw.q)).max(axis=-2) == 127)


def test_zero_column_dequantizes_to_zeros_without_nans():
    w = np.random.default_rng(2).standard_normal((8, 4)).astype(np.float32)
    w[:, 2] = 0.0
    qw = quantize_weight(jnp.asarray(w), "w8a16")
    deq = np.asarray(qw.dequantize())
    assert np.all(np.isfinite(deq)) and np.all(deq[:, 2] == 0.0)


def test_bf16_weight_is_quantized_from_its_values():
    w = jnp.asarray(np.random.default_rng(3).standard_normal((16, 8)), jnp.bfloat16)
    qw = quantize_weight(w, "w8a8")
    err = np.abs(np.asarray(w, np.float32) - np.asarray(qw.dequantize()))
    assert np.all(err <= np.asarray(qw.scale) / 2 * (1 + 1e-5))
    assert qw.dequantize(jnp.bfloat16).dtype == jnp.bfloat16


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
def test_quantize_replaces_only_linear_weights(mode):
    params = tiny_params(bias=True)
    out = quantize(params, mode)
    for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        qw = out["layers"][name]
        assert isinstance(qw, QuantizedWeight) and qw.mode == mode
        assert qw.shape == params["layers"][name].shape  # stacked [L, in, out] kept
    for name in ("attn_norm", "mlp_norm", "bq", "bk", "bv"):
        assert out["layers"][name] is params["layers"][name]
    for name in ("embed", "final_norm", "lm_head"):
        assert out[name] is params[name]
    # The input pytree is not mutated.
    assert not isinstance(params["layers"]["wq"], QuantizedWeight)


def test_include_embeddings_quantizes_lm_head_but_never_embed():
    params = tiny_params()
    out = quantize(params, "w8a16", include_embeddings=True)
    assert isinstance(out["lm_head"], QuantizedWeight)
    assert out["embed"] is params["embed"]
    tied = tiny_params(tied=True)
    out_tied = quantize(tied, "w8a16", include_embeddings=True)
    assert "lm_head" not in out_tied and out_tied["embed"] is tied["embed"]


def test_mode_none_returns_params_unchanged():
    params = tiny_params()
    assert quantize(params, "none") is params


@pytest.mark.parametrize("call", [
    lambda: quantize(tiny_params(), "int4"),
    lambda: quantize_weight(jnp.ones((4, 4)), "int4"),
])
def test_unknown_mode_is_rejected_naming_the_allowed_modes(call):
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert "int4" in message
    assert "w8a16" in message and "w8a8" in message


def test_all_modes_constant_lists_none_first():
    assert MODES == ("none", "w8a16", "w8a8", "q8_0", "q8_0-a16")


def test_quantizing_twice_is_an_error():
    once = quantize(tiny_params(), "w8a8")
    with pytest.raises(ValueError, match="already quantized"):
        quantize(once, "w8a8")


LINEAR = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def test_weight_bytes_of_quantized_params_is_about_a_quarter():
    params = tiny_params()
    quantized = quantize(params, "w8a16", include_embeddings=True)
    f32_bytes = weight_bytes(params)
    assert f32_bytes == sum(x.size * 4 for x in jax.tree_util.tree_leaves(params))
    linear = [params["layers"][n] for n in LINEAR] + [params["lm_head"]]
    linear_f32 = sum(w.size * 4 for w in linear)
    # int8 q keeps 1 of 4 bytes per element; each output column adds one f32 scale.
    linear_q = sum(w.size + (w.size // w.shape[-2]) * 4 for w in linear)
    assert weight_bytes(quantized) == f32_bytes - linear_f32 + linear_q
    assert 0.25 < linear_q / linear_f32 < 0.30


def test_progress_bar_goes_to_stderr(capsys):
    quantize(tiny_params(), "w8a8", progress=True)
    captured = capsys.readouterr()
    assert "quantize w8a8" in captured.err and captured.out == ""
    quantize(tiny_params(), "w8a8")
    assert capsys.readouterr().err == ""


def test_quantized_params_pass_through_jit():
    out = quantize(tiny_params(), "w8a8")
    back = jax.jit(lambda p: p)(out)
    assert isinstance(back["layers"]["wq"], QuantizedWeight)
    assert back["layers"]["wq"].mode == "w8a8"
    np.testing.assert_array_equal(back["layers"]["wq"].q, out["layers"]["wq"].q)
