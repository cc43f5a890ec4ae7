"""Many-row group-wise int8 GEMM: the same math, packed weights and activation rounding as
kernels.q8_matmul (its `reference` is the specification), for calls with many rows (prefill chunks,
the mixed decode + prefill step), where the int8 multiply-add rate rather than the weight stream
bounds the time. Native kernel: kernels/csrc/q8_gemm.cc (FFI target slipstream_q8_gemm, AVX-512
VNNI only). On a CPU without VNNI, or when the module is not built, `q8_gemm` runs
kernels.q8_matmul.q8_matmul (which has AVX2, portable and pure-JAX paths)."""
from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np

from kernels import native
from kernels import q8_matmul as q8

TARGET = "slipstream_q8_gemm"


@functools.cache
def native_available() -> bool:
    """True when kernels._q8_gemm is built, registered, and this CPU has AVX-512 VNNI."""
    if not native.load("q8_gemm", "q8_gemm"):
        return False
    return importlib.import_module("kernels._q8_gemm").isa() == "avx512_vnni"


def _native(x: jax.Array, packed: jax.Array, scales: jax.Array, offsets: jax.Array | None, layer: jax.Array, *,
            n: int, parts: int) -> jax.Array:
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    if offsets is None:
        offsets = jnp.zeros((0,), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(x, packed, scales, offsets, layer, parts=np.int32(parts))


def q8_gemm(x: jax.Array, packed: jax.Array, scales: jax.Array, offsets: jax.Array | None = None, *,
            n: int, parts: int = 1, layer: jax.Array | int | None = None) -> jax.Array:
    """x [..., K] (any float dtype) times a packed weight (kernels.q8_matmul.pack) -> f32 [..., n];
    the arguments mean what they mean for kernels.q8_matmul.q8_matmul (a stack [L, ...] with `layer`)."""
    k = x.shape[-1]
    kp, np_ = q8.padded(k, n)
    group_shape = (np_ // q8.TILE, kp // q8.GROUP * q8.TILE)
    lead_w = packed.shape[:-2]
    if (len(lead_w) != (0 if layer is None else 1) or packed.shape[-2:] != (np_ // q8.TILE, kp * q8.TILE)
            or scales.shape != (*lead_w, *group_shape)
            or (offsets is not None and offsets.shape != (*lead_w, *group_shape))):
        raise ValueError(f"q8_gemm: packed {packed.shape} / scales {scales.shape} do not hold a [{k}, {n}] "
                         f"weight{'' if layer is None else ' stack [L, ...]'}; build them with kernels.q8_matmul.pack")
    if parts not in (1, 2):
        raise ValueError(f"q8_gemm: parts must be 1 or 2, got {parts}")
    if not native_available():
        return q8.q8_matmul(x, packed, scales, offsets, n=n, parts=parts, layer=layer)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).astype(jnp.float32)
    index = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(())
    y = jax.lax.platform_dependent(x2, packed, scales, offsets, index,
                                   cpu=functools.partial(_native, n=n, parts=parts),
                                   default=functools.partial(q8._reference_at, n=n, parts=parts))
    return y.reshape(*lead, n)
