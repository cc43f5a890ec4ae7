"""Offline int8 weight quantization: the QuantizedWeight pytree and the params transform.

Runs once at load time; the matching runtime matmul lives in quantization/ops.py.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

MODES: tuple[str, ...] = ("none", "w8a16", "w8a8", "q8_0", "q8_0-a16")
QUANTIZED_MODES: tuple[str, ...] = ("w8a16", "w8a8", "q8_0", "q8_0-a16")
GROUPWISE_MODES: tuple[str, ...] = ("q8_0", "q8_0-a16")
# The linear weights inside params["layers"]; norms, biases and the embedding gather stay float.
LAYER_WEIGHTS: tuple[str, ...] = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
INT8_MAX = 127.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """int8 weight.

    Modes "w8a16" and "w8a8": per output channel, w ~= q * scale; q int8[..., in, out], scale f32[..., out].
    Modes "q8_0" and "q8_0-a16" (group-wise, llama.cpp's Q8_0, see quantization/groupwise.py): one
    scale per 32 inputs per output column, packed for kernels.q8_matmul: q u8[..., Np/16, Kp*16],
    scale f32[..., Np/16, Kp/32*16]; offset: None or like scale (w = q * scale + offset per group,
    GGUF's asymmetric blocks); logical = (in, out), the float weight's shape (static). q8_0 rounds
    activations to int8 per 32 values (llama.cpp's w8a8); q8_0-a16 adds their int8 residual.
    mode (static, not a leaf).
    keep_a16: None, or (w8a8 only) bool[...] per leading index: True keeps that layer's activations
    float (w8a16), for the few layers whose activation outliers int8 rows cannot hold. A leaf, not
    static, so stacked layers may differ and lax.scan / split_layers slice it like q.
    Leading axes (the stacked layer axis L) are sliced away by lax.scan like any other leaf.
    """

    q: jax.Array
    scale: jax.Array
    mode: str = dataclasses.field(metadata=dict(static=True))
    keep_a16: jax.Array | None = None
    offset: jax.Array | None = None
    logical: tuple[int, int] | None = dataclasses.field(default=None, metadata=dict(static=True))

    def __post_init__(self) -> None:
        # Only the static field is checked: JAX rebuilds this node with placeholder leaves
        # (tracers, None, axis specs) during transformations, so leaf checks live in
        # quantize_weight and ops.linear.
        if self.mode not in QUANTIZED_MODES:
            raise ValueError(
                f"QuantizedWeight mode must be one of {QUANTIZED_MODES}, got {self.mode!r}"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape of the float weight this stands for ([..., in, out])."""
        if self.logical is not None:
            return (*self.q.shape[:-2], *self.logical)
        return tuple(self.q.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dequantize(self, dtype: jnp.dtype = jnp.float32) -> jax.Array:
        """The float weight [..., in, out] (materialized; for tests and debugging, not the hot path)."""
        if self.mode in GROUPWISE_MODES:
            from kernels.q8_matmul import GROUP, unpack, unpack_groups

            k, n = self.logical
            q, d = unpack(self.q, self.scale)  # [..., Np, Kp], [..., Np, Kp/32]
            w = q.astype(jnp.float32) * jnp.repeat(d, GROUP, axis=-1)
            if self.offset is not None:
                w = w + jnp.repeat(unpack_groups(self.offset), GROUP, axis=-1)
            return jnp.swapaxes(w[..., :n, :k], -1, -2).astype(dtype)
        return (self.q.astype(jnp.float32) * self.scale[..., None, :]).astype(dtype)


def _check_mode(mode: str, allowed: tuple[str, ...]) -> None:
    if mode not in allowed:
        raise ValueError(f"unknown quantization mode {mode!r}; allowed modes: {', '.join(allowed)}")


@jax.jit
def _quantize_arrays(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    w32 = w.astype(jnp.float32)  # [..., in, out]
    amax = jnp.max(jnp.abs(w32), axis=-2)  # [..., out]
    scale = amax / INT8_MAX  # [..., out]
    # An all-zero column keeps scale 0 (so it dequantizes to exact zeros) but must not divide by 0.
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(w32 / safe[..., None, :]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale


def quantize_weight(w: jax.Array, mode: str, keep_a16=None) -> QuantizedWeight:
    """Quantize a float weight [..., in, out] to int8 with one symmetric scale per output column
    (keep_a16: see QuantizedWeight; bool [...] over w's leading axes)."""
    _check_mode(mode, QUANTIZED_MODES)
    if w.ndim < 2:
        raise ValueError(f"expected a weight of shape [..., in, out], got shape {tuple(w.shape)}")
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"expected a floating-point weight, got dtype {w.dtype}")
    if mode in GROUPWISE_MODES:
        if keep_a16 is not None:
            raise ValueError("keep_a16 applies to w8a8 only")
        from quantization import groupwise

        return groupwise.quantize_weight(w, mode)
    if keep_a16 is not None:
        keep_a16 = np.asarray(keep_a16, bool)
        if mode != "w8a8" or keep_a16.shape != tuple(w.shape[:-2]):
            raise ValueError(f"keep_a16 needs mode w8a8 and shape {tuple(w.shape[:-2])} (the weight's leading "
                             f"axes); got mode {mode!r}, shape {keep_a16.shape}")
        keep_a16 = jnp.asarray(keep_a16)
    q, scale = _quantize_arrays(w)
    return QuantizedWeight(q=q, scale=scale, mode=mode, keep_a16=keep_a16)


def quantize(
    params: dict[str, Any], mode: str, *, include_embeddings: bool = False, progress: bool = False,
    keep_a16: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Return a copy of `params` with every linear weight replaced by a QuantizedWeight.

    Quantizes params["layers"][LAYER_WEIGHTS] and, with include_embeddings, params["lm_head"]
    (never params["embed"], which is a gather). mode "none" returns `params` unchanged.
    Group-wise weights the loader already built (models.loader, quantize="q8_0") are kept (set to
    `mode`); any other already-quantized weight is an error.
    keep_a16 (w8a8): {layer weight name: bool [L]}, the layers of that weight kept at w8a16.
    """
    _check_mode(mode, MODES)
    if mode == "none":
        return params
    layers = params.get("layers")
    if not isinstance(layers, dict):
        raise ValueError("params has no 'layers' dict; expected the stacked llama params pytree")
    missing = [name for name in LAYER_WEIGHTS if name not in layers]
    if missing:
        raise ValueError(f"params['layers'] is missing linear weights {missing}")
    unknown = set(keep_a16 or {}) - set(LAYER_WEIGHTS)
    if unknown:
        raise ValueError(f"keep_a16 names {sorted(unknown)}; layer weights are {LAYER_WEIGHTS}")
    targets: list[tuple[str, ...]] = [("layers", name) for name in LAYER_WEIGHTS]
    if include_embeddings and "lm_head" in params:
        targets.append(("lm_head",))

    out = dict(params)
    out["layers"] = dict(layers)
    for path in tqdm(targets, desc=f"quantize {mode}", file=sys.stderr, disable=not progress):
        parent = out["layers"] if path[0] == "layers" else out
        current = parent[path[-1]]
        if isinstance(current, QuantizedWeight) and mode in GROUPWISE_MODES and current.mode in GROUPWISE_MODES:
            # built by the loader straight from the checkpoint's blocks; the modes share the weights
            parent[path[-1]] = dataclasses.replace(current, mode=mode)
            continue
        if isinstance(parent[path[-1]], QuantizedWeight):
            raise ValueError(f"params[{'/'.join(path)}] is already quantized")
        keep = (keep_a16 or {}).get(path[-1]) if path[0] == "layers" else None
        parent[path[-1]] = quantize_weight(parent[path[-1]], mode, keep)
    return out


def weight_bytes(params: Any) -> int:
    """Bytes held by all leaves of a params pytree (int8 q and f32 scales count as stored)."""
    return sum(
        int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        for leaf in jax.tree_util.tree_leaves(params)
    )
