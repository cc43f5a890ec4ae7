"""Multi-LoRA delta per token over slot stacks packed for kernels/f32_matmul: y[t] + (x[t] A_s) B_s for each
token t on adapter slot s = slots[t] >= 1 (slot 0, the base model, adds nothing). The S slots of rank r lie side
by side: A [K, S*r] (slot s in columns (s-1)*r .. s*r) and B [S*r, N], each packed ([Np/32, K*32], a stack
[L, ...] read at `layer`). The delta goes to N columns of y from `col`: a fused group's output (q | k | v)
takes each member's delta in place. With `gated`, x is a gated MLP's gate | up [T, 2K] and the input
silu(gate) * up (as kernels/q8_matmul's gated down projection takes it).

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
from slipstream.kernels.q8_matmul import gated_input

TARGET = "slipstream_lora_delta"


def native_available() -> bool:
    """True when the native CPU kernel is built and registered (logged once either way)."""
    return native.load("lora_delta", "lora_delta")


def reference(y: jax.Array, x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array, layer: jax.Array, *,
              rank: int, col: int = 0, n: int | None = None, gated: bool = False) -> jax.Array:
    """y f32 [T, W] with each token's delta added to columns col .. col + n (default: all), at full f32
    precision (a, b: one packed weight each, or stacks)."""
    n = y.shape[-1] - col if n is None else n
    x = gated_input(x) if gated else x
    if a.ndim == 3:
        a = jax.lax.dynamic_index_in_dim(a, layer, keepdims=False)
        b = jax.lax.dynamic_index_in_dim(b, layer, keepdims=False)
    cols = b.shape[-1] // f32.PANEL
    hi = jax.lax.Precision.HIGHEST
    h = jnp.dot(x, f32.unpack(a, cols), precision=hi, preferred_element_type=jnp.float32)  # [T,S*r]
    owner = jnp.arange(cols, dtype=jnp.int32) // rank + 1                                  # [S*r] slot of each column
    h = jnp.where(slots[:, None] == owner[None, :], h, 0.0)
    delta = jnp.dot(h, f32.unpack(b, n), precision=hi, preferred_element_type=jnp.float32)
    return y.at[:, col:col + n].add(delta)


def _native(y, x, a, b, slots, layer, *, rank: int, col: int, n: int, gated: bool) -> jax.Array:
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(y.shape, jnp.float32), input_output_aliases={0: 0})
    return call(y, x, a, b, slots, layer, rank=np.int64(rank), col=np.int64(col), n=np.int64(n),
                gated=np.int64(gated))


def lora_add(y: jax.Array, x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array, *, rank: int,
             layer: jax.Array | int | None = None, col: int = 0, n: int | None = None,
             gated: bool = False) -> jax.Array:
    """y [T, W] (f32) plus each token's LoRA delta in its columns col .. col + n (n: B's width N, by default
    all of y's columns from col): x [T, K] (cast to f32; gated: gate | up [T, 2K]), a packed A
    [(L,) ceil(S*r/32), K*32], b packed B [(L,) ceil(N/32), S*r*32] (`layer`, an int32 scalar, traced or
    not, picks one of stacks), slots i32 [T] in 0..S -> f32 [T, W]."""
    t, width = y.shape
    n = width - col if n is None else n
    if gated and x.shape[-1] % 2:
        raise ValueError(f"lora_add: a gated x holds gate | up, an even width; got {x.shape}")
    k = x.shape[-1] // 2 if gated else x.shape[-1]
    stacked = 0 if layer is None else 1
    cols = b.shape[-1] // f32.PANEL
    if (a.ndim != 2 + stacked or b.ndim != 2 + stacked or x.shape[0] != t or slots.shape != (t,)
            or rank < 1 or cols % rank or a.shape[-2:] != (f32.padded(cols) // f32.PANEL, k * f32.PANEL)
            or b.shape[-2] != f32.padded(n) // f32.PANEL or a.shape[:stacked] != b.shape[:stacked]
            or col < 0 or n < 0 or col + n > width):
        raise ValueError(f"lora_add: y {y.shape} (columns {col}..{col + n}), x {x.shape}, a {a.shape}, b {b.shape}, "
                         f"slots {slots.shape}, rank {rank} do not fit A [(L,) ceil(S*r/32), K*32], B [(L,) ceil(N/32), S*r*32] "
                         f"packed by kernels.f32_matmul.pack{'' if layer is None else ' (stacks [L, ...])'}")
    args = (y.astype(jnp.float32), x.astype(jnp.float32), a, b, slots.astype(jnp.int32),
            jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(()))
    ref = functools.partial(reference, rank=rank, col=col, n=n, gated=gated)
    if native_available():
        native_call = functools.partial(_native, rank=rank, col=col, n=n, gated=gated)
        return jax.lax.platform_dependent(*args, cpu=native_call, default=ref)
    return ref(*args)
