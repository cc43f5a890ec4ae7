"""Random weights for a ModelConfig (`--load-format dummy`): real model sizes with no checkpoint.

Each tensor is drawn on the default device with jax.random, in the activation dtype or directly in
the quantized format (group-wise int8: random int8 and one scale per tensor, packed on the host; the
TPU's int8 modes: rounded on the device one layer at a time into int8 stacks), so no float copy of
the model ever exists; a stacked weight's other layers are rotations of its first.
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


@functools.partial(jax.jit, static_argnums=1)
def _int8_device(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    size = math.prod(shape)
    words = jax.random.bits(key, (-(-size // 4),), jnp.uint32)
    q = jax.lax.bitcast_convert_type(words, jnp.int8).reshape(-1)[:size]
    return jnp.maximum(q, -127).reshape(shape)


def _int8(key: jax.Array, shape: tuple[int, ...]) -> np.ndarray:
    """Uniform int8 in [-127, 127] (four per drawn 32-bit word), on the host for packing."""
    return np.asarray(_int8_device(key, shape))


@jax.jit
def _rotations(one: jax.Array, shifts: jax.Array) -> jax.Array:
    """[L, ...]: `one` rotated (flat) by each shift."""
    return jax.vmap(lambda s: jnp.roll(one.reshape(-1), s).reshape(one.shape))(shifts)


def _embed_scale() -> np.float32:
    return np.float32(np.float16(EMBED_STD / _INT8_UNIFORM_STD))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _embedding(key: jax.Array, shape: tuple[int, ...], dtype, with_int8: bool):
    """(the table in `dtype`, its int8 values or None) in one program: no float temporaries."""
    q = _int8_device(key, shape)
    return q.astype(dtype) * jnp.asarray(_embed_scale(), dtype), (q if with_int8 else None)


def _shifts(key: jax.Array, layers: int, size: int) -> list[int]:
    """Layer i's weight is the drawn one rotated by shifts[i] elements (layer 0: itself). Drawing every
    layer with jax.random costs minutes for an 8B model on a CPU; a rotation costs a copy."""
    return [0, *(int(s) for s in np.asarray(jax.random.randint(key, (layers - 1,), 1, max(size, 2))))]


def _draw_groupwise(key: jax.Array, shape: tuple[int, ...], mode: str):
    """A group-wise int8 weight [L?, in, out]: int8 rows [out, in] (as checkpoints hold them) drawn
    directly with one scale for the tensor, packed on the host like a loaded weight."""
    from slipstream.kernels.q8_matmul import TILE
    from slipstream.quantization.groupwise import GROUP, pack_one, pack_rows, stack_packed

    k, n = shape[-2:]
    d = np.float32(np.float16(1 / math.sqrt(k) / _INT8_UNIFORM_STD))
    scales = np.full((n, -(-k // GROUP)), d, np.float32)  # one per 32 inputs per output column
    draw_key, shift_key = jax.random.split(key)
    if len(shape) == 2:
        return pack_one((_int8(draw_key, (n, k)), scales), mode)
    if k % GROUP or n % TILE:  # padded packing: rotating it would move weights into the padding
        return stack_packed([pack_rows((_int8(jax.random.fold_in(draw_key, i), (n, k)), scales))
                             for i in range(shape[0])], k, n, mode)
    base = pack_rows((_int8(draw_key, (n, k)), scales))
    # the packed layout is a permutation of the int8 weights (stored q + 128) and every scale is the
    # same, so a rotation of the packed bytes is another uniform int8 weight, already packed. Each
    # rotation is a view into the bytes twice over: one layer's extra memory, not L.
    packed, packed_scales = base
    size = packed.size
    twice = np.concatenate([packed.reshape(-1), packed.reshape(-1)])
    layers = [(twice[size - shift:2 * size - shift].reshape(packed.shape), packed_scales)
              for shift in _shifts(shift_key, shape[0], size)]
    return stack_packed(layers, k, n, mode)


def _rotated(layer: jax.Array, one: jax.Array, shifts: jax.Array) -> jax.Array:
    """Layer `layer` of a drawn stack: `one` rotated (flat) by shifts[layer] (traced)."""
    return jnp.roll(one.reshape(-1), shifts[layer]).reshape(one.shape)


def _draw_quantized(key: jax.Array, shape: tuple[int, ...], mode: str, dtype):
    """Another quantized format: one layer drawn in `dtype` and each layer (a rotation of it) rounded
    by quantization's public functions. int8.MODES (the TPU's): one program rounds layer after layer
    into int8 stacks allocated once (quantization.int8.quantize_layers), so the float temporaries
    are one layer's, never a float stack of L layers; others (and int4 on CPU: q8_0-a16 with 4-bit rows,
    weights.int4_on_cpu): layer by layer on the host."""
    from slipstream.quantization import int8, quantize_weight

    draw_key, shift_key = jax.random.split(key)
    one = jax.random.normal(draw_key, shape[-2:], dtype) * jnp.asarray(1 / math.sqrt(shape[-2]), dtype)
    if len(shape) == 2:
        return quantize_weight(one, mode)
    shifts = jnp.asarray(_shifts(shift_key, shape[0], one.size), jnp.int32)
    if mode in int8.MODES and not (mode == "int4" and int4_on_cpu()):
        return int8.quantize_layers(_rotated, (one, shifts), shape[0], mode)
    from slipstream.quantization.groupwise import pack_layers, quantize_rows, quantize_rows4

    rows, mode = (quantize_rows4, "q8_0-a16") if mode == "int4" else (quantize_rows, mode)
    return pack_layers([rows(np.asarray(_rotated(i, one, shifts), np.float32).T) for i in range(shape[0])], mode)


def _draw(key: jax.Array, path: tuple, weight: Weight, shape: tuple[int, ...], dtype,
          offsets: dict[tuple, float]) -> jax.Array:
    if path in offsets:
        return jnp.full(shape, 1.0 - offsets[path], dtype)
    if path[-1] == "b":
        return jnp.zeros(shape, dtype)
    std = jnp.asarray(1 / math.sqrt(shape[-2]) if weight.linear else EMBED_STD, dtype)
    if not weight.per_layer:
        return jax.random.normal(key, shape, dtype) * std
    draw_key, shift_key = jax.random.split(key)
    one = jax.random.normal(draw_key, shape[1:], dtype) * std
    return _rotations(one, jnp.asarray(_shifts(shift_key, shape[0], one.size), jnp.int32))


def _draw_experts(key: jax.Array, shape: tuple[int, ...], quantize: str, dtype):
    """A sparse MoE's experts [L, E, in, out] (quantization/experts.ExpertStack): quantized, uniform int8 with one
    scale (1/sqrt(in) spread, as the other linears), drawn as int8; else normal floats. One layer's experts drawn,
    the other layers rotations of it (each expert of a layer is its own draw)."""
    from slipstream.quantization.experts import ExpertStack

    draw_key, shift_key = jax.random.split(key)
    if quantize == "none":
        one = jax.random.normal(draw_key, shape[1:], dtype) * jnp.asarray(1 / math.sqrt(shape[-2]), dtype)
    else:
        one = _int8_device(draw_key, shape[1:])
    q = _rotations(one, jnp.asarray(_shifts(shift_key, shape[0], one.size), jnp.int32))
    if quantize == "none":
        return ExpertStack(q)
    d = np.float32(1 / math.sqrt(shape[-2]) / _INT8_UNIFORM_STD)
    return ExpertStack(q, jnp.full((shape[0], shape[1], shape[3]), d, jnp.float32))


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
    key, embed_q = jax.random.key(seed), None
    # the declaration's order (embedding and LM head first): their packing temporaries come and go
    # while the model is still empty, as in the loader
    order = [path for path in declared if path in variables]
    bar = tqdm(order, unit="tensor", desc=f"dummy weights ({quantize})", file=sys.stderr,
               disable=not progress, leave=False)
    for index, path in enumerate(bar):
        var, weight = variables[path], declared[path]
        shape = tuple(var.get_value().shape)
        tensor_key = jax.random.fold_in(key, index)
        if weight.experts:
            value = _draw_experts(tensor_key, shape, quantize, dtype)
        elif weight.linear and quantize in GROUPWISE:
            value = _draw_groupwise(tensor_key, shape, quantize)
        elif weight.linear and quantize != "none":
            value = _draw_quantized(tensor_key, shape, quantize if weight.per_layer else head_mode(quantize), dtype)
        elif path == ("embed", "table"):  # int8 times one scale: a tied int8 LM head is exact
            tied_int8 = cfg.tie_embeddings and quantize != "none"
            value, embed_q = _embedding(tensor_key, shape, jnp.dtype(dtype), tied_int8)
        else:
            value = _draw(tensor_key, path, weight, shape, dtype, offsets)
        var.set_value(value)
    model = nnx.merge(graphdef, state)
    if cfg.tie_embeddings and quantize != "none":
        # the tied LM head: int8 rows of the table, exact (the table is int8 times one scale)
        head = nnx.eval_shape(lambda: Linear(cfg.hidden_size, cfg.vocab_size, ("embed", "vocab")))
        head.w.set_value(_tied_head(embed_q, head_mode(quantize)))
        model.lm_head = head
    return model


def _tied_head(embed_q: jax.Array, mode: str):
    """The LM head [hidden, vocab] in `mode` from the table's int8 values [vocab, hidden] (every
    scale the table's one, offsets zero: exact)."""
    vocab, hidden = embed_q.shape
    if mode in GROUPWISE:
        from slipstream.quantization.groupwise import GROUP, pack_one

        scales = np.full((vocab, -(-hidden // GROUP)), _embed_scale(), np.float32)
        return pack_one((np.asarray(embed_q), scales), mode)
    from slipstream.quantization import int8

    if mode not in int8.MODES:
        raise ValueError(f"no tied LM head for quantization mode {mode!r}")
    return int8.from_int8(embed_q.T, float(_embed_scale()), mode)                 # [hidden, vocab]
