"""quantize_weight / weight_bytes: modes, errors, and what an int8 weight costs and keeps."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from slipstream.quantization.weights import MODES, QuantizedWeight, quantize_weight, weight_bytes


def test_unknown_mode_is_rejected_naming_the_allowed_modes():
    with pytest.raises(ValueError) as info:
        quantize_weight(jnp.ones((32, 4)), "int3")
    message = str(info.value)
    assert "int3" in message and "q8_0" in message and "q8_0-a16" in message and "int4" in message


def test_all_modes_constant_lists_none_first():
    assert MODES == ("none", "q8_0", "q8_0-a16", "int8", "int4", "int8-channel", "int8-channel-a16",
                     "int8-channel-w16")


@pytest.mark.parametrize("bad,match", [(jnp.ones(32), "shape"), (jnp.ones((32, 4), jnp.int32), "floating")])
def test_bad_weights_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        quantize_weight(bad, "q8_0")


def test_requantizing_a_loader_built_weight_keeps_its_bytes_and_sets_the_mode():
    w = np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32)
    once = quantize_weight(jnp.asarray(w), "q8_0")
    again = quantize_weight(once, "q8_0-a16")
    assert again.mode == "q8_0-a16" and again.q is once.q and again.scale is once.scale


def test_weight_bytes_of_a_q8_0_weight_is_about_a_quarter_plus_scales():
    w = jnp.asarray(np.random.default_rng(1).standard_normal((3, 256, 128)).astype(np.float32))
    qw = quantize_weight(w, "q8_0")
    ratio = weight_bytes(qw) / weight_bytes(w)
    assert weight_bytes(w) == w.size * 4
    assert 0.25 < ratio < 0.25 + 4 / 32 / 4 + 0.01  # int8 plus one f32 scale per 32 inputs


def test_quantized_weight_passes_through_jit():
    qw = quantize_weight(jnp.ones((2, 64, 32)), "q8_0-a16")
    back = jax.jit(lambda p: p)(qw)
    assert isinstance(back, QuantizedWeight) and back.mode == "q8_0-a16" and back.shape == (2, 64, 32)
    np.testing.assert_array_equal(back.q, qw.q)
