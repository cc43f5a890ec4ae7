"""What every ragged paged attention path shares, the reference and the Pallas TPU kernel alike: where
each flat token of a step sits, and how int8 K/V are rounded."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def token_layout(kv_lens: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array, num_tokens: int
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per flat token: its sequence row, its position, and whether it is a real token (not padding)."""
    n = jnp.reshape(num_seqs, ())
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    valid = t < cu_q_lens[n]
    # a row's tokens end at cu_q_lens[s + 1]: the row of t is the number of rows ending at or before it
    seq = jnp.sum((t[:, None] >= cu_q_lens[None, 1:]) & (jnp.arange(cu_q_lens.shape[0] - 1) < n)[None],
                  axis=1, dtype=jnp.int32)
    seq = jnp.where(valid, seq, 0)
    pos = kv_lens[seq] - (cu_q_lens[seq + 1] - t)
    return seq, jnp.where(valid, pos, 0), valid


def quantize_kv(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-(token, head) symmetric int8 over head_dim: (int8 [..., KV, hd], f32 scale [..., KV]).
    The native kernel rounds the same way (round half to even, clip to +-127)."""
    x32 = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x32), axis=-1) / 127.0
    safe = jnp.where(scale > 0, scale, 1.0)
    return jnp.clip(jnp.round(x32 / safe[..., None]), -127, 127).astype(jnp.int8), scale
