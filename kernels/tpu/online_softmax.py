"""The online-softmax step of the TPU attention kernel, in VMEM: one KV head's query rows against a block of
keys (scores, mask, running max and sum, P.V; int8 pages with their per-token scales). No DMA and no grid
logic here (ragged_paged_attention.py)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

# A finite "minus infinity": a masked score gives exp(MASK - m) == 0, never inf - inf.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
LANES = 128


def lanes(x, n: int):
    """x [r, 128], all lanes equal, as [r, n] (the patterns jax's own TPU flash attention lowers: a lane
    tile, a prefix slice)."""
    if n % LANES == 0:
        return x if n == LANES else jnp.tile(x, (1, n // LANES))
    if n < LANES:
        return x[:, :n]
    return x[:, :1]


def update(q, k, v, scales, m_ref, l_ref, acc_ref, h, *, q_pos0, group: int, first_key, sm_scale: float,
           sliding_window: int | None, soft_cap: float | None, cdt):
    """Online-softmax update of head h's state (m_ref, l_ref [KV, r, 128], acc_ref [KV, r, hd]) with keys
    k and values v [keys, hd] (k is v in the lanes form: rows [K | V], q's lanes past hd zero).
    q: [r, hd] in the matmul dtype cdt; scales: (k_scale, v_scale) [1, keys] of int8 pages, else None;
    q_pos0: the position of query row 0 (row i is token i // group); first_key: the position of key 0."""
    r = m_ref.shape[1]
    keys = k.shape[0]
    hd = acc_ref.shape[-1]
    # explicit, so a global jax_default_matmul_precision never asks Mosaic for fp32 passes on bf16 operands
    precision = jax.lax.Precision.HIGHEST if cdt == jnp.float32 else jax.lax.Precision.DEFAULT
    # int8 pages convert straight to the matmul dtype (through f32 measured the same on the v5e)
    s = jax.lax.dot_general(q, k.astype(cdt), (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * sm_scale              # [r, keys]
    if scales is not None:
        s = s * scales[0]
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    # row i is token i // G (f32 division: exact at these sizes)
    row_tok = (jax.lax.broadcasted_iota(jnp.int32, (r, keys), 0).astype(jnp.float32) * (1.0 / group)
               + 0.5 / group).astype(jnp.int32)
    q_pos = q_pos0 + row_tok                                                             # [r, keys]
    k_pos = first_key + jax.lax.broadcasted_iota(jnp.int32, (r, keys), 1)
    visible = k_pos <= q_pos
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    s = jnp.where(visible, s, MASK_VALUE)
    m_prev, l_prev = m_ref[h], l_ref[h]                                                  # [r, 128]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.exp(s - lanes(m_next, keys))
    l_ref[h] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    m_ref[h] = m_next
    if scales is not None:
        p = p * scales[1]
    pv = jnp.dot(p.astype(cdt), v.astype(cdt), precision=precision,
                 preferred_element_type=jnp.float32)                                     # [r, hd]
    acc_ref[h] = acc_ref[h] * lanes(alpha, hd) + pv


def finish(l_ref, acc_ref, h):
    """Head h's output rows [r, hd]: acc / l (0 where no key was visible)."""
    l = lanes(l_ref[h], acc_ref.shape[-1])
    return acc_ref[h] / jnp.where(l > 0, l, 1.0)
