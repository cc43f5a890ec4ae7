"""The native CPU ragged paged attention (kernels/cpu/csrc/ragged_paged_attention.cc) behind the signature and
semantics of kernels.attention.ragged_paged_attention_reference. The KV cache buffers are operands
aliased to results, so the kernel writes the new K/V in place: donate the cache (or carry it through a
scan) and XLA makes no copy of it. Call it only after kernels.native.load registered the targets."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_FLOAT_TARGET = "slipstream_ragged_paged_attention"
_INT8_TARGET = "slipstream_ragged_paged_attention_int8"


def ragged_paged_attention_cpu(q, k_new, v_new, kv_cache, layer, kv_lens, page_indices, cu_q_lens, num_seqs,
                               *, sm_scale: float, sliding_window: int | None = None):
    """Same as ragged_paged_attention_reference: returns (out [T, H, hd] in q's dtype, kv_cache)."""
    int8 = "k_scale" in kv_cache
    names = ("k", "v", "k_scale", "v_scale") if int8 else ("k", "v")
    bufs = [kv_cache[n] for n in names]
    if not int8 and bufs[0].dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"native ragged paged attention takes an f32, bf16 or int8 KV cache, not {bufs[0].dtype}")
    first_cache_operand = 3
    call = jax.ffi.ffi_call(
        _INT8_TARGET if int8 else _FLOAT_TARGET,
        [jax.ShapeDtypeStruct(q.shape, jnp.float32)] + [jax.ShapeDtypeStruct(b.shape, b.dtype) for b in bufs],
        input_output_aliases={first_cache_operand + i: 1 + i for i in range(len(bufs))})
    i32 = jnp.int32
    out, *new = call(q.astype(jnp.float32), k_new.astype(jnp.float32), v_new.astype(jnp.float32), *bufs,
                     jnp.asarray(layer, i32).reshape(()), kv_lens.astype(i32), page_indices.astype(i32),
                     cu_q_lens.astype(i32), jnp.asarray(num_seqs, i32).reshape((1,)),
                     sm_scale=np.float32(sm_scale), sliding_window=np.int32(sliding_window or 0))
    return out.astype(q.dtype), {**kv_cache, **dict(zip(names, new))}
