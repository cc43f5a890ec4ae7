"""XLA:CPU's and the TPU's forms of stacked linear weights: what the engine's scanned layer body
multiplies by.

A scan over stacked weights [L, ...] makes XLA:CPU copy each layer's slice out of the stack before
its dot (it cannot matmul a dynamic slice), ~2x the weight reads at batch 1. So on CPU:
- group-wise int8 weights (`StackedQ8`), per-channel int8 ones (`StackedChannel`, the int8-channel modes) and
  f32 ones (`StackedF32`, packed in column panels) stay
  one stack [L, ...] that a native kernel reads at the traced layer index, where it lies: no slice,
  no switch. The linears one input feeds (q/k/v, gate/up: `FUSED`) are fused along their output
  columns at load, so each group is one kernel call (one fixed per-call cost instead of three or
  two); the other members hold a `FusedMember` marker;
- other float weights (bf16; f32 without the native kernel), group-wise int8 ones under tensor
  parallelism (engine/sharding.py) and quantization/int8.py's (the TPU/GPU modes) are kept as L separate buffers (`PerLayer`), and the layer body picks layer
  i's buffer with lax.switch (`LayerPick`); a group of weights read by one input shares one switch;
- a per-channel int8 weight outside the stack (the LM head) is packed once for its kernel (`PackedChannel`);
- a sparse MoE's int8 experts are packed for the per-channel kernel, which reads each expert at (layer, expert),
  gate and up fused (quantization/experts.PackedExperts), under tensor parallelism too (each device's slice of the
  experts packed apart); float experts stay one stack picked by index;
- with the hybrid weights (EngineConfig.prompt_w16) the group-wise stacks are `StackedHybrid`: the StackedQ8 and
  its int8-channel-w16 rounding, a step's prompt rows on the second (docs/kernels.md).
On TPU (any backend but CPU, one device per replica), quantization/int8.py's stacks [L, in, out]
become `StackedInt8` (`index_int8_stacks`): the same arrays, multiplied at the traced layer index, so
the Pallas int8 kernel reads each layer's blocks where they lie instead of a slice the scan copies out
of the stack every step (0.30 -> 0.19 ms per 4096 x 14336 matmul at one row on a v5e). Unfused: one
kernel call per linear (fusing q/k/v or gate/up at load would copy those stacks).
The forms themselves are weight formats (quantization/layer_forms.py, built by layer_packing.py); this
module decides which weight takes which, from the model's fused groups. models/layers.py calls
quantization.ops without knowing why.
"""
from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from slipstream.kernels import f32_matmul as f32
from slipstream.kernels import int8_channel_matmul as icm
from slipstream.models import layers
from slipstream.models.base import CausalLM
from slipstream.quantization import Int8Weight, QuantizedWeight
from slipstream.quantization.experts import ExpertStack
from slipstream.quantization.layer_forms import (  # noqa: F401  (re-exported: engine/sharding.py, tests)
    FusedMember, Int8Pick, LayerPick, PackedChannel, PerLayer, StackedChannel, StackedF32, StackedHybrid, StackedInt8,
    StackedPick, StackedQ8)
from slipstream.quantization.layer_packing import (channel_weight, fuse_channel, fuse_f32, fuse_hybrid, fuse_q8,
                                                   pack_channel, pack_experts)

# The linears of one module that models/layers.py multiplies by one input (layers.project), in its order.
FUSED: tuple[tuple[type, tuple[str, ...]], ...] = (
    (layers.Attention, ("wq", "wk", "wv")),
    (layers.GatedMLP, ("w_gate", "w_up")),
)


def _stackable_f32(value) -> bool:
    return isinstance(value, jax.Array) and value.dtype == np.float32 and value.ndim == 3


def split_linears(model: CausalLM, *, stack_int8: bool = True, stack_f32: bool | None = None,
                  prompt_w16: bool = False, expert_shards: int = 1) -> None:
    """Put every per-layer linear weight of `model` in its XLA:CPU form (in place): group-wise int8 ones as
    StackedQ8 and per-channel ones as StackedChannel when `stack_int8`, f32 ones as StackedF32 when `stack_f32`
    (by default: as `stack_int8`, and only where kernels/f32_matmul's native kernel runs), FUSED groups fused;
    everything else as PerLayer. A per-channel int8 weight outside the stack (the LM head) becomes a
    PackedChannel when `stack_int8`. prompt_w16 (with `stack_int8`): the group-wise q8_0-a16 stacks become
    StackedHybrid, which also hold the weights as int8-channel-w16 for a step's prompt rows (the LM head and
    weights outside the stack keep their one form). A sparse MoE's int8 experts are packed for the per-channel
    kernel when `stack_int8` or under tensor parallelism (`expert_shards` > 1: each device's slice of the experts'
    hidden dimension packed apart, engine/device/sharding.py)."""
    fuse_groupwise = fuse_hybrid if prompt_w16 and stack_int8 else fuse_q8
    if stack_f32 is None:
        stack_f32 = stack_int8
    stack_f32 = stack_f32 and f32.native_available()
    state = nnx.state(model, nnx.Param)
    flat = dict(nnx.to_flat_state(state))
    n = model.cfg.num_layers
    candidates: dict[tuple, object] = {}
    experts = [flat[key] for w in type(model).WEIGHTS if w.experts and (key := tuple(w.path.split("."))) in flat]
    # gate, up, down: stacks the native per-channel kernel reads at (layer, expert)
    if ((stack_int8 or expert_shards > 1) and experts and icm.native_available()
            and all(isinstance(v.get_value(), ExpertStack) and v.get_value().scale is not None for v in experts)):
        for var, form in zip(experts, pack_experts(*(v.get_value() for v in experts), shards=expert_shards)):
            var.set_value(form)
    for w in type(model).WEIGHTS:
        key = tuple(w.path.split("."))
        if w.experts:
            continue
        if w.linear and w.per_layer and key in flat:
            value = flat[key].get_value()
            if ((stack_int8 and (isinstance(value, QuantizedWeight) or channel_weight(value)))
                    or (stack_f32 and _stackable_f32(value))):
                candidates[key] = value
    stacked: dict[tuple, object] = {}
    for path, module in nnx.iter_modules(model):
        for kind, names in FUSED:
            keys = [(*map(str, path), name, "w") for name in names]
            if not isinstance(module, kind) or not all(k in candidates for k in keys):
                continue
            group = [candidates[k] for k in keys]
            if all(isinstance(g, QuantizedWeight) for g in group):
                if len({(g.logical[0], g.mode, g.q.shape[0]) for g in group}) != 1:
                    continue  # not one input, mode and depth: left unfused
                stacked[keys[0]] = fuse_groupwise(group)
            elif all(isinstance(g, Int8Weight) for g in group):
                if len({(g.q.shape[:2], g.parts) for g in group}) != 1:
                    continue
                stacked[keys[0]] = fuse_channel(group)
            elif all(_stackable_f32(g) for g in group) and len({g.shape[:2] for g in group}) == 1:
                stacked[keys[0]] = fuse_f32(group)
            else:
                continue
            for j, k in enumerate(keys[1:], 1):
                stacked[k] = FusedMember(j)
    for w in type(model).WEIGHTS:
        key = tuple(w.path.split("."))
        var = flat.get(key)
        if var is not None and w.linear and not w.per_layer and stack_int8 and channel_weight(var.get_value()):
            var.set_value(pack_channel(var.get_value()))
            continue
        if var is None or not (w.linear and w.per_layer) or w.experts:
            continue
        if key in stacked:
            var.set_value(stacked[key])
            continue
        value = var.get_value()
        if key in candidates:
            var.set_value(fuse_groupwise([value]) if isinstance(value, QuantizedWeight) else
                          fuse_channel([value]) if isinstance(value, Int8Weight) else fuse_f32([value]))
            continue
        var.set_value(PerLayer(tuple(jax.tree.map(lambda a, i=i: a[i], value) for i in range(n))))
    nnx.update(model, state)


def index_int8_stacks(model: CausalLM) -> int:
    """Put every per-layer linear weight of `model` that is a quantization/int8 stack (an Int8Weight
    [L, in, out]) in the StackedInt8 form (in place; no array is copied). Returns how many it wrapped."""
    state = nnx.state(model, nnx.Param)
    flat = dict(nnx.to_flat_state(state))
    wrapped = 0
    for w in type(model).WEIGHTS:
        var = flat.get(tuple(w.path.split(".")))
        if var is None or not (w.linear and w.per_layer) or w.experts:
            continue
        value = var.get_value()
        if isinstance(value, Int8Weight) and value.q.ndim == 3:
            var.set_value(StackedInt8(value))
            wrapped += 1
    nnx.update(model, state)
    return wrapped
