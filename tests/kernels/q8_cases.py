"""What the Q8_0 matmul tests share: the native module and the instruction-set paths this CPU has, random
weights, float64 numpy oracles with their error bounds, and the kernel and its reference run per path."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from slipstream.kernels import native
from slipstream.kernels import q8_matmul as q8
from tests.kernels.isas import runnable_isas

NATIVE = native.load("q8_matmul", "q8_matmul")
if NATIVE:
    import slipstream.kernels._q8_matmul as ext

ISAS = runnable_isas(ext, ("amx", "avx512_vnni", "avx2", "portable")) if NATIVE else []
needs_native = pytest.mark.skipif(not NATIVE, reason="slipstream.kernels._q8_matmul is not built")


def f16(a: np.ndarray) -> np.ndarray:
    """a rounded to the f16 values pack stores scales and offsets in (as GGUF's blocks hold them), in f32."""
    return a.astype(np.float16).astype(np.float32)


def random_weight(rng, k, n, *, scale=1e-2):
    q = rng.integers(-128, 128, (n, k)).astype(np.int8)  # -128 too: GGUF Q8_0 files may hold it
    d = f16(rng.random((n, -(-k // q8.GROUP))) * scale)
    return q, d


def oracle(x: np.ndarray, q: np.ndarray, d: np.ndarray, m: np.ndarray | None = None, parts: int = 1) -> np.ndarray:
    """float64 numpy: per 32-group llama.cpp activation rounding (and the residual's, for parts=2), the
    quantized activations times the dequantized weight (each product exact, the sums float64); offsets times
    the group sums of x."""
    rows, k = x.shape
    kp = -(-k // q8.GROUP) * q8.GROUP
    v = np.pad(x, ((0, 0), (0, kp - k))).reshape(rows, -1, q8.GROUP).astype(np.float32)
    # the weight dequantized, q * d exactly in float64 (8 and 11 significant bits)
    w = (np.pad(q, ((0, 0), (0, kp - k))).reshape(q.shape[0], -1, q8.GROUP) * d[..., None].astype(np.float64))
    w = w.reshape(q.shape[0], kp)
    xs = (np.abs(v).max(-1) / np.float32(127)).astype(np.float32)
    y = np.zeros((rows, q.shape[0]))
    for _ in range(parts):
        with np.errstate(over="ignore", invalid="ignore"):  # a subnormal scale's inverse overflows: 0 * inf
            inv = np.where(xs > 0, np.float32(1) / np.where(xs > 0, xs, 1), 0).astype(np.float32)
            xq = np.clip(np.round(v * inv[..., None]), -127, 127)  # numpy rounds half to even
        xq[v == 0] = 0  # (not NaN)
        # the activations' int8 values times their scales, exact in float64 (8 and 24 bits): one float64 product
        y += (xq * xs[..., None].astype(np.float64)).reshape(rows, kp) @ w.T
        # the residual as one fused multiply-add, as the kernel and XLA compute it: the product and
        # the difference are exact in float64 (|r| <= xs / 2), then rounded to f32 once
        v = (v.astype(np.float64) - xq * xs[..., None].astype(np.float64)).astype(np.float32)
        xs = (xs / np.float32(254)).astype(np.float32)
    if m is not None:
        sums = np.pad(x, ((0, 0), (0, kp - k))).reshape(rows, -1, q8.GROUP).astype(np.float64).sum(-1)
        y += sums @ m.astype(np.float64).T
    return y


# kernels/cpu/csrc/q8_matmul.cc's kF32MinRows: from this many rows, a two-part call on the AVX2 path widens the
# weights to f32 and multiplies x unquantized (no int8 dot on AVX2 is faster), so it equals exact_product.
AVX2_F32_MIN_ROWS = 8


def exact_product(x: np.ndarray, q: np.ndarray, d: np.ndarray, m: np.ndarray | None = None) -> np.ndarray:
    """float64 numpy: x times the dequantized weight, w[n, k] = q * d (+ m) of k's group."""
    k = x.shape[1]
    w = q.astype(np.float64) * np.repeat(d.astype(np.float64), q8.GROUP, axis=1)[:, :k]
    if m is not None:
        w += np.repeat(m.astype(np.float64), q8.GROUP, axis=1)[:, :k]
    return x.astype(np.float64) @ w.T


def takes_f32_path(isa: str | None, parts: int, rows: int) -> bool:
    return (isa or ext.isa()) == "avx2" and parts == 2 and rows >= AVX2_F32_MIN_ROWS


# q8_matmul.cc's kAmxMinRows: from this many rows a call on the AMX path runs on the tile unit. Its int8 path
# (tdpbsud, 8- or 4-bit weights) gives the AVX-512 VNNI path's outputs bit for bit, so a row's output never depends
# on the call's row count. With a q8_0-a16 weight's pack_tiles (SLIPSTREAM_AMX_BF16=1) two-part calls instead
# multiply x and the dequantized weight each split into bf16 hi + lo, three bf16 products summed in f32 (~16
# bits per product): tests/kernels/test_q8_matmul_amx.py.
AMX_MIN_ROWS = 64


def assert_split_product_close(got, x, q, d, m=None):
    """got is x times the dequantized weight up to the bf16 split's error (the dropped x_lo * w_lo and the lo
    parts' rounding: a few 2^-17 of each product) and f32 summation over K, both bounded by sum |x| |w|."""
    k = x.shape[1]
    exact = exact_product(x, q, d, m)
    terms = exact_product(np.abs(x), np.abs(q.astype(np.int16)), d, None if m is None else np.abs(m))  # |x| |w|
    np.testing.assert_array_less(np.abs(got - exact), (2.0**-14 + k * 2.0**-24) * terms + 1e-30)


# One program per shape and call form, whatever the instruction set: the kernel reads its ISA when it runs, so
# the paths of one shape run the same compiled program.
_kernel = jax.jit(q8.q8_matmul, static_argnames=("n", "parts", "gated"))
_reference = jax.jit(q8.reference, static_argnames=("n", "parts"))


def run_kernel(x, packed, scales, n, isa=None, offsets=None, parts=1, gated=False, tiles=None):
    """The kernel's output on `isa` (None: the module's current choice); tiles: a weight's pack_tiles, or None."""
    prev = ext.set_isa(isa) if isa else None
    try:
        return np.asarray(_kernel(x, packed, scales, offsets, n=n, parts=parts, gated=gated, tiles=tiles))
    finally:
        if prev:
            ext.set_isa(prev)


def run_on_every_isa(*args, **kwargs) -> dict[str, np.ndarray]:
    """run_kernel's output on each path this CPU has; on the AMX path it must be the VNNI path's bit for bit (the
    tile path mirrors its integer sums and float steps), whatever the row count."""
    outs = {isa: run_kernel(*args, isa=isa, **kwargs) for isa in ISAS}
    if "amx" in outs:
        np.testing.assert_array_equal(outs["amx"], outs["avx512_vnni"])
    return outs


def run_reference(x, packed, scales, n, offsets=None, parts=1):
    return np.asarray(_reference(x, packed, scales, offsets, n=n, parts=parts))


def silu_times_up(gate_up: np.ndarray) -> np.ndarray:
    """float64 numpy: silu(gate) * up of gate | up, rounded to f32 (an oracle for gated calls)."""
    k = gate_up.shape[1] // 2
    g, u = gate_up[:, :k].astype(np.float64), gate_up[:, k:].astype(np.float64)
    return (g / (1 + np.exp(-g)) * u).astype(np.float32)


def assert_close(got, want, x, q, d, m=None, slack=0.0, err_msg=""):
    # f32 accumulation over groups: bound the error by the size of the terms, not of the sum
    rows, k = x.shape
    bound = np.abs(x).max(initial=0) * (np.abs(q).max(initial=0) * d.max(initial=0)
                                        + (0 if m is None else np.abs(m).max(initial=0))) * k
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * bound + slack + 1e-30, err_msg=err_msg)


def outlier_case(m: int, offsets: bool):
    """Odd K and N (a partial group and a partial tile), random weights (with offsets or not) and m rows of x
    whose column 7 is an outlier: it sets its group's scale, so two int8 parts lose the small values' low
    bits. -> (q, d, off, packed, scales, packed offsets or None, x)."""
    rng = np.random.default_rng(m)
    k, n = 333, 75
    q, d = random_weight(rng, k, n)
    off = f16(rng.standard_normal(d.shape) * 1e-2) if offsets else None
    packed, scales, *rest = q8.pack(q, d, off)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, 7] = 50.0
    return q, d, off, packed, scales, rest[0] if offsets else None, x
