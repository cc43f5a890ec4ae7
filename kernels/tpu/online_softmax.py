"""The online-softmax step both TPU attention kernels run in VMEM: one KV head's query rows against a block
of keys (scores, mask, running max/sum, P.V), with int8 pages either widened for the float MXU or fed to the
int8 MXU with the float operand split in two int8 terms. No DMA and no grid logic here."""
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


def split_rows(r: int) -> int:
    """Rows of split_int8's buffer for r rows: x1 at [0, r), x2 at [r16, r16 + r) (r16: r rounded up to 16,
    so x2 starts on a sublane tile and the int8 operand fills int8's 32-row tile)."""
    return 2 * (-(-r // 16) * 16)


def split_int8(x, buf):
    """x [r, n] f32 as two int8 terms per row, x ~= a * x1 + b * x2 (about 15 bits of each row's range; bf16
    keeps 8): (x8 [split_rows(r), n] int8, a, b [r, 128]). buf: a f32 VMEM scratch [split_rows(r), n]; the
    terms are stored in its rows (aligned stores, where a sublane concatenation of r-row pieces may not
    lower), its other rows are left as they are (their products are never read)."""
    r, n = x.shape
    amax = jnp.max(jnp.abs(x), axis=1, keepdims=True)                                   # [r, 1]
    a = jnp.zeros((r, LANES), jnp.float32) + jnp.where(amax > 0, amax, 1.0) * (1.0 / 127)
    b = a * (1.0 / 254)
    x1 = jnp.floor(x / lanes(a, n) + 0.5)                                                # [-127, 127]
    x2 = jnp.clip(jnp.floor((x - x1 * lanes(a, n)) / lanes(b, n) + 0.5), -127, 127)
    half = buf.shape[0] // 2
    buf[0:r, :] = x1
    buf[half:half + r, :] = x2
    return buf[...].astype(jnp.int32).astype(jnp.int8), a, b


def dot_int8(xs, w, contract: int):
    """(x8, a, b) of split_int8 times int8 w on the int8 MXU (int32 sums): f32 [r, w's other dim]."""
    x8, a, b = xs
    r, r16 = a.shape[0], x8.shape[0] // 2
    acc = jax.lax.dot_general(x8, w, (((1,), (contract,)), ((), ())),
                              preferred_element_type=jnp.int32).astype(jnp.float32)      # [2 * r16, m]
    m = acc.shape[1]
    return acc[:r] * lanes(a, m) + acc[r16:r16 + r] * lanes(b, m)


def prepare_q(q, *, mxu8: bool, cdt, buf=None):
    """A head's query rows [r, hd] (f32) as the score matmul takes them (buf: split_int8's, for mxu8)."""
    return split_int8(q, buf) if mxu8 else q.astype(cdt)


def update(q, k, v, scales, m_ref, l_ref, acc_ref, h, *, q_pos0, group: int, first_key, sm_scale: float,
           sliding_window: int | None, soft_cap: float | None, cdt, mxu8: bool, p_buf=None):
    """Online-softmax update of head h's state (m_ref, l_ref [KV, r, 128], acc_ref [KV, r, hd]) with keys
    k and values v [keys, hd] (k is v in the lanes form: rows [K | V], q's lanes past hd zero).
    q: prepare_q's form; scales: (k_scale, v_scale) [1, keys] of int8 pages, else None; q_pos0: the
    position of query row 0 (row i is token i // group); first_key: the position of key 0; p_buf:
    split_int8's buffer [split_rows(r), keys] for mxu8."""
    r = m_ref.shape[1]
    keys = k.shape[0]
    hd = acc_ref.shape[-1]
    precision = jax.lax.Precision.HIGHEST if cdt == jnp.float32 else jax.lax.Precision.DEFAULT
    if mxu8:
        s = dot_int8(q, k, 1) * sm_scale                                                 # [r, keys]
    else:
        # int8 pages convert straight to the matmul dtype (via f32 measured the same on the v5e)
        s = jax.lax.dot_general(q, k.astype(cdt), (((1,), (1,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32) * sm_scale          # [r, keys]
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
    if mxu8:
        pv = dot_int8(split_int8(p, p_buf), v, 0)                                               # [r, hd]
    else:
        pv = jnp.dot(p.astype(cdt), v.astype(cdt), precision=precision,
                     preferred_element_type=jnp.float32)                                 # [r, hd]
    acc_ref[h] = acc_ref[h] * lanes(alpha, hd) + pv


def finish(l_ref, acc_ref, h):
    """Head h's output rows [r, hd]: acc / l (0 where no key was visible)."""
    l = lanes(l_ref[h], acc_ref.shape[-1])
    return acc_ref[h] / jnp.where(l > 0, l, 1.0)
