"""The Pallas TPU grouped expert matmul (kernels/tpu/expert_matmul.py), in Pallas' TPU interpret mode on CPU: each
block of rows times its expert's int8 weight and column scales at a layer index, alone or gate and up together
(silu(gate) * up), over one to three blocks along K and N; blocks past `used` are zeros; shapes that do not tile
have no blocks."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from slipstream.kernels.tpu import expert_matmul as kernel


def _stack(rng, layers, experts, k, n):
    """int8 values and power-of-two scales: every weight exact in bf16, so kernel and reference differ only in
    the order of their f32 sums."""
    q = jnp.asarray(rng.integers(-127, 128, (layers, experts, k, n)), jnp.int8)
    scale = jnp.asarray(2.0 ** rng.integers(-10, -6, (layers, experts, n)), jnp.float32)
    return q, scale


def _expert(q, scale, layer, e) -> np.ndarray:
    return np.asarray(q[layer, e], np.float32) * np.asarray(scale[layer, e])[None, :]


CASES = [  # rows, k, n, block_k, block_n, x dtype, gated
    (16, 256, 128, None, None, "float32", False),
    (16, 384, 384, 128, 128, "float32", True),     # 3 x 3 blocks
    (32, 256, 256, 128, 256, "bfloat16", True),
    (16, 512, 256, 256, 128, "bfloat16", False),
    # N whole and not lane-aligned, as a device's slice of Qwen3-30B-A3B's gate/up at TP=4 (192); K so, as its down
    (16, 1024, 192, 512, 192, "bfloat16", True),
    (16, 192, 256, 192, 128, "float32", False),
]


@pytest.mark.parametrize("rows,k,n,bk,bn,dtype,gated", CASES)
def test_each_block_gets_its_experts_product(rows, k, n, bk, bn, dtype, gated):
    rng = np.random.default_rng(rows + k + n)
    layers, experts, layer = 3, 5, 2
    q, scale = _stack(rng, layers, experts, k, n)
    q2, scale2 = _stack(rng, layers, experts, k, n) if gated else (None, None)
    block_expert = np.array([0, 3, 3, 4, 1, 0], np.int32)    # an expert over two blocks; the last two blocks dead
    used = 4
    x = jnp.asarray(rng.standard_normal((len(block_expert) * rows, k)), dtype)
    y = kernel.expert_matmul(x, q, scale, jnp.int32(layer), jnp.asarray(block_expert), jnp.int32(used), q2, scale2,
                             rows=rows, block_k=bk, block_n=bn, interpret=True)
    assert y.shape == (x.shape[0], n) and y.dtype == (x.dtype if gated else jnp.float32)
    xf = np.asarray(x.astype(jnp.float32))
    for i, e in enumerate(block_expert):
        got = np.asarray(y[i * rows:(i + 1) * rows], np.float32)
        if i >= used:
            np.testing.assert_array_equal(got, 0)
            continue
        xb = xf[i * rows:(i + 1) * rows]
        want = xb @ _expert(q, scale, layer, e)
        if gated:
            want = want / (1 + np.exp(-want)) * (xb @ _expert(q2, scale2, layer, e))
        tol = (1e-5 if dtype == "float32" and not gated else 1e-2) * np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=0, atol=tol)


def test_default_blocks():
    """OLMoE's experts: gate/up [2048, 1024] and down [1024, 2048] in 1 MiB int8 blocks, all of K in one."""
    assert kernel.blocks(2048, 1024) == (2048, 512)
    assert kernel.blocks(1024, 2048) == (1024, 1024)
    bk, bn = kernel.blocks(14336, 4096)                       # Mixtral's down: K over several blocks
    assert 14336 % bk == 0 and bk % 256 == 0 and bk * bn <= kernel.MAX_BLOCK_BYTES


@pytest.mark.parametrize("k,n", [(200, 128), (256, 200)])
def test_shapes_that_do_not_tile_have_no_blocks(k, n):
    assert kernel.blocks(k, n) is None
    args = (jnp.zeros((16, k), jnp.float32), jnp.zeros((1, 2, k, n), jnp.int8), jnp.ones((1, 2, n), jnp.float32),
            jnp.int32(0), jnp.zeros((1,), jnp.int32), jnp.int32(1))
    with pytest.raises(ValueError, match="no blocks"):
        kernel.expert_matmul(*args, rows=16, interpret=True)
    # given blocks: a whole dimension need not be lane-aligned, a part of one must
    with pytest.raises(ValueError, match="do not tile"):
        kernel.expert_matmul(*args, rows=16, block_k=k // 2 if k == 200 else k, block_n=n // 2 if n == 200 else n,
                             interpret=True)


def test_bad_inputs_raise():
    q, s = jnp.zeros((1, 2, 256, 128), jnp.int8), jnp.ones((1, 2, 128), jnp.float32)
    args = (jnp.int32(0), jnp.zeros((1,), jnp.int32), jnp.int32(1))
    with pytest.raises(ValueError, match="whole blocks"):
        kernel.expert_matmul(jnp.zeros((24, 256), jnp.float32), q, s, *args, rows=24, interpret=True)
    with pytest.raises(ValueError, match="scale must be"):
        kernel.expert_matmul(jnp.zeros((16, 256), jnp.float32), q, s[:, :1], *args, rows=16, interpret=True)
    with pytest.raises(ValueError, match="together"):
        kernel.expert_matmul(jnp.zeros((16, 256), jnp.float32), q, s, *args, q, rows=16, interpret=True)
