"""quantization/int8.py (the TPU/GPU modes): matmuls against a float64 oracle of the stored weight,
rounding on the device, the exactness that keeps the default model's accuracy, and `auto` per backend. The
per-channel modes' XLA path (what TPU and GPU run) is pinned by `xla_per_channel`; on CPU they run the native
kernel, with every row rounded to int8 parts whatever the call's rows (the last tests)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from slipstream.engine.device.engine_config import EngineConfig
from slipstream.kernels import int8_channel_matmul as icm
from slipstream.quantization import Int8Weight, int8, ops, quantize_weight, weight_bytes, weights

SHAPES = [(1, 70, 33), (5, 64, 40), (3, 96, 17), (7, 33, 129)]  # K not a multiple of 32, N odd


def make(m: int, k: int, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((k, n)) / np.sqrt(k) + 0.02 * rng.standard_normal(n)).astype(np.float32)
    return x, w


def values(qw: Int8Weight) -> np.ndarray:
    """qw's integer values, one per weight: 4-bit ones unpacked here (kernels/tpu/nibbles.py's layout: byte row
    32j + i holds input 64j + i in its low nibble, 64j + 32 + i in its high one, two's complement)."""
    if qw.bits == 8:
        return np.asarray(qw.q, np.int64)
    b = np.asarray(qw.q).view(np.uint8).astype(np.int64)
    *lead, half, n = b.shape
    b = b.reshape(*lead, half // 32, 1, 32, n)
    low, high = b & 0xF, b >> 4
    nib = np.concatenate([low, high], axis=-3)
    return np.where(nib > 7, nib - 16, nib).reshape(*lead, 2 * half, n)


def stored(qw: Int8Weight) -> np.ndarray:
    """The weight qw stands for, in float64 from its int8 (or 4-bit) values and scales (not through its own code)."""
    k = qw.shape[-2]
    rep = lambda a: np.repeat(np.asarray(a, np.float64), qw.block, axis=-2)[..., :k, :]  # noqa: E731
    q = values(qw).astype(np.float64)
    if qw.residual is not None:   # int8-channel-w16
        q = q + np.asarray(qw.residual, np.float64) / int8.RESIDUAL
    w = q * rep(qw.scale)
    return w if qw.offset is None else w + rep(qw.offset)


def linear(x, w):
    return ops.linear(x, w)  # eager: the path is chosen per call (xla_per_channel), no trace cached across tests


@pytest.fixture(autouse=True)
def tpu_int4(monkeypatch):
    """"int4" in its TPU/GPU form (an Int8Weight of 4-bit values) here, not the native CPU kernel's group-wise rows
    (tests/quantization/test_groupwise.py)."""
    monkeypatch.setattr(weights, "int4_on_cpu", lambda: False)


@pytest.fixture
def xla_per_channel(monkeypatch):
    """The per-channel modes on XLA's path (as on TPU/GPU), not the native CPU kernel."""
    monkeypatch.setattr(int8, "_cpu_channel_native", lambda: False)


@pytest.mark.parametrize("mode", int8.MODES)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_w8a16_matmul_equals_the_float64_product_of_the_stored_weight(mode, m, k, n, xla_per_channel):
    x, w = make(m, k, n)
    if mode == "int4" and k % 64:  # 4-bit values pack in pairs of 32-input groups
        with pytest.raises(ValueError, match=f"multiple of 64 inputs.*{k}"):
            quantize_weight(jnp.asarray(w), mode)
        return
    qw = quantize_weight(jnp.asarray(w), mode)
    got = np.asarray(linear(jnp.asarray(x), qw), np.float64)
    ref = x.astype(np.float64) @ stored(qw)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    # and the stored weight is the float one within half a step of its block (w16: of its residual)
    step = np.repeat(np.asarray(qw.scale), qw.block, axis=-2)[:k]
    if mode == "int8-channel-w16":
        step = step / int8.RESIDUAL
        assert np.abs(np.asarray(qw.residual)).max() > 100   # the residual's range is used
    assert np.all(np.abs(stored(qw) - w) <= 0.5 * step * 1.0001 + 1e-7)


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_w8a8_matmul_equals_the_float64_product_of_int8_rows_and_weights(m, k, n, xla_per_channel):
    x, w = make(m, k, n, seed=1)
    qw = dataclasses.replace(quantize_weight(jnp.asarray(w), "int8-channel"), a8_rows=m)  # w8a8 from m rows
    got = np.asarray(linear(jnp.asarray(x), qw), np.float64)
    # the oracle: each row rounded to int8 with its own scale max|x| / 127
    xs = np.abs(x).max(axis=1, keepdims=True).astype(np.float64) / 127
    xq = np.clip(np.round(x / xs), -127, 127)
    ref = (xq * xs) @ stored(qw)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    # the int8 rows are what ran: the float-activation product differs by more than the tolerance
    w8a16 = x.astype(np.float64) @ stored(qw)
    assert np.abs(got - w8a16).max() > 1e-3 * np.abs(ref).max()
    # below a8_rows the same weight multiplies float activations
    fewer = dataclasses.replace(qw, a8_rows=m + 1)
    np.testing.assert_allclose(np.asarray(linear(jnp.asarray(x), fewer)), w8a16, rtol=0, atol=1e-5 * np.abs(ref).max())


def test_int8_channel_uses_int8_activations_from_prefill_sized_steps():
    qw = quantize_weight(jnp.ones((16, 4)), "int8-channel")
    assert qw.a8_rows == int8.A8_MIN_ROWS and quantize_weight(jnp.ones((16, 4)), "int8").a8_rows is None
    a16 = quantize_weight(jnp.ones((16, 4)), "int8-channel-a16")
    assert a16.a8_rows is None and (qw.parts, a16.parts) == (1, 2)


@pytest.mark.skipif(not icm.native_available(), reason="the native int8_channel_matmul kernel is not built")
@pytest.mark.parametrize("mode,parts", [("int8-channel", 1), ("int8-channel-a16", 2), ("int8-channel-w16", 2)])
def test_per_channel_modes_on_cpu_round_every_row_in_the_native_kernel(mode, parts):
    x, w = make(300, 70, 33, seed=4)
    qw = quantize_weight(jnp.asarray(w), mode)
    got = np.asarray(jax.jit(ops.linear)(jnp.asarray(x), qw))
    residual = None   # int8-channel-w16: plus the residual weight (scale / 254) on the first activation part
    if mode == "int8-channel-w16":
        residual = (np.asarray(qw.residual), np.asarray(int8.residual_scale(qw.scale))[0])
    want = icm.reference_numpy(x, np.asarray(qw.q), np.asarray(qw.scale)[0], parts, residual)
    np.testing.assert_array_equal(got, want)  # 300 rows: past A8_MIN_ROWS, and the same steps at every row count
    np.testing.assert_array_equal(np.asarray(jax.jit(ops.linear)(jnp.asarray(x[7:8]), qw)), want[7:8])
    # within half an activation step (max|x| / 127, two parts: / 254 again) per product of the stored weight's
    ref = x.astype(np.float64) @ stored(qw)
    step = np.abs(x).max(axis=1, keepdims=True) / 127 / (254 if parts == 2 else 1)
    bound = 0.5 * step * np.abs(stored(qw)).sum(axis=0)
    if mode == "int8-channel-w16":   # the residual's one part: half a step of max|x| / 127 per residual product
        lo = np.abs(np.asarray(qw.residual, np.float64)) / int8.RESIDUAL * np.asarray(qw.scale, np.float64)
        bound = bound + 0.5 * step * 254 * lo.sum(axis=0)
    assert np.all(np.abs(got - ref) <= bound * 1.01 + 1e-6)


@pytest.mark.parametrize("mode", int8.MODES)
def test_leading_dims_scan_and_bf16_activations(mode, xla_per_channel):
    n_layers, d = 3, 64
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((n_layers, d, d)) / np.sqrt(d)).astype(np.float32)
    x = rng.standard_normal((2, 3, d)).astype(np.float32)
    qw = quantize_weight(jnp.asarray(w), mode)

    @jax.jit
    def run(h, stacked):
        return jax.lax.scan(lambda h, layer_w: (jnp.tanh(ops.linear(h, layer_w)), None), h, stacked)[0]

    got = run(jnp.asarray(x), qw)
    assert got.shape == (2, 3, d) and got.dtype == jnp.float32
    ref = x.astype(np.float64)
    for layer in range(n_layers):
        ref = np.tanh(ref @ stored(qw)[layer])
    np.testing.assert_allclose(np.asarray(got), ref, atol=1e-5)
    y16 = run(jnp.asarray(x, jnp.bfloat16), qw)
    assert y16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y16, np.float32), ref, atol=0.05)


@pytest.mark.parametrize("mode,groups", [("int8", 3), ("int8-channel", 1)])
def test_quantize_on_device_returns_int8_and_scales_without_a_host_copy(mode, groups):
    w = jax.device_put(jax.random.normal(jax.random.PRNGKey(0), (4, 96, 40), jnp.bfloat16))
    with jax.transfer_guard("disallow"):  # any host <-> device copy raises
        qw = quantize_weight(w, mode)
    assert isinstance(qw, Int8Weight)
    assert qw.q.shape == (4, 96, 40) and qw.q.dtype == jnp.int8
    assert qw.scale.shape == (4, groups, 40) and qw.scale.dtype == jnp.float32
    assert (qw.offset is not None) == (mode == "int8")
    if qw.offset is not None:
        assert qw.offset.shape == qw.scale.shape
    assert qw.q.devices() == w.devices()
    assert qw.shape == (4, 96, 40) and qw.ndim == 3
    # int8 plus an f32 scale and offset per 32 inputs, or one f32 scale per 96
    per_weight = 1 + 8 / 32 if mode == "int8" else 1 + 4 / 96
    assert weight_bytes(qw) == pytest.approx(w.size * per_weight)


def test_groups_of_gguf_4_and_8_bit_blocks_round_exactly():
    """A weight whose 32-input groups are Q4_1 (d * k + m, k in 0..15) or Q8_0 (d * q, q in -127..127
    with |q| = 127 present) blocks, as the default model's GGUF holds them, is stored within f32 rounding:
    the "int8" mode loses nothing on such checkpoints."""
    rng = np.random.default_rng(3)
    k, n = 128, 24
    d = rng.uniform(0.001, 0.05, (k // 32, n)).astype(np.float32)
    m = rng.uniform(-0.4, 0.1, (k // 32, n)).astype(np.float32)
    q4 = rng.integers(0, 16, (k, n))
    q4[::32] = 0
    q4[1::32] = 15
    w4 = q4 * np.repeat(d, 32, axis=0) + np.repeat(m, 32, axis=0)
    q8 = rng.integers(-127, 128, (k, n))
    q8[::32] = 127
    w8 = q8 * np.repeat(d, 32, axis=0)
    for w in (w4, w8):
        qw = quantize_weight(jnp.asarray(w, jnp.float32), "int8")
        np.testing.assert_allclose(stored(qw), w, rtol=0, atol=2e-6)


def test_constant_and_zero_groups_are_kept():
    w = np.zeros((64, 3), np.float32)
    w[:32, 1] = 0.25
    qw = quantize_weight(jnp.asarray(w), "int8")
    np.testing.assert_allclose(stored(qw), w, atol=1e-7)
    assert np.all(np.isfinite(np.asarray(qw.scale)))


def test_int8_weight_passes_through_jit_and_slices_like_an_array():
    qw = quantize_weight(jnp.ones((2, 64, 32)), "int8")
    back = jax.jit(lambda p: p)(qw)
    assert isinstance(back, Int8Weight) and back.block == qw.block and back.shape == (2, 64, 32)
    layer = jax.tree.map(lambda a: a[1], qw)
    assert layer.shape == (64, 32) and layer.scale.shape == (2, 32)


@pytest.mark.parametrize("backend,mode", [("tpu", "int8"), ("gpu", "int8"), ("cuda", "int8"), ("rocm", "int8"),
                                          ("METAL", "none")])
def test_auto_picks_int8_on_accelerators(backend, mode):
    assert EngineConfig().weight_mode(backend) == mode
    assert EngineConfig(quantize="q8_0").weight_mode(backend) == "q8_0"  # an explicit mode stays


def test_auto_keeps_q8_0_a16_on_cpu(monkeypatch):
    from slipstream.kernels import q8_matmul

    monkeypatch.setattr(q8_matmul, "native_available", lambda: True)
    assert EngineConfig().weight_mode("cpu") == "q8_0-a16"
    monkeypatch.setattr(q8_matmul, "native_available", lambda: False)
    assert EngineConfig().weight_mode("cpu") == "none"
    assert EngineConfig(quantize="int8").weight_mode("cpu") == "int8"


def test_int8_channel_under_tensor_parallel_is_refused_by_name():
    with pytest.raises(ValueError, match="int8-channel.*tensor_parallel 2"):
        EngineConfig(quantize="int8-channel", tensor_parallel=2)
    EngineConfig(quantize="int8", tensor_parallel=2)  # int8's per-32 scales split with the weight


def test_int4_stores_4_bit_values_two_a_byte_with_bf16_scales():
    """int4: values in -8..7 packed [.., K / 2, N], a bf16 scale and offset per 32 inputs (5 bits a weight), the
    stored weight within half a step of the float one; a weight already on a 4-bit grid of bf16 scales is kept."""
    x, w = make(3, 128, 40, seed=5)
    qw = quantize_weight(jnp.asarray(w), "int4")
    assert qw.bits == 4 and qw.q.shape == (64, 40) and qw.shape == (128, 40)
    assert qw.scale.dtype == qw.offset.dtype == jnp.bfloat16 and qw.scale.shape == (4, 40)
    assert values(qw).min() >= -8 and values(qw).max() <= 7 and len(np.unique(values(qw))) == 16
    assert weight_bytes(qw) == pytest.approx(w.size * (0.5 + 4 / 32))
    step = np.repeat(np.asarray(qw.scale, np.float64), 32, axis=0)
    assert np.all(np.abs(stored(qw) - w) <= 0.5 * step * 1.0001 + 1e-7)
    on_grid = stored(qw).astype(np.float32)
    np.testing.assert_allclose(stored(quantize_weight(jnp.asarray(on_grid), "int4")), on_grid, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="int4"):
        int8.from_int8(jnp.zeros((64, 8), jnp.int8), 0.1, "int4")  # a tied head of int8 values stays int8
