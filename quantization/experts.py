"""Expert weights of a sparse-MoE layer (models/moe.py): every layer's experts as one stack [L, E, in, out] that the
layer body multiplies at a traced layer and expert index, so a step reads only the experts its tokens chose and no
layer's experts are sliced out of the stack. Forms: float; per-output-channel int8 (every quantized mode's experts,
rounded on the device); and on CPU that int8 packed once for kernels/int8_channel_matmul.py (PackedExperts, gate and
up fused into one, built by quantization/layer_packing.pack_experts), whose rows every expert multiplies in one kernel
call (grouped_mlp). On TPU the int8 stacks are read where they lie by kernels/tpu/expert_matmul.py (kernel_gated,
kernel_matmul). Which rows go to which expert is models/moe.py's business."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from slipstream.kernels import int8_channel_matmul as icm

INT8_MAX = 127.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertStack:
    """w [L, E, in, out]: float, or int8 q with `scale` f32 [L, E, out] (one symmetric scale per output channel,
    w = q * scale: rounding costs a float model's accuracy no more than the dense layers' int8 does)."""

    w: jax.Array
    scale: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.w.shape)

    def pick(self, layer: jax.Array) -> "ExpertPick":
        return ExpertPick(layer, self)

    def astype(self, dtype) -> "ExpertStack":
        """Float experts in `dtype`; int8 ones as they are."""
        return self if self.scale is not None else ExpertStack(self.w.astype(dtype))


@dataclasses.dataclass(frozen=True)
class ExpertPick:
    """Layer `layer` of an ExpertStack, inside the scanned layer body."""

    layer: jax.Array
    stack: ExpertStack

    @property
    def experts(self) -> int:
        return self.stack.shape[1]

    def matmul(self, x: jax.Array, expert: jax.Array) -> jax.Array:
        """x [M, in] @ expert `expert`'s weight (traced index) -> f32 [M, out]; only that expert is read."""
        w = self.stack.w[self.layer, expert]                                         # [in, out]
        y = jnp.einsum("mk,kn->mn", x, w.astype(x.dtype), preferred_element_type=jnp.float32)
        return y if self.stack.scale is None else y * self.stack.scale[self.layer, expert]

    def ragged(self, x: jax.Array, group_sizes: jax.Array, row_expert: jax.Array) -> jax.Array:
        """Rows x [P, in] sorted by expert (group_sizes [E] rows each; row_expert [P] each row's) times their
        experts' weights -> f32 [P, out], one grouped matmul (jax.lax.ragged_dot: native on TPU)."""
        w = jax.lax.dynamic_index_in_dim(self.stack.w, self.layer, keepdims=False)   # [E, in, out]
        y = jax.lax.ragged_dot(x, w.astype(x.dtype), group_sizes, preferred_element_type=jnp.float32)
        if self.stack.scale is None:
            return y
        scale = jax.lax.dynamic_index_in_dim(self.stack.scale, self.layer, keepdims=False)  # [E, out]
        return y * scale[row_expert]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedExperts:
    """Int8 ExpertStacks packed for kernels/int8_channel_matmul.py (CPU): expert e of layer l is entry
    l * experts + e of the stacks packed [L*E, Np/16, Kp*16], scales and colsum [L*E, Np], which the kernel reads
    where it lies. One weight, or a fused group of weights one input feeds (a gated MLP's gate and up): member j's
    output columns start at offsets[j] (whole 16-column tiles) and number widths[j]. Activations in two int8 parts
    per row (~15 bits, as int8-channel-a16). shards > 1 (tensor parallelism, engine/device/sharding.py): the arrays
    hold `shards` such packings one after another along the leading axis, each of a slice of every expert's hidden
    dimension (widths: one slice's); each device multiplies only its own, a one-shard PackedExperts."""

    packed: jax.Array
    scales: jax.Array
    colsum: jax.Array
    experts: int = dataclasses.field(metadata=dict(static=True))
    widths: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    shards: int = dataclasses.field(default=1, metadata=dict(static=True))

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(int(s) for s in np.cumsum([0] + [icm.padded(1, w)[1] for w in self.widths[:-1]]))

    @property
    def n(self) -> int:
        return self.offsets[-1] + self.widths[-1]

    def pick(self, layer: jax.Array) -> "PackedPick":
        return PackedPick(layer, self)


@dataclasses.dataclass(frozen=True)
class PackedPick:
    """Layer `layer` of a PackedExperts: its rows sorted by expert multiplied in one kernel call (`grouped`)."""

    layer: jax.Array
    stack: PackedExperts

    @property
    def experts(self) -> int:
        return self.stack.experts

    def grouped(self, rows: jax.Array, sizes: jax.Array) -> tuple[jax.Array, ...]:
        """rows [P, in] sorted by expert (sizes [E] rows each) times their experts' weights -> each member's f32
        [P, width]."""
        s = self.stack
        if s.shards != 1:
            raise ValueError(f"experts packed in {s.shards} shards are multiplied one shard per device "
                             "(engine/device/sharding.py), not whole")
        y = icm.grouped_matmul(rows, s.packed, s.scales, s.colsum, sizes, self.layer * s.experts, n=s.n, parts=2)
        return tuple(y[:, o:o + w] for o, w in zip(s.offsets, s.widths))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FusedExperts:
    """Experts whose weights live in their group's PackedExperts as member `index` (no arrays)."""

    index: int = dataclasses.field(metadata=dict(static=True))

    def pick(self, layer: jax.Array) -> "FusedExperts":
        return self


def grouped_mlp(rows: jax.Array, sizes: jax.Array, picks: tuple, dtype) -> jax.Array | None:
    """down_e(silu(gate_e(x)) * up_e(x)) of rows [P, D] sorted by expert (sizes [E]) -> f32 [P, D], where the
    experts' form multiplies every expert's rows in one kernel call per projection (PackedPick: gate and up fused,
    or apart); None for other forms (models/moe.py then runs its own loops). dtype: the activations'."""
    gate, up, down = picks
    if not (isinstance(gate, PackedPick) and isinstance(down, PackedPick)
            and (isinstance(up, PackedPick) or (isinstance(up, FusedExperts) and len(gate.stack.widths) == 2))):
        return None
    g, u = gate.grouped(rows, sizes) if isinstance(up, FusedExperts) else (*gate.grouped(rows, sizes),
                                                                            *up.grouped(rows, sizes))
    return down.grouped((jax.nn.silu(g) * u).astype(dtype), sizes)[0]


def kernel_applies(picks: tuple, x: jax.Array) -> bool:
    """Whether a layer's gate, up and down run kernels/tpu/expert_matmul.py on TPU: int8 ExpertStacks (gate and up
    alike) whose shapes tile, activations bf16 or f32, and SLIPSTREAM_KERNELS not `reference`. Lowered for other
    platforms, models/moe.py's own loop runs instead (lax.platform_dependent)."""
    from slipstream.kernels import native
    from slipstream.kernels.tpu.expert_matmul import blocks

    gate, up, down = picks
    if not (all(isinstance(p, ExpertPick) and p.stack.scale is not None for p in picks)
            and gate.stack.shape == up.stack.shape and x.dtype in (jnp.bfloat16, jnp.float32)):
        return False
    if any(blocks(*p.stack.shape[2:]) is None for p in (gate, down)):
        return False
    if jax.default_backend() == "tpu":  # records (and logs) the path, for the start-up log and /metrics
        return native.use_pallas("expert_matmul")
    return not native.reference_forced()


def kernel_gated(gate: "ExpertPick", up: "ExpertPick", rows: jax.Array, block_expert: jax.Array, used: jax.Array,
                 block: int, *, interpret: bool = False) -> jax.Array:
    """silu(rows @ gate_e) * (rows @ up_e) for rows [C * block, in] in blocks of `block` rows, block i expert
    block_expert[i] (blocks >= used ignored) -> [C * block, out] in rows' dtype: one kernel call."""
    from slipstream.kernels.tpu.expert_matmul import expert_matmul

    return expert_matmul(rows, gate.stack.w, gate.stack.scale, gate.layer, block_expert, used, up.stack.w,
                         up.stack.scale, rows=block, interpret=interpret)


def kernel_matmul(pick: "ExpertPick", rows: jax.Array, block_expert: jax.Array, used: jax.Array, block: int, *,
                  interpret: bool = False) -> jax.Array:
    """rows [C * block, in] @ each block's expert -> f32 [C * block, out] (kernel_gated's layout)."""
    from slipstream.kernels.tpu.expert_matmul import expert_matmul

    return expert_matmul(rows, pick.stack.w, pick.stack.scale, pick.layer, block_expert, used, rows=block,
                         interpret=interpret)


def has_ragged(picks) -> bool:
    """Whether every one of these experts' forms multiplies sorted rows as one grouped product (`ragged`)."""
    return all(hasattr(p, "ragged") for p in picks)


# ---- rounding ----------------------------------------------------------------------------------

def _round(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w [..., in, out] -> (q int8 in -127..127, scale f32 [..., out]): symmetric per output channel."""
    wf = w.astype(jnp.float32)
    scale = jnp.max(jnp.abs(wf), axis=-2) / INT8_MAX
    inv = jnp.where(scale > 0, 1.0 / jnp.where(scale > 0, scale, 1.0), 0.0)
    q = jnp.clip(jnp.round(wf * inv[..., None, :]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale


@jax.jit
def _round_stack(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A float stack [L, E, in, out] rounded one layer at a time into int8 buffers allocated once (the float
    temporaries are one layer's)."""
    layers, experts, _, n = w.shape

    def body(layer, out):
        q, scale = _round(jax.lax.dynamic_index_in_dim(w, layer, keepdims=False))
        return (jax.lax.dynamic_update_index_in_dim(out[0], q, layer, 0),
                jax.lax.dynamic_update_index_in_dim(out[1], scale, layer, 0))

    init = (jnp.zeros(w.shape, jnp.int8), jnp.zeros((layers, experts, n), jnp.float32))
    return jax.lax.fori_loop(0, layers, body, init)


def quantize_experts(stack: ExpertStack) -> ExpertStack:
    """Float experts -> per-output-channel int8, on their device (int8 ones are kept)."""
    if stack.scale is not None:
        return stack
    if not jnp.issubdtype(stack.w.dtype, jnp.floating) or stack.w.ndim != 4:
        raise ValueError(f"expected float experts [L, E, in, out], got {stack.w.dtype} {tuple(stack.w.shape)}")
    return ExpertStack(*_round_stack(stack.w))


def round_numpy(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One expert's float weight [in, out] -> (q int8 [in, out], scale f32 [out]) on the host, as _round does (the
    loader rounds each checkpoint tensor as it reads it)."""
    wf = np.asarray(w, np.float32)
    scale = (np.abs(wf).max(axis=0) / np.float32(INT8_MAX)).astype(np.float32)
    inv = np.divide(np.float32(1), scale, out=np.zeros_like(scale), where=scale > 0)
    return np.clip(np.round(wf * inv), -INT8_MAX, INT8_MAX).astype(np.int8), scale


def pack_numpy(*stacks: ExpertStack, shards: int = 1, split: str = "out") -> PackedExperts:
    """Int8 ExpertStacks [L, E, K, N_j] sharing L, E and K (one weight, or a group one input feeds) -> one
    PackedExperts over their columns, one expert at a time on the host (load time, CPU). shards > 1: each stack cut
    in `shards` equal slices of its output columns (split "out": gate and up, so each slice holds its own gate and
    up columns) or of its inputs ("in": down, whose scales every slice keeps whole), each slice packed after the
    previous one (PackedExperts.shards)."""
    from slipstream.quantization.groupwise import host_empty

    qs, scales = [np.asarray(s.w) for s in stacks], [np.asarray(s.scale) for s in stacks]
    if len({q.shape[:3] for q in qs}) != 1:
        raise ValueError(f"experts packed as one group share L, E and K; got {[q.shape for q in qs]}")
    if split not in ("out", "in"):
        raise ValueError(f"split must be 'out' or 'in', got {split!r}")
    layers, experts, k = qs[0].shape[:3]
    cut = [q.shape[3] if split == "out" else k for q in qs]
    if any(c % shards for c in cut):
        raise ValueError(f"experts of {'widths' if split == 'out' else 'inputs'} {cut} do not split in {shards} shards")
    k_s = k if split == "out" else k // shards
    widths = tuple(int(q.shape[3]) // shards if split == "out" else int(q.shape[3]) for q in qs)
    tiles = np.cumsum([0] + [icm.padded(k_s, n)[1] // icm.TILE for n in widths])
    kp = icm.padded(k_s, 1)[0]
    entries = layers * experts
    # huge pages: the decode step streams the chosen experts
    packed = host_empty((shards * entries, int(tiles[-1]), kp * icm.TILE), np.int8)
    sc = np.zeros((shards * entries, int(tiles[-1]) * icm.TILE), np.float32)
    cs = np.zeros((shards * entries, int(tiles[-1]) * icm.TILE), np.int32)
    for s in range(shards):
        for j, (q, scale) in enumerate(zip(qs, scales)):
            if split == "out":
                q, scale = q[..., s * widths[j]:(s + 1) * widths[j]], scale[..., s * widths[j]:(s + 1) * widths[j]]
            else:
                q = q[:, :, s * k_s:(s + 1) * k_s]
            cols = slice(int(tiles[j]) * icm.TILE, int(tiles[j + 1]) * icm.TILE)
            for i in range(layers):
                for e in range(experts):
                    at = s * entries + i * experts + e
                    packed[at, tiles[j]:tiles[j + 1]], sc[at, cols], cs[at, cols] = icm.pack(q[i, e], scale[i, e])
    return PackedExperts(jax.device_put(packed), jax.device_put(sc), jax.device_put(cs), experts, widths, shards)
