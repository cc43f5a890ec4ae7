"""int8 weights: the QuantizedWeight pytree and rounding one float weight to it.

Load time only; the matching runtime matmul is quantization/ops.py. Which weights get rounded is
the model's declaration (models/base.Weight.linear), applied by engine/params.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from quantization import int8

# QUANTIZED_MODES: the group-wise ones (quantization/groupwise.py), which the loader can build from
# checkpoint blocks; int8.MODES round a float weight on its device (quantization/int8.py)
QUANTIZED_MODES: tuple[str, ...] = ("q8_0", "q8_0-a16")
MODES: tuple[str, ...] = ("none", *QUANTIZED_MODES, *int8.MODES)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """Group-wise int8 weight (llama.cpp's Q8_0, see quantization/groupwise.py): one scale per 32
    inputs per output column, packed for kernels.q8_matmul: q u8[..., Np/16, Kp*16], scale
    f32[..., Np/16, Kp/32*16]; offset: None or like scale (w = q * scale + offset per group, GGUF's
    asymmetric blocks); logical = (in, out), the float weight's shape (static).
    mode (static): "q8_0" rounds activations to int8 per 32 values (llama.cpp's w8a8); "q8_0-a16"
    adds their int8 residual. Leading axes (stacked layers L) are sliced by lax.scan like any leaf.
    """

    q: jax.Array
    scale: jax.Array
    mode: str = dataclasses.field(metadata=dict(static=True))
    offset: jax.Array | None = None
    logical: tuple[int, int] | None = dataclasses.field(default=None, metadata=dict(static=True))

    def __post_init__(self) -> None:
        # Only the static field is checked: JAX rebuilds this node with placeholder leaves
        # (tracers, None, axis specs) during transformations.
        if self.mode not in QUANTIZED_MODES:
            raise ValueError(f"QuantizedWeight mode must be one of {QUANTIZED_MODES}, got {self.mode!r}")

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape of the float weight this stands for ([..., in, out])."""
        return (*self.q.shape[:-2], *self.logical)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dequantize(self, dtype: jnp.dtype = jnp.float32) -> jax.Array:
        """The float weight [..., in, out] (materialized; for tests and debugging, not the hot path)."""
        from kernels.q8_matmul import GROUP, unpack, unpack_groups

        k, n = self.logical
        q, d = unpack(self.q, self.scale)  # [..., Np, Kp], [..., Np, Kp/32]
        w = q.astype(jnp.float32) * jnp.repeat(d, GROUP, axis=-1)
        if self.offset is not None:
            w = w + jnp.repeat(unpack_groups(self.offset), GROUP, axis=-1)
        return jnp.swapaxes(w[..., :n, :k], -1, -2).astype(dtype)


def check_mode(mode: str, allowed: tuple[str, ...] = MODES) -> None:
    if mode not in allowed:
        raise ValueError(f"unknown quantization mode {mode!r}; allowed modes: {', '.join(allowed)}")


def quantize_weight(w, mode: str) -> QuantizedWeight | int8.Int8Weight:
    """A float weight [..., in, out] -> int8 in `mode`: group-wise (numpy, on the host; a weight already
    in this form: its mode is set) or an int8.MODES one (JAX on w's device: a jax.Array never leaves it)."""
    check_mode(mode, MODES[1:])
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
    from quantization import groupwise

    return groupwise.quantize_weight(w, mode)


def weight_bytes(params) -> int:
    """Bytes held by all leaves of a params pytree (int8 q and f16 scales count as stored)."""
    return sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
               for leaf in jax.tree_util.tree_leaves(params))
