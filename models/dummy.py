"""Random weights for a ModelConfig (`--load-format dummy`): real model sizes with no checkpoint.

Each tensor is drawn on the host with numpy's generator (jax.random compiled a program for every
shape: seconds for a model, paid again in every process) and moved to the default device, in the
activation dtype or directly in the quantized format (group-wise int8: random int8 and one scale per
tensor, packed on the host; the TPU's int8 modes: rounded on the device one layer at a time into int8
stacks), so no float copy of the model ever exists; a stacked weight's other layers are rotations of
its first, made on the device.
Spreads follow the usual init: linears 1/sqrt(fan_in) (normal, or uniform int8), embeddings 0.02
(uniform int8 times a scale, so a tied int8 head is exact), norms 1, biases 0: activations stay
finite and the logits vary.
"""
from __future__ import annotations

import functools
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from slipstream.models.architectures import build_abstract
from slipstream.models.base import CausalLM, Weight
from slipstream.models.config import ModelConfig
from slipstream.models.layers import Linear, RMSNorm
from slipstream.quantization.weights import head_mode, int4_on_cpu

GROUPWISE = ("q8_0", "q8_0-a16")
EMBED_STD = 0.02
# the spread of an integer drawn uniformly from [-127, 127]: sqrt((255^2 - 1) / 12)
_INT8_UNIFORM_STD = math.sqrt((255 ** 2 - 1) / 12)


def _norm_offsets(model: CausalLM) -> dict[tuple, float]:
    """Path of each RMSNorm weight -> the norm's offset (Gemma's 1 + w scales: w = 0 is scale 1)."""
    return {(*path, "w"): node.offset for path, node in nnx.iter_graph(model) if isinstance(node, RMSNorm)}


def _int8(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Uniform int8 in [-127, 127] (random bytes, -128 taken as -127)."""
    q = np.frombuffer(rng.bytes(math.prod(shape)), np.int8).reshape(shape)
    return np.maximum(q, -127)


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float, dtype) -> jax.Array:
    """N(0, std^2) in `dtype`, on the default device."""
    return jax.device_put((rng.standard_normal(shape, np.float32) * np.float32(std)).astype(jnp.dtype(dtype)))


@jax.jit
def _rotations(one: jax.Array, shifts: jax.Array) -> jax.Array:
    """[L, ...]: `one` rotated (flat) by each shift."""
    return jax.vmap(lambda s: jnp.roll(one.reshape(-1), s).reshape(one.shape))(shifts)


def _embed_scale() -> np.float32:
    return np.float32(np.float16(EMBED_STD / _INT8_UNIFORM_STD))


@functools.partial(jax.jit, static_argnums=1)
def _scaled(q: jax.Array, dtype) -> jax.Array:
    """The embedding table in `dtype` from its int8 values, on the device: no float temporaries."""
    return q.astype(dtype) * jnp.asarray(_embed_scale(), dtype)


def _shifts(rng: np.random.Generator, layers: int, size: int) -> list[int]:
    """Layer i's weight is the drawn one rotated by shifts[i] elements (layer 0: itself). Drawing every
    layer costs minutes for an 8B model on a CPU; a rotation costs a copy."""
    return [0, *(int(s) for s in rng.integers(1, max(size, 2), layers - 1))]


def _draw_groupwise(rng: np.random.Generator, shape: tuple[int, ...], mode: str):
    """A group-wise int8 weight [L?, in, out]: int8 rows [out, in] (as checkpoints hold them) drawn
    directly with one scale for the tensor, packed on the host like a loaded weight."""
    from slipstream.kernels.q8_matmul import TILE
    from slipstream.quantization.groupwise import GROUP, pack_one, pack_rows, stack_packed

    k, n = shape[-2:]
    d = np.float32(np.float16(1 / math.sqrt(k) / _INT8_UNIFORM_STD))
    scales = np.full((n, -(-k // GROUP)), d, np.float32)  # one per 32 inputs per output column
    if len(shape) == 2:
        return pack_one((_int8(rng, (n, k)), scales), mode)
    if k % GROUP or n % TILE:  # padded packing: rotating it would move weights into the padding
        return stack_packed([pack_rows((_int8(rng, (n, k)), scales)) for _ in range(shape[0])], k, n, mode)
    base = pack_rows((_int8(rng, (n, k)), scales))
    # the packed layout is a permutation of the int8 weights (stored q + 128) and every scale is the
    # same, so a rotation of the packed bytes is another uniform int8 weight, already packed. Each
    # rotation is a view into the bytes twice over: one layer's extra memory, not L.
    packed, packed_scales = base
    size = packed.size
    twice = np.concatenate([packed.reshape(-1), packed.reshape(-1)])
    layers = [(twice[size - shift:2 * size - shift].reshape(packed.shape), packed_scales)
              for shift in _shifts(rng, shape[0], size)]
    return stack_packed(layers, k, n, mode)


def _rotated(layer: jax.Array, one: jax.Array, shifts: jax.Array) -> jax.Array:
    """Layer `layer` of a drawn stack: `one` rotated (flat) by shifts[layer] (traced)."""
    return jnp.roll(one.reshape(-1), shifts[layer]).reshape(one.shape)


def _draw_quantized(rng: np.random.Generator, shape: tuple[int, ...], mode: str, dtype):
    """Another quantized format: one layer drawn in `dtype` and each layer (a rotation of it) rounded
    by quantization's public functions. int8.MODES (the TPU's): one program rounds layer after layer
    into int8 stacks allocated once (quantization.int8.quantize_layers), so the float temporaries
    are one layer's, never a float stack of L layers; others (and int4 on CPU: q8_0-a16 with 4-bit rows,
    weights.int4_on_cpu): layer by layer on the host."""
    from slipstream.quantization import int8, quantize_weight

    one = _normal(rng, shape[-2:], 1 / math.sqrt(shape[-2]), dtype)
    if len(shape) == 2:
        return quantize_weight(one, mode)
    shifts = np.asarray(_shifts(rng, shape[0], one.size), np.int32)
    if mode in int8.MODES and not (mode == "int4" and int4_on_cpu()):
        return int8.quantize_layers(_rotated, (one, shifts), shape[0], mode)
    from slipstream.quantization.groupwise import pack_layers, quantize_rows, quantize_rows4

    rows, mode = (quantize_rows4, "q8_0-a16") if mode == "int4" else (quantize_rows, mode)
    return pack_layers([rows(np.asarray(_rotated(i, one, shifts), np.float32).T) for i in range(shape[0])], mode)


def _draw(rng: np.random.Generator, path: tuple, weight: Weight, shape: tuple[int, ...], dtype,
          offsets: dict[tuple, float]) -> jax.Array:
    if path in offsets:
        return jax.device_put(np.full(shape, 1.0 - offsets[path], jnp.dtype(dtype)))
    if path[-1] == "b":
        return jax.device_put(np.zeros(shape, jnp.dtype(dtype)))
    std = 1 / math.sqrt(shape[-2]) if weight.linear else EMBED_STD
    if not weight.per_layer:
        return _normal(rng, shape, std, dtype)
    one = _normal(rng, shape[1:], std, dtype)
    return _rotations(one, np.asarray(_shifts(rng, shape[0], one.size), np.int32))


def _draw_experts(rng: np.random.Generator, shape: tuple[int, ...], quantize: str, dtype):
    """A sparse MoE's experts [L, E, in, out] (quantization/experts.ExpertStack): quantized, uniform int8 with one
    scale (1/sqrt(in) spread, as the other linears), drawn as int8; else normal floats. One layer's experts drawn,
    the other layers rotations of it (each expert of a layer is its own draw)."""
    from slipstream.quantization.experts import ExpertStack

    if quantize == "none":
        one = _normal(rng, shape[1:], 1 / math.sqrt(shape[-2]), dtype)
    else:
        one = jax.device_put(_int8(rng, shape[1:]))
    q = _rotations(one, np.asarray(_shifts(rng, shape[0], one.size), np.int32))
    if quantize == "none":
        return ExpertStack(q)
    d = np.float32(1 / math.sqrt(shape[-2]) / _INT8_UNIFORM_STD)
    return ExpertStack(q, jax.device_put(np.full((shape[0], shape[1], shape[3]), d, np.float32)))


def dummy_model(cfg: ModelConfig, *, dtype="float32", quantize: str = "none", seed: int = 0,
                progress: bool = False) -> CausalLM:
    """The architecture's module with every weight random (quantize: "none", or a quantization mode
    whose linears, the LM head included, are drawn already quantized)."""
    model = build_abstract(cfg)
    offsets = _norm_offsets(model)
    graphdef, state = nnx.split(model)
    variables = dict(nnx.to_flat_state(state))
    declared = {tuple(w.path.split(".")): w for w in type(model).WEIGHTS}
    undeclared = sorted(set(variables) - set(declared))
    if undeclared:  # a module weight without a declaration is a bug in the architecture file
        raise RuntimeError(f"{type(model).__name__} declares no weight for {undeclared}")
    embed_q = None
    # the declaration's order (embedding and LM head first): their packing temporaries come and go
    # while the model is still empty, as in the loader
    order = [path for path in declared if path in variables]
    bar = tqdm(order, unit="tensor", desc=f"dummy weights ({quantize})", file=sys.stderr,
               disable=not progress, leave=False)
    for index, path in enumerate(bar):
        var, weight = variables[path], declared[path]
        shape = tuple(var.get_value().shape)
        rng = np.random.default_rng((seed, index))  # each tensor its own stream
        if weight.experts:
            value = _draw_experts(rng, shape, quantize, dtype)
        elif weight.linear and quantize in GROUPWISE:
            value = _draw_groupwise(rng, shape, quantize)
        elif weight.linear and quantize != "none":
            value = _draw_quantized(rng, shape, quantize if weight.per_layer else head_mode(quantize), dtype)
        elif path == ("embed", "table"):  # int8 times one scale: a tied int8 LM head is exact
            q = _int8(rng, shape)
            value = _scaled(q, jnp.dtype(dtype))
            embed_q = q if cfg.tie_embeddings and quantize != "none" else None
        else:
            value = _draw(rng, path, weight, shape, dtype, offsets)
        var.set_value(value)
    model = nnx.merge(graphdef, state)
    if cfg.tie_embeddings and quantize != "none":
        # the tied LM head: int8 rows of the table, exact (the table is int8 times one scale)
        head = nnx.eval_shape(lambda: Linear(cfg.hidden_size, cfg.vocab_size, ("embed", "vocab")))
        head.w.set_value(_tied_head(embed_q, head_mode(quantize)))
        model.lm_head = head
    return model


def _tied_head(embed_q: np.ndarray, mode: str):
    """The LM head [hidden, vocab] in `mode` from the table's int8 values [vocab, hidden] (every
    scale the table's one, offsets zero: exact)."""
    vocab, hidden = embed_q.shape
    if mode in GROUPWISE:
        from slipstream.quantization.groupwise import GROUP, pack_one

        scales = np.full((vocab, -(-hidden // GROUP)), _embed_scale(), np.float32)
        return pack_one((embed_q, scales), mode)
    from slipstream.quantization import int8

    if mode not in int8.MODES:
        raise ValueError(f"no tied LM head for quantization mode {mode!r}")
    return int8.from_int8(jax.device_put(np.ascontiguousarray(embed_q.T)), float(_embed_scale()), mode)  # [hidden, vocab]
