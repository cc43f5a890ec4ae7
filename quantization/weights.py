"""int8 weights: the modes and rounding one float weight to one (the group-wise pytree is groupwise.py's).

Load time only; the matching runtime matmul is quantization/ops.py. Which weights get rounded is
the model's declaration (models/base.Weight.linear), applied by engine/params.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from slipstream.quantization import groupwise, int8
from slipstream.quantization.groupwise import QUANTIZED_MODES, QuantizedWeight  # noqa: F401 (imported from here)

# QUANTIZED_MODES: the group-wise ones (quantization/groupwise.py), which the loader can build from
# checkpoint blocks; int8.MODES round a float weight on its device (quantization/int8.py)
MODES: tuple[str, ...] = ("none", *QUANTIZED_MODES, *int8.MODES)


def int4_on_cpu() -> bool:
    """Whether "int4" takes the native CPU kernel's form: group-wise "q8_0-a16" weights with GGUF Q4_1's 4-bit
    rows (as a Q4_1 GGUF file loads), on CPU where the kernel is built. Elsewhere quantization/int8's form (the
    TPU's Pallas kernel; XLA's dequantize-then-dot off TPU)."""
    from slipstream.kernels.q8_matmul import native_available

    return jax.default_backend() == "cpu" and native_available()


def head_mode(mode: str) -> str:
    """The mode of the weights outside the layers (the LM head) under `mode`: 8 bits for "int4" (the head is a
    small part of a large model's bytes and costs the most accuracy at 4 bits: "int8", or on CPU the native
    kernel's "q8_0-a16"), else `mode`."""
    if mode != "int4":
        return mode
    return "q8_0-a16" if int4_on_cpu() else "int8"


def check_mode(mode: str, allowed: tuple[str, ...] = MODES) -> None:
    if mode not in allowed:
        raise ValueError(f"unknown quantization mode {mode!r}; allowed modes: {', '.join(allowed)}")


def quantize_weight(w, mode: str) -> QuantizedWeight | int8.Int8Weight:
    """A float weight [..., in, out] -> int8 in `mode`: group-wise (numpy, on the host; a weight already
    in this form: its mode is set) or an int8.MODES one (JAX on w's device: a jax.Array never leaves it);
    "int4" on CPU (int4_on_cpu): group-wise 4-bit rows in "q8_0-a16"."""
    check_mode(mode, MODES[1:])
    if mode == "int4" and int4_on_cpu():
        if isinstance(w, QuantizedWeight):  # the loader's blocks: rounded again at 4 bits
            w = w.dequantize()
        if w.ndim < 2 or not jnp.issubdtype(w.dtype, jnp.floating):
            raise ValueError(f"expected a floating-point weight [..., in, out], got {w.dtype} {tuple(w.shape)}")
        if w.shape[-2] % 64:  # as the TPU form: one rule for the mode on every backend
            raise ValueError(f"int4 weights need a multiple of 64 inputs, got a weight of shape {tuple(w.shape)}")
        return groupwise.quantize_weight(w, "q8_0-a16", bits=4)
    if mode in int8.MODES:
        if isinstance(w, int8.Int8Weight):
            return w  # rounded already (a tied LM head)
        if isinstance(w, QuantizedWeight):  # the loader's group-wise blocks, dequantized on the device
            w = w.dequantize()
        if not jnp.issubdtype(w.dtype, jnp.floating):
            raise ValueError(f"expected a floating-point weight, got dtype {w.dtype}")
        return int8.quantize(w, mode)
    if isinstance(w, QuantizedWeight):
        return dataclasses.replace(w, mode=mode)  # built by the loader straight from checkpoint blocks
    if w.ndim < 2:
        raise ValueError(f"expected a weight of shape [..., in, out], got shape {tuple(w.shape)}")
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"expected a floating-point weight, got dtype {w.dtype}")
    return groupwise.quantize_weight(w, mode)


def weight_bytes(params) -> int:
    """Bytes held by all leaves of a params pytree (int8 q and f16 scales count as stored)."""
    return sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
               for leaf in jax.tree_util.tree_leaves(params))
