"""4-bit weights two a byte, as the TPU int8/int4 matmul (kernels/tpu/int8_matmul.py) reads them: values
[..., K, N] in -8..7 (two's complement) -> int8 [..., K / 2, N]. Per pair of 32-input groups (64 inputs from
64j), byte row 32j + i holds input 64j + i in its low nibble and input 64j + 32 + i in its high nibble, so
one 32-row slice of bytes unpacks into two whole groups with two shifts. No Pallas here: quantization/int8
packs and unpacks with it on any backend."""
from __future__ import annotations

import jax
import jax.numpy as jnp

GROUP = 32        # inputs per scale: kernels/tpu/int8_matmul.GROUP
PAIR = 2 * GROUP  # inputs per packed 32-row slice


def pack4(q: jax.Array) -> jax.Array:
    """4-bit values q [..., K, N] (int8 in -8..7; K a multiple of 64) -> the packed int8 [..., K / 2, N] the
    kernel reads with bits=4 (the module docstring's layout)."""
    *lead, k, n = q.shape
    if k % PAIR:
        raise ValueError(f"4-bit weights need a multiple of {PAIR} inputs, got {k}")
    pairs = q.astype(jnp.int32).reshape(*lead, k // PAIR, 2, GROUP, n)
    low, high = pairs[..., 0, :, :], pairs[..., 1, :, :]
    return ((low & 0xF) | (high << 4)).astype(jnp.int8).reshape(*lead, k // 2, n)


def unpack4(packed: jax.Array) -> jax.Array:
    """pack4's inverse: int8 [..., K / 2, N] -> the 4-bit values as int8 [..., K, N]."""
    *lead, half, n = packed.shape
    p = packed.astype(jnp.int32).reshape(*lead, half // GROUP, 1, GROUP, n)
    low = jax.lax.shift_right_arithmetic(jax.lax.shift_left(p, 28), 28)
    high = jax.lax.shift_right_arithmetic(p, 4)
    return jnp.concatenate([low, high], axis=-3).astype(jnp.int8).reshape(*lead, 2 * half, n)
