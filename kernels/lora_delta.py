"""Multi-LoRA delta per token over slot stacks packed for kernels/f32_matmul: y[t] + (x[t] A_s) B_s for each
token t on adapter slot s = slots[t] >= 1 (slot 0, the base model, adds nothing). The S slots of rank r lie side
by side: A [K, S*r] (slot s in columns (s-1)*r .. s*r) and B [S*r, N], each packed ([Np/32, K*32], a stack
[L, ...] read at `layer`).

`lora_add` is the one entry point. On CPU it runs the native kernel (kernels/cpu/csrc/lora_delta.cc: each token
through its own slot's A and B only, y updated in place); elsewhere, or with SLIPSTREAM_KERNELS=reference,
`reference` does the same in JAX (every slot's columns, the others masked). Imports none of our packages but
kernels.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from slipstream.kernels import f32_matmul as f32
from slipstream.kernels import native

TARGET = "slipstream_lora_delta"


def native_available() -> bool:
    """True when the native CPU kernel is built and registered (logged once either way)."""
    return native.load("lora_delta", "lora_delta")


def reference(y: jax.Array, x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array, layer: jax.Array, *,
              rank: int) -> jax.Array:
    """y f32 [T, N] + each token's delta, at full f32 precision (a, b: one packed weight each, or stacks)."""
    if a.ndim == 3:
        a = jax.lax.dynamic_index_in_dim(a, layer, keepdims=False)
        b = jax.lax.dynamic_index_in_dim(b, layer, keepdims=False)
    cols = b.shape[-1] // f32.PANEL
    hi = jax.lax.Precision.HIGHEST
    h = jnp.dot(x, f32.unpack(a, cols), precision=hi, preferred_element_type=jnp.float32)  # [T,S*r]
    owner = jnp.arange(cols, dtype=jnp.int32) // rank + 1                                  # [S*r] slot of each column
    h = jnp.where(slots[:, None] == owner[None, :], h, 0.0)
    return y + jnp.dot(h, f32.unpack(b, y.shape[-1]), precision=hi, preferred_element_type=jnp.float32)


def _native(y, x, a, b, slots, layer, *, rank: int) -> jax.Array:
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(y.shape, jnp.float32), input_output_aliases={0: 0})
    return call(y, x, a, b, slots, layer, rank=np.int64(rank))


def lora_add(y: jax.Array, x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array, *, rank: int,
             layer: jax.Array | int | None = None) -> jax.Array:
    """y [T, N] (f32) plus each token's LoRA delta: x [T, K] (cast to f32), a packed A [(L,) ceil(S*r/32), K*32],
    b packed B [(L,) ceil(N/32), S*r*32] (`layer`, an int32 scalar, traced or not, picks one of stacks),
    slots i32 [T] in 0..S -> f32 [T, N]."""
    t, n = y.shape
    k = x.shape[-1]
    stacked = 0 if layer is None else 1
    cols = b.shape[-1] // f32.PANEL
    if (a.ndim != 2 + stacked or b.ndim != 2 + stacked or x.shape != (t, k) or slots.shape != (t,)
            or rank < 1 or cols % rank or a.shape[-2:] != (f32.padded(cols) // f32.PANEL, k * f32.PANEL)
            or b.shape[-2] != f32.padded(n) // f32.PANEL or a.shape[:stacked] != b.shape[:stacked]):
        raise ValueError(f"lora_add: y {y.shape}, x {x.shape}, a {a.shape}, b {b.shape}, slots {slots.shape}, "
                         f"rank {rank} do not fit A [(L,) ceil(S*r/32), K*32], B [(L,) ceil(N/32), S*r*32] "
                         f"packed by kernels.f32_matmul.pack{'' if layer is None else ' (stacks [L, ...])'}")
    args = (y.astype(jnp.float32), x.astype(jnp.float32), a, b, slots.astype(jnp.int32),
            jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(()))
    ref = functools.partial(reference, rank=rank)
    if native_available():
        return jax.lax.platform_dependent(*args, cpu=functools.partial(_native, rank=rank), default=ref)
    return ref(*args)
