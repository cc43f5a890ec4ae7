"""f32 matmul over weights prepacked in column panels: x [M, K] @ w [K, N] with w stored as
[N/32][K][32] (kernels/cpu/csrc/f32_matmul.cc streams one panel contiguously; N padded with zero columns).

`f32_matmul` is the one entry point. On CPU it runs the native kernel through XLA's FFI; elsewhere,
or with SLIPSTREAM_KERNELS=reference, `reference` does the same product in JAX (an f32 dot at
HIGHEST precision). `pack` lays a weight (or a stack of them) out once, at load. Imports none of our
packages but kernels.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from slipstream.kernels import native

PANEL = 32  # output columns per packed panel: two 16-float AVX-512 vectors
TARGET = "slipstream_f32_matmul"


def native_available() -> bool:
    """True when the native CPU kernel is built and registered (logged once either way)."""
    return native.load("f32_matmul", "f32_matmul")


def padded(n: int) -> int:
    """N rounded up to a whole panel."""
    return -(-n // PANEL) * PANEL


def pack(w: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """w f32 [..., K, N] -> [..., Np/32, K*32]: panel t holds columns 32t..32t+31, row k's 32 of
    them contiguous; padding columns are zero. `out` (that shape, f32) is filled instead of a new
    array (e.g. memory laid out for huge pages)."""
    w = np.asarray(w)
    *lead, k, n = w.shape
    if w.dtype != np.float32:
        raise ValueError(f"f32_matmul.pack expects float32 weights, got {w.dtype}")
    np_ = padded(n)
    shape = (*lead, np_ // PANEL, k * PANEL)
    if out is None:
        out = np.empty(shape, np.float32)
    elif out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"f32_matmul.pack: out must be C-contiguous float32 {shape}, got {out.dtype} {out.shape}")
    view = out.reshape(*lead, np_ // PANEL, k, PANEL)
    full = n // PANEL * PANEL
    if full:  # whole panels: [.., K, T, 32] -> [.., T, K, 32]
        view[..., :full // PANEL, :, :] = np.moveaxis(w[..., :full].reshape(*lead, k, full // PANEL, PANEL), -2, -3)
    if full < n or full < np_:
        view[..., full // PANEL:, :, :] = 0
        view[..., full // PANEL, :, :n - full] = w[..., full:]
    return out


def unpack(packed: jax.Array, n: int) -> jax.Array:
    """Inverse of pack: [..., Np/32, K*32] -> [..., K, n]."""
    tiles, width = packed.shape[-2:]
    lead = packed.shape[:-2]
    k = width // PANEL
    w = jnp.moveaxis(packed.reshape(*lead, tiles, k, PANEL), -3, -2)  # [.., K, T, 32]
    return w.reshape(*lead, k, tiles * PANEL)[..., :n]


def reference(x: jax.Array, packed: jax.Array, *, n: int) -> jax.Array:
    """x f32 [M, K] -> f32 [M, n]: the product at full f32 precision."""
    return jnp.dot(x, unpack(packed, n), precision=jax.lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32)


def _native(x: jax.Array, packed: jax.Array, layer: jax.Array, *, n: int) -> jax.Array:
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))(x, packed, layer)


def _reference_at(x: jax.Array, packed: jax.Array, layer: jax.Array, *, n: int) -> jax.Array:
    if packed.ndim == 3:  # a stack: the reference slices the layer's weight out of it
        packed = jax.lax.dynamic_index_in_dim(packed, layer, keepdims=False)
    return reference(x, packed, n=n)


def f32_matmul(x: jax.Array, packed: jax.Array, *, n: int, layer: jax.Array | int | None = None) -> jax.Array:
    """x [..., K] (cast to f32) times a packed weight -> f32 [..., n]. With `layer` (an int32
    scalar, traced or not), `packed` is a stack [L, Np/32, K*32] of which weight `layer` is used:
    the native kernel reads it where it lies, so a scanned layer loop copies no slice of it."""
    k = x.shape[-1]
    lead_w = packed.shape[:-2]
    if len(lead_w) != (0 if layer is None else 1) or packed.shape[-2:] != (padded(n) // PANEL, k * PANEL):
        raise ValueError(f"f32_matmul: packed {packed.shape} does not hold a [{k}, {n}] weight"
                         f"{'' if layer is None else ' stack [L, ...]'} (expected "
                         f"{(*lead_w, padded(n) // PANEL, k * PANEL)}); build it with kernels.f32_matmul.pack")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).astype(jnp.float32)
    index = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(())
    ref = functools.partial(_reference_at, n=n)
    if native_available():
        y = jax.lax.platform_dependent(x2, packed, index, cpu=functools.partial(_native, n=n), default=ref)
    else:
        y = ref(x2, packed, index)
    return y.reshape(*lead, n)
