"""The engine's attention layer: kernels.attention's ragged paged attention, run per device under
shard_map when the step is traced under a tensor-parallel mesh (kernels/ knows no mesh)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from slipstream.kernels.attention import ragged_paged_attention
from slipstream.kernels.tpu.layout import pairs_heads

# The mesh axis attention heads are split over under tensor parallelism (engine/sharding.py).
MODEL_AXIS = "model"


def cache_head_axis(kv_cache: dict) -> int:
    """The KV-head axis of the cache's arrays: 1 in the CPU layout; in the TPU layouts (kernels/tpu/layout.py)
    2 in the per-head forms, 3 in "tokens" (a row's lanes hold head after head: a split of the axis in n
    equal parts gives each device whole heads)."""
    if "kv" not in kv_cache:
        return 1
    return 3 if kv_cache["kv"].ndim == 4 else 2


def cache_kv_heads(kv_cache: dict, head_dim: int) -> int:
    """The KV heads the cache holds."""
    n = next(iter(kv_cache.values())).shape[cache_head_axis(kv_cache)]
    return n // (2 * head_dim) if "kv" in kv_cache and kv_cache["kv"].ndim == 4 else n


def paged_attention(q: jax.Array, k_new: jax.Array, v_new: jax.Array, kv_cache: dict, layer: jax.Array,
                    kv_lens: jax.Array, page_indices: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array,
                    **kwargs) -> tuple[jax.Array, dict]:
    """slipstream.kernels.attention.ragged_paged_attention; traced under an abstract mesh with a "model" axis of
    more than one device, it runs per device (see _per_shard)."""
    args = (q, k_new, v_new, kv_cache, layer, kv_lens, page_indices, cu_q_lens, num_seqs)
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and MODEL_AXIS in mesh.axis_names and mesh.shape[MODEL_AXIS] > 1:
        return _per_shard(mesh, *args, **kwargs)
    return ragged_paged_attention(*args, **kwargs)


def _per_shard(mesh, q, k_new, v_new, kv_cache, layer, kv_lens, page_indices, cu_q_lens, num_seqs, **kwargs):
    """Tensor parallel: the kernel (a custom call XLA cannot partition) runs under shard_map, each device
    on its own heads. When the cache's KV heads and the query heads divide by the mesh size, q, the
    new K/V and the cache split on the head axis: device d holds query heads [d*H/n, (d+1)*H/n) and
    cache heads [d*C/n, (d+1)*C/n), whole GQA groups. A cache with more heads than the step's K/V
    (C = n > KV: each KV head repeated for the n/KV devices whose queries read it) gets the new K/V
    repeated likewise. Otherwise every device runs all heads on a replicated cache. The step's index
    inputs are replicated."""
    n = mesh.shape[MODEL_AXIS]
    axis = cache_head_axis(kv_cache)
    heads, kvh = q.shape[1], k_new.shape[1]
    cache_heads = cache_kv_heads(kv_cache, k_new.shape[-1])
    if cache_heads != kvh:
        if cache_heads % kvh:
            raise ValueError(f"a cache of {cache_heads} KV heads cannot repeat {kvh} KV heads")
        k_new = jnp.repeat(k_new, cache_heads // kvh, axis=1)                     # [T,C,hd]
        v_new = jnp.repeat(v_new, cache_heads // kvh, axis=1)
    split_heads = heads % n == 0 and cache_heads % n == 0
    if split_heads and cache_head_axis(kv_cache) == 3 and pairs_heads(k_new.shape[-1], cache_heads):
        split_heads = (cache_heads // n) % 2 == 0   # token rows pair heads of 64: whole pairs per device
    split = P(None, MODEL_AXIS) if split_heads else P()
    cache_split = P(*([None] * axis), MODEL_AXIS) if split_heads else P()
    cache_specs = {name: cache_split for name in kv_cache}
    index = P()
    fn = jax.shard_map(functools.partial(ragged_paged_attention, **kwargs), mesh=mesh,
                       in_specs=(split, split, split, cache_specs, index, index, index, index, index),
                       out_specs=(split, cache_specs), check_vma=False)
    return fn(q, k_new, v_new, kv_cache, layer, kv_lens, page_indices, cu_q_lens, num_seqs)
