"""Dummy weights in the TPU's int8 modes are rounded one layer at a time into int8 stacks: the
program's temporaries are one layer's whatever the layer count (an 8B model's bf16 stack of one
weight kind, 3.8 GB, ran a 15.7 GiB chip out of memory), and each layer is the rounding of its own
random float layer, with the init's spread."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from slipstream.models import dummy
from slipstream.models.dummy import _draw_quantized, _normal, _rotated, _shifts
from slipstream.quantization import int8

IN, OUT = 256, 512


@pytest.fixture(autouse=True)
def tpu_int4(monkeypatch):
    """"int4" drawn in its TPU form here (on CPU the native kernel's group-wise rows are drawn instead)."""
    monkeypatch.setattr(dummy, "int4_on_cpu", lambda: False)


def _compiled_temp_bytes(fn, *args) -> tuple[int, int]:
    analysis = fn.lower(*args).compile().memory_analysis()
    return analysis.temp_size_in_bytes, analysis.output_size_in_bytes


@pytest.mark.parametrize("mode", int8.MODES)
def test_temporaries_are_one_layer_whatever_the_layer_count(mode):
    one = jnp.zeros((IN, OUT), jnp.bfloat16)
    layer_bytes = IN * OUT * 2
    temps, outs = {}, {}
    for layers in (2, 32):
        shifts = jnp.zeros((layers,), jnp.int32)
        temps[layers], outs[layers] = _compiled_temp_bytes(int8._quantize_loop, _rotated, layers, mode, (one, shifts))
    # the int8 stack itself is the output, L layers of it (int4: two 4-bit values a byte)
    assert outs[32] >= 32 * IN * OUT // (2 if mode == "int4" else 1)
    assert temps[32] == temps[2]  # does not grow with L
    assert temps[32] < 20 * layer_bytes  # a few f32 copies of one layer
    # rounding the whole float stack in one program (what a stacked bf16 draw then quantize does)
    # needs temporaries that grow with L: the measure can tell the two apart
    whole = {layers: _compiled_temp_bytes(int8._quantize_asymmetric, jnp.zeros((layers, IN, OUT), jnp.bfloat16),
                                          int8.GROUP)[0] for layers in (2, 32)}
    assert whole[32] > 8 * whole[2] and whole[32] > 4 * temps[32]


@pytest.mark.parametrize("mode", int8.MODES)
def test_each_layer_is_its_own_rounded_random_layer(mode):
    layers = 5
    w = _draw_quantized(np.random.default_rng(3), (layers, IN, OUT), mode, jnp.bfloat16)
    assert isinstance(w, int8.Int8Weight) and w.shape == (layers, IN, OUT) and w.q.dtype == jnp.int8
    groups = 1 if mode in int8.CHANNEL_MODES else IN // int8.GROUP
    assert w.scale.shape == (layers, groups, OUT)
    assert (w.offset is None) == (mode in int8.CHANNEL_MODES)
    # the same as rounding each float layer alone with the public function
    rng = np.random.default_rng(3)
    one = _normal(rng, (IN, OUT), 1 / math.sqrt(IN), jnp.bfloat16)
    shifts = jnp.asarray(_shifts(rng, layers, one.size), jnp.int32)
    for layer in (0, layers - 1):
        alone = int8.quantize(_rotated(layer, one, shifts), mode)
        np.testing.assert_array_equal(np.asarray(w.q[layer]), np.asarray(alone.q))
        np.testing.assert_array_equal(np.asarray(w.scale[layer]), np.asarray(alone.scale))
        assert (w.residual is None) == (alone.residual is None) == (mode != "int8-channel-w16")
        if w.residual is not None:
            np.testing.assert_array_equal(np.asarray(w.residual[layer]), np.asarray(alone.residual))
    dense = np.asarray(w.dequantize())
    assert dense.std() == pytest.approx(1 / math.sqrt(IN), rel=0.05)  # N(0, 1/fan_in)
    assert abs(dense.mean()) < 0.01 / math.sqrt(IN) * 10
    assert not np.allclose(dense[0], dense[1])
    q = np.asarray(w.q)
    assert q.min() < -100 and q.max() > 100  # the int8 range is used, not a few levels


def test_quantizing_a_float_stack_goes_layer_by_layer_with_the_same_result():
    """Real checkpoints on the TPU: int8.quantize of [L, in, out] rounds each layer as it would alone."""
    w = jax.random.normal(jax.random.key(1), (3, 64, 96))
    for mode in int8.MODES:
        stacked = int8.quantize(w, mode)
        for layer in range(3):
            alone = int8.quantize(w[layer], mode)
            np.testing.assert_array_equal(np.asarray(stacked.q[layer]), np.asarray(alone.q))
            np.testing.assert_array_equal(np.asarray(stacked.scale[layer]), np.asarray(alone.scale))
    with pytest.raises(ValueError, match="int8 weight mode"):
        int8.quantize_layers(_rotated, (w[0], jnp.zeros(3, jnp.int32)), 3, "q8_0")
