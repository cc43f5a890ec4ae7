"""int8 KV's head_dim rotation (models.base.PagedAttention): attention through it equals plain f32
attention, and int8 K/V with outlier channels lose less with it than without."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from slipstream.kernels.attention import kv_layout, ragged_paged_attention
from slipstream.models import base, layers
from slipstream.models.config import ModelConfig

KV, GROUP, T, PAGE = 2, 3, 48, 16   # one sequence prefilling T tokens into T / PAGE pages


def _cfg(head_dim: int) -> ModelConfig:
    return ModelConfig(num_layers=1, hidden_size=KV * GROUP * head_dim, num_heads=KV * GROUP, num_kv_heads=KV,
                       head_dim=head_dim, intermediate_size=8, vocab_size=8)


def _qkv(head_dim: int, outliers: bool, seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((T, KV * GROUP, head_dim)).astype(np.float32)           # [T,H,hd]
    k = rng.standard_normal((T, KV, head_dim)).astype(np.float32)                   # [T,KV,hd]
    v = rng.standard_normal((T, KV, head_dim)).astype(np.float32)
    if outliers:  # a few large channels, as real K (and V) have: they set every token's int8 scale
        k[..., 3] = 30.0 + rng.standard_normal((T, KV))
        k[..., 17] *= 15.0
        v[..., 5] *= 25.0
    return q, k, v


def _attention(cfg: ModelConfig, kv_dtype, platform: str = "cpu"):
    """PagedAttention over one prefilling sequence and a fresh cache of `kv_dtype` in `platform`'s layout."""
    pages = T // PAGE
    cache = base.init_kv_cache(cfg, pages + 1, PAGE, kv_dtype, platform=platform)
    attend = base.PagedAttention(cfg, jnp.asarray([T], jnp.int32), jnp.arange(1, pages + 1, dtype=jnp.int32)[None],
                                 jnp.asarray([0, T], jnp.int32), jnp.asarray([1], jnp.int32))
    return lambda q, k, v: np.asarray(attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), cache,
                                             jnp.asarray(0, jnp.int32), False)[0])


@pytest.mark.parametrize("head_dim", [64, 128, 80, 96])
def test_head_rotation_is_orthogonal(head_dim):
    r = layers.head_rotation(head_dim).astype(np.float64)
    np.testing.assert_allclose(r @ r.T, np.eye(head_dim), atol=1e-6)
    if head_dim & (head_dim - 1) == 0:  # Hadamard: every channel spread evenly
        np.testing.assert_allclose(np.abs(r), head_dim ** -0.5, rtol=1e-6)


def test_int8_kv_is_recognized_in_both_layouts():
    for platform in ("cpu", "tpu"):
        layout = kv_layout(platform)
        assert base.int8_kv(layout.init(1, KV, 2, layout.page_size, 64, jnp.int8))
        assert not base.int8_kv(layout.init(1, KV, 2, layout.page_size, 64, jnp.bfloat16))


@pytest.mark.parametrize("head_dim", [64, 80])
def test_rotated_attention_equals_plain_attention(head_dim):
    """q R, k R, v R through the f32 kernel, the output times R^T: the plain f32 attention."""
    cfg = _cfg(head_dim)
    q, k, v = _qkv(head_dim, outliers=True)
    f32 = _attention(cfg, jnp.float32)
    r = layers.head_rotation(head_dim)
    rotated = f32(*(np.asarray(layers.rotate_heads(jnp.asarray(x), r)) for x in (q, k, v)))
    back = np.asarray(layers.rotate_heads(jnp.asarray(rotated), r, inverse=True))
    np.testing.assert_allclose(back, f32(q, k, v), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("head_dim, platform", [(64, "cpu"), (128, "cpu"), (64, "tpu")])
def test_int8_kv_with_outlier_channels_loses_less_with_the_rotation(head_dim, platform):
    """The int8 cache through PagedAttention (rotated) against the same kernel fed unrotated K/V; "tpu":
    the merged layout the Pallas kernel reads (here its reference)."""
    cfg = _cfg(head_dim)
    q, k, v = _qkv(head_dim, outliers=True)
    want = _attention(cfg, jnp.float32)(q, k, v)
    rotated = _attention(cfg, jnp.int8, platform)(q, k, v)

    # the kernel called directly, as PagedAttention called it before the rotation
    pages = T // PAGE
    cache = base.init_kv_cache(cfg, pages + 1, PAGE, jnp.int8, platform=platform)
    plain = np.asarray(ragged_paged_attention(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), cache, jnp.asarray(0, jnp.int32), jnp.asarray([T], jnp.int32),
        jnp.arange(1, pages + 1, dtype=jnp.int32)[None], jnp.asarray([0, T], jnp.int32), jnp.asarray([1], jnp.int32),
        sm_scale=cfg.sm_scale)[0])
    err_rot, err_plain = np.abs(rotated - want).mean(), np.abs(plain - want).mean()
    assert err_rot < 0.5 * err_plain, f"int8 KV mean error {err_rot:.4g} rotated vs {err_plain:.4g} plain"
    assert np.abs(rotated - want).max() < 0.1 * np.abs(want).max()
