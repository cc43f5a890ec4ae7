"""Tensor parallelism on a jax.sharding.Mesh: the model seam's logical axes mapped to a "model" mesh axis,
the engine's weights and KV pages placed on the mesh, and the int8 matmul run per shard.

XLA inserts the collectives of the float matmuls; the native kernels are custom calls it cannot
partition, so they run per shard under shard_map (attention in engine/attention_layer.py, int8 matmuls
here). A lone engine at tensor_parallel=1 never comes here: one device, no mesh, the same programs.
Data parallelism gives each replica its own slice of the local devices (replica_devices).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from slipstream.engine.device.attention_layer import MODEL_AXIS, cache_head_axis
from slipstream.engine.device.layer_stack import LayerPick, PerLayer
from slipstream.kernels.q8_matmul import GROUP, TILE, q8_matmul
from slipstream.models.config import ModelConfig
from slipstream.quantization import QuantizedWeight
from slipstream.quantization.experts import ExpertStack, FusedExperts, PackedExperts
from slipstream.quantization.groupwise import QuantizedTable

log = logging.getLogger(__name__)

MESH_AXES = (MODEL_AXIS,)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardingConfig:
    """Which mesh axis each logical axis of the model seam (models/layers.py) is split over; None
    replicates it. The default is Megatron-style tensor parallelism: attention heads, the MLP hidden
    dimension and the vocabulary are split, the residual stream (embed) is not."""

    q_heads: str | None = MODEL_AXIS
    kv_heads: str | None = MODEL_AXIS
    mlp: str | None = MODEL_AXIS
    vocab: str | None = MODEL_AXIS
    embed: str | None = None
    layers: str | None = None
    head_dim: str | None = None
    expert: str | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            axis = getattr(self, field.name)
            if axis is not None and axis not in MESH_AXES:
                raise ValueError(f"ShardingConfig.{field.name} = {axis!r}: the mesh axes are {MESH_AXES} "
                                 "(or None to replicate)")
        if self.expert is not None:
            raise ValueError("ShardingConfig.expert: expert parallelism (whole experts per device) is not "
                             "supported; a sparse MoE's experts split with the MLP hidden dimension (`mlp`), "
                             "every device a slice of every expert (docs/design.md)")
        if (self.q_heads is None) != (self.kv_heads is None):
            raise ValueError("ShardingConfig: q_heads and kv_heads must both be split or both replicated "
                             "(each device attends with its query heads' own KV heads)")

    def mesh_axis(self, logical: str) -> str | None:
        if logical not in {f.name for f in dataclasses.fields(self)}:
            raise ValueError(f"unknown logical axis {logical!r} (the model seam's: "
                             f"{', '.join(f.name for f in dataclasses.fields(self))})")
        return getattr(self, logical)


def head_layout(num_heads: int, num_kv_heads: int, n: int) -> tuple[str, int]:
    """How attention splits over n devices: ("split", KV) when the KV heads divide (whole GQA groups per
    device); ("repeated", n) when n is a multiple of the KV heads and divides the query heads (the
    cache holds n KV heads, a copy of KV head j // (n / KV) in slot j: one per device); else
    ("replicated", KV): every device runs all heads over the whole cache."""
    if num_kv_heads % n == 0:
        return "split", num_kv_heads
    if n % num_kv_heads == 0 and num_heads % n == 0:
        return "repeated", n
    return "replicated", num_kv_heads


def make_mesh(n: int) -> Mesh:
    """A 1-D mesh over the first n local devices, its axis named "model". Multi-host (jax.distributed),
    over every process's devices: the model spans the whole group, and each process holds the shards
    of its own devices."""
    if jax.process_count() > 1:
        if n != jax.device_count():
            raise ValueError(f"multi-host: tensor_parallel must span all {jax.device_count()} devices of the "
                             f"{jax.process_count()} processes ({jax.local_device_count()} each), got {n}")
        return Mesh(np.asarray(jax.devices()), MESH_AXES)
    devices = jax.local_devices()
    if not 1 <= n <= len(devices):
        raise ValueError(f"tensor_parallel={n} needs that many devices; this process has {len(devices)} "
                         f"({devices[0].platform}; on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N "
                         "makes N)")
    return Mesh(np.asarray(devices[:n]), MESH_AXES)


def replica_devices(tensor_parallel: int, data_parallel: int) -> list[list[jax.Device]]:
    """The local devices of each data-parallel replica: replica r gets [r*N, (r+1)*N) for N = tensor_parallel,
    a row of a ("data", "model") device grid. Each replica runs its own programs on its own row, so the
    rows are separate "model" meshes rather than one 2-D mesh."""
    if tensor_parallel < 1 or data_parallel < 1:
        raise ValueError(f"tensor_parallel and data_parallel must be >= 1, got {tensor_parallel} and {data_parallel}")
    if data_parallel > 1 and jax.process_count() > 1:
        raise ValueError("data_parallel > 1 is for one process: multi-host serves one replica over every "
                         "process's devices (run more groups behind a Service for more replicas)")
    devices = jax.local_devices()
    need = tensor_parallel * data_parallel
    if need > len(devices):
        raise ValueError(f"tensor_parallel={tensor_parallel} x data_parallel={data_parallel} needs {need} devices; "
                         f"this process has {len(devices)} ({devices[0].platform}; on CPU, "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=N makes N)")
    return [devices[r * tensor_parallel:(r + 1) * tensor_parallel] for r in range(data_parallel)]


class TensorParallel:
    """One model replica split over `n` devices: `devices` (a data-parallel replica's, replica_devices),
    or make_mesh's. At n = 1 (a data-parallel replica on one device) nothing is split: the weights and
    the cache are placed whole on that device, and the programs are the single-device ones.

    Attention heads (head_layout): with KV heads divisible by n, query heads, KV heads and the KV
    pages' head axis are split alike, so each device holds whole GQA groups. With fewer KV heads than
    devices (n a multiple of the KV heads and a divisor of the query heads), each device still gets a
    contiguous block of H/n query heads, which all belong to one KV group: the K/V projections are
    replicated and the cache holds n KV heads, KV head j // (n / KV) in slot j, so every device keeps
    only the one KV head its queries read (vLLM's replication of KV heads). Any other head count
    (e.g. 9 heads over 3 KV heads at n = 2) replicates attention whole: its weights and the cache.

    A sparse MoE's experts split as the dense MLP does, each expert's hidden dimension over the devices
    (ShardedExperts); the router is replicated, so every device routes and sorts the step's pairs alike.
    """

    def __init__(self, cfg: ModelConfig, n: int, config: ShardingConfig = ShardingConfig(),
                 devices: list[jax.Device] | None = None):
        if devices is not None and len(devices) != n:
            raise ValueError(f"tensor_parallel={n} was given {len(devices)} devices")
        if cfg.num_experts and n > 1:
            check_experts(cfg, n, config)
        self.mesh = make_mesh(n) if devices is None else Mesh(np.asarray(devices), MESH_AXES)
        self.n, self.config = n, config
        h, kv = cfg.num_heads, cfg.num_kv_heads
        self.kv_layout, self.cache_heads = head_layout(h, kv, n) if config.q_heads else ("replicated", kv)
        rules = {f.name: config.mesh_axis(f.name) for f in dataclasses.fields(config)}
        if self.kv_layout != "split":
            rules["kv_heads"] = None
        if self.kv_layout == "replicated":
            rules["q_heads"] = None
        self.rules = rules
        self.replicated = NamedSharding(self.mesh, P())
        if self.kv_layout != "split":
            log.info("tensor parallel %d: %d query heads over %d KV heads: %s", n, h, kv,
                     "each device keeps one copy of its group's KV head" if self.kv_layout == "repeated"
                     else "attention and the KV cache are replicated on every device")

    # ---- specs ------------------------------------------------------------------------------------

    def _axis(self, logical: str) -> str | None:
        self.config.mesh_axis(logical)  # an unknown name is an error, not a replicated axis
        return self.rules[logical]

    def spec(self, axes: tuple[str, ...], shape: tuple[int, ...]) -> P:
        """The PartitionSpec of an array with these logical axes; a dimension the mesh does not divide
        (and a mesh axis already used by an earlier dimension) stays whole."""
        used, out = set(), []
        for name, size in zip(axes, shape, strict=True):
            axis = self._axis(name)
            if axis is None or axis in used or size % self.n:
                out.append(None)
            else:
                used.add(axis)
                out.append(axis)
        return P(*out)

    def quantized_specs(self, w: QuantizedWeight, axes: tuple[str, ...]) -> tuple[P, P]:
        """(spec of q, spec of scale/offset) of a packed int8 weight with logical axes (..., in, out):
        the output axis splits along the Np/16 tiles, the input axis along Kp*16 (a contiguous range of
        Kp/n inputs per device, whole groups of 32). A padded dimension, or one whose shards would not
        hold whole tiles or groups, stays whole: the packed layout cannot split it."""
        k, n_out = w.logical
        lead = tuple(self._axis(a) for a in axes[:-2])
        tiles = w.q.shape[-2]
        kp = w.scale.shape[-1] // TILE * GROUP  # whatever the bits per packed weight
        out_ax, in_ax = self._axis(axes[-1]), self._axis(axes[-2])
        if out_ax is not None and n_out == tiles * TILE and tiles % self.n == 0:
            return P(*lead, out_ax, None), P(*lead, out_ax, None)
        if in_ax is not None and k == kp and (kp // GROUP) % self.n == 0:
            return P(*lead, None, in_ax), P(*lead, None, in_ax)
        return P(*lead, None, None), P(*lead, None, None)

    # ---- placement --------------------------------------------------------------------------------

    def _put(self, x: jax.Array, spec: P) -> jax.Array:
        return jax.device_put(x, NamedSharding(self.mesh, spec))

    def _place_leaf(self, value: Any, axes: tuple[str, ...]) -> Any:
        if self.n == 1:  # one device: the single-device layout, moved to that device
            return jax.device_put(value, self.replicated)
        if isinstance(value, PerLayer):  # XLA:CPU's per-layer buffers: each without the layers axis
            return ShardedPerLayer(tuple(self._place_leaf(v, axes[1:]) for v in value.layers))
        if isinstance(value, QuantizedWeight):
            q_spec, s_spec = self.quantized_specs(value, axes)
            return ShardedQ8(
                q=self._put(value.q, q_spec), scale=self._put(value.scale, s_spec), mode=value.mode,
                offset=None if value.offset is None else self._put(value.offset, s_spec),
                logical=value.logical, q_spec=q_spec, s_spec=s_spec)
        if isinstance(value, (ExpertStack, PackedExperts, FusedExperts)):
            return self.place_experts(value, axes)
        if isinstance(value, QuantizedTable):  # int8 rows and their scales, each split by its own shape
            return jax.tree.map(lambda a: self._put(a, self.spec(axes, a.shape)), value)
        return self._put(value, self.spec(axes, value.shape))

    def place_experts(self, value: Any, axes: tuple[str, ...]) -> Any:
        """An expert weight (logical axes layers, expert, in, out) split on its hidden dimension: a float or int8
        ExpertStack by its axes (a per-output-channel scale with its columns: gate's and up's split, down's
        whole), a PackedExperts on its leading axis of per-device packings (layer_packing.pack_experts' shards)."""
        if isinstance(value, FusedExperts):  # no arrays: its group's PackedExperts holds its columns
            return value
        if isinstance(value, PackedExperts):
            if value.shards != self.n:
                raise ValueError(f"experts packed in {value.shards} shards cannot split over {self.n} devices "
                                 "(engine/device/layer_stack.split_linears' expert_shards)")
            specs = tuple(P(MODEL_AXIS, *([None] * (a.ndim - 1))) for a in jax.tree.leaves(value))
        else:
            specs = (self.spec(axes, value.w.shape),)
            if value.scale is not None:
                specs += (self.spec((*axes[:-2], axes[-1]), value.scale.shape),)
        leaves, tree = jax.tree.flatten(value)
        placed = jax.tree.unflatten(tree, [self._put(a, spec) for a, spec in zip(leaves, specs)])
        return ShardedExperts(placed, specs)

    def place_params(self, state: nnx.State) -> nnx.State:
        """The engine's weights (after rounding and per-layer splitting) on the mesh, each by its
        logical axes; int8 weights become ShardedQ8 (their matmul runs per shard)."""
        for _, var in nnx.to_flat_state(state):
            axes = var.get_metadata().get("out_sharding")
            if axes is None:
                raise ValueError(f"weight {var} declares no logical axes (models/layers.param)")
            var.set_value(self._place_leaf(var.get_value(), tuple(axes)))
        return state

    def cache_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config the KV cache is shaped by: `cache_heads` KV heads."""
        return dataclasses.replace(cfg, num_kv_heads=self.cache_heads)

    @property
    def kv_heads_per_device(self) -> int:
        return self.cache_heads // self.n if self.kv_layout != "replicated" else self.cache_heads

    def cache_shardings(self, cache: dict) -> dict:
        """KV pages [L, KV, pages, page_size, hd] (and int8 scales [L, KV, pages, page_size]) split on
        the head axis, or replicated when attention is."""
        heads = MODEL_AXIS if self.kv_layout != "replicated" else None
        spec = P(*([None] * cache_head_axis(cache)), heads)
        return {name: NamedSharding(self.mesh, spec) for name in cache}

    def init_cache(self, make: Callable[[], dict], spec: dict) -> dict:
        """The zeroed cache made on the devices, each holding only its shard."""
        return jax.jit(make, out_shardings=self.cache_shardings(spec))()

    def sharded_spec(self, spec: dict) -> dict:
        """ShapeDtypeStructs of the cache with its shardings (for ahead-of-time lowering)."""
        shardings = self.cache_shardings(spec)
        return {k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shardings[k]) for k, s in spec.items()}

    def under_mesh(self, fn: Callable) -> Callable:
        """fn traced with this mesh as the abstract mesh, which is how the kernels' shard_maps find it
        (a mesh of one device has nothing to split: the kernels then run whole, as without a mesh)."""
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
                return fn(*args, **kwargs)
        return run


# ---- int8 weights: the native matmul per shard -----------------------------------------------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ShardedQ8(QuantizedWeight):
    """A QuantizedWeight placed on the mesh, with the PartitionSpecs of its packed arrays (static), so
    its matmul can run the native kernel on each device's shard (column-parallel: the output columns;
    row-parallel: a range of inputs, then a sum over devices)."""

    q_spec: P = dataclasses.field(default=P(), metadata=dict(static=True))
    s_spec: P = dataclasses.field(default=P(), metadata=dict(static=True))

    def linears(self, x: jax.Array, weights: tuple) -> tuple[jax.Array, ...]:
        return tuple(q8_linear(x, w) for w in weights)


def q8_linear(x: jax.Array, w: ShardedQ8) -> jax.Array:
    """x [..., in] @ w -> [..., out] in x's dtype, the kernel running on each device's shard."""
    k, n = w.logical
    parts = 1 if w.mode == "q8_0" else 2
    out_ax, in_ax = w.q_spec[-2], w.q_spec[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    mesh = jax.sharding.get_abstract_mesh()
    size = mesh.shape[MODEL_AXIS]
    offset = () if w.offset is None else (w.offset,)
    specs = (P(None, in_ax), P(out_ax, in_ax), P(out_ax, in_ax)) + ((P(out_ax, in_ax),) if offset else ())

    def local(x2, q, scale, *offset):
        y = q8_matmul(x2, q, scale, offset[0] if offset else None, n=n // size if out_ax else n, parts=parts)
        return jax.lax.psum(y, in_ax) if in_ax else y

    y = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(None, out_ax), check_vma=False)(
        x2, w.q, w.scale, *offset)
    return y.reshape(*lead, n).astype(x.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ShardedPerLayer(PerLayer):
    """PerLayer whose picks multiply int8 buffers per shard (ShardedQ8) inside the layer switch."""

    def pick(self, index: jax.Array) -> LayerPick:
        return ShardedLayerPick(index, self.layers)


@dataclasses.dataclass(frozen=True)
class ShardedLayerPick(LayerPick):
    def linears(self, x: jax.Array, picks: tuple) -> tuple[jax.Array, ...]:
        if not isinstance(self.layers[0], ShardedQ8):
            return super().linears(x, picks)
        flat = x.reshape(-1, x.shape[-1])
        branches = [functools.partial(_q8_linears, tuple(p.layers[j] for p in picks))
                    for j in range(len(self.layers))]
        outs = jax.lax.switch(self.index, branches, flat)
        return tuple(o.reshape(*x.shape[:-1], o.shape[-1]) for o in outs)


def _q8_linears(ws: tuple, x: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(q8_linear(x, w) for w in ws)


# ---- sparse-MoE experts: each device its slice of every expert ------------------------------------

def check_experts(cfg: ModelConfig, n: int, config: ShardingConfig) -> None:
    """Refuses a sparse MoE that n devices cannot split: each holds moe_intermediate_size / n of every expert."""
    if config.mlp is None:
        raise ValueError("a sparse MoE's experts split with the MLP hidden dimension: ShardingConfig.mlp must be "
                         "split under tensor parallelism")
    f = cfg.moe_intermediate_size
    if f % n:
        fits = [d for d in range(2, min(f, 16) + 1) if f % d == 0]
        raise ValueError(f"tensor_parallel {n} does not divide the experts' hidden size (moe_intermediate_size {f}): "
                         f"each device holds an equal slice of every expert; use a tensor_parallel dividing {f} "
                         f"({', '.join(map(str, fits)) or 'none up to 16'}) or 1 with data-parallel replicas")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ShardedExperts:
    """An expert weight on the mesh, split on its hidden dimension: `form` (an ExpertStack, or PackedExperts of one
    packing per device) with its arrays placed, `specs` their PartitionSpecs in tree order. Its pick runs the MoE
    mixture per device (expert_mixture_per_device)."""

    form: Any
    specs: tuple = dataclasses.field(default=(), metadata=dict(static=True))

    def pick(self, layer: jax.Array) -> "ShardedExpertPick":
        return ShardedExpertPick(layer, self)


@dataclasses.dataclass(frozen=True)
class ShardedExpertPick:
    """Layer `layer` of a ShardedExperts, inside the scanned layer body (models/moe.py calls per_device)."""

    layer: jax.Array
    stack: ShardedExperts

    @property
    def experts(self) -> int:
        form = self.stack.form
        return form.experts if isinstance(form, PackedExperts) else form.shape[1]

    def per_device(self, mix: Callable, x: jax.Array, chosen: jax.Array, weights: jax.Array,
                   picks: tuple) -> jax.Array:
        return expert_mixture_per_device(mix, x, chosen, weights, picks)


def expert_mixture_per_device(mix: Callable, x: jax.Array, chosen: jax.Array, weights: jax.Array,
                              picks: tuple) -> jax.Array:
    """mix(x, chosen, weights, picks) -> f32 [T, D] (models/moe.mixture) on each device with its slice of the
    experts, the devices' results summed: x [T, D], the chosen experts [T*k] and their weights [T, k] are whole on
    every device, which sorts the pairs alike; each device multiplies gate's and up's columns and down's inputs
    of its slice (its kernels on its own arrays, as the dense int8 matmuls'), and one all-reduce of [T, D] per
    layer adds the partial down products, as a dense MLP's row-parallel down projection."""
    mesh = jax.sharding.get_abstract_mesh()
    layer = picks[0].layer
    forms = tuple(p.stack.form if isinstance(p, ShardedExpertPick) else p for p in picks)
    specs = tuple(jax.tree.unflatten(jax.tree.structure(f), p.stack.specs) if isinstance(p, ShardedExpertPick)
                  else f for f, p in zip(forms, picks))  # FusedExperts: no arrays

    def local(x, chosen, weights, layer, *forms):
        own = tuple(_own(f).pick(layer) if isinstance(p, ShardedExpertPick) else f for f, p in zip(forms, picks))
        return jax.lax.psum(mix(x, chosen, weights, own), MODEL_AXIS)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), P(), *specs), out_specs=P(),
                         check_vma=False)(x, chosen, weights, layer, *forms)


def _own(form: Any) -> Any:
    """An expert form as each device holds it (of a PackedExperts, the device's one packing)."""
    return dataclasses.replace(form, shards=1) if isinstance(form, PackedExperts) else form


def device_bytes(tree: Any) -> dict[str, int]:
    """Bytes each device holds of the arrays in `tree` (its own shards; a replicated array counts
    whole on every device)."""
    out: dict[str, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            key = str(shard.device)
            out[key] = out.get(key, 0) + shard.data.nbytes
    return out
