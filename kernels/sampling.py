"""Token sampling from logits [B, V]: one token per row, greedy or drawn (temperature, top-k, top-p,
min-p, then an inverse-CDF draw with a given uniform per row), and the model's logprobs.

Two entry points, `sample_tokens` and `top_logprobs`. On CPU they run the native kernel
(kernels/cpu/csrc/sampling.cc) through XLA's FFI; elsewhere, or with SLIPSTREAM_KERNELS=reference,
`reference` and `top_logprobs_reference` do the same in JAX. sample_tokens' contract:
per row, with x = (logits - max) / T and e = exp(x):
  - temperature <= 0: the first index of the row max (a row holding NaN: 0);
  - kept tokens: x >= the k-th largest x (top_k <= 0 or >= V: off), then x >= the largest value
    whose tokens (x >= it) hold top_p of the top-k mass (1: off), then e >= min_p (0: off); cut-offs
    are values, so tokens tied with the last kept one are kept too;
  - the draw: the first kept token, in token order, whose running mass exceeds u * the kept mass.
The two paths sum in different orders (the reference in f32, the kernel in double), so a draw whose
u lies within rounding of a token boundary can pick the neighbouring token. No full-vocab sort:
XLA:CPU sorts [32, 49152] in ~300 ms, so the reference's cut-offs come from a small top-k or a
bisection. Imports none of our packages but kernels.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from slipstream.kernels import native

TARGET = "slipstream_sample_tokens"
LOGPROBS_TARGET = "slipstream_top_logprobs"
# Candidates searched for top-k/top-p cut-offs before falling back to a full-vocab bisection;
# covers top_k <= 128 and top_p reached within the 128 best tokens (the usual case).
_CANDIDATES = 128
# Block size of the two-level inverse-CDF draw: one cumsum over blocks, one inside a block.
_BLOCK = 256
_KEY_BITS = 32


def native_available() -> bool:
    """True when the native CPU kernel is built and registered (logged once either way)."""
    return native.load("sampling", "sampling")


def _ordered_key(x: jax.Array) -> jax.Array:
    """uint32 keys that sort like the floats x (the radix-sort trick), for exact bisection."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def _key_to_float(key: jax.Array) -> jax.Array:
    """Inverse of _ordered_key."""
    bits = jnp.where((key >> 31) == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _bisect(keys: jax.Array, lo: jax.Array, enough: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """Largest uint32 t per row with enough(keys >= t) true, given enough() holds at `lo`."""
    hi = jnp.max(keys, axis=-1) + jnp.uint32(1)  # enough() is false above the max (no token)

    def body(_: int, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = enough(keys >= mid[:, None])
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, _KEY_BITS, body, (lo, hi))
    return lo


def _keep_mask(x: jax.Array, x_max: jax.Array, e: jax.Array, top_k: jax.Array, top_p: jax.Array,
               min_p: jax.Array) -> jax.Array:
    """bool[B, V]: tokens that survive top-k, then top-p (renormalised over top-k), then min-p.

    x are temperature-scaled logits, x_max their row max [B, 1], e = exp(x - x_max). Cut-offs
    are values, so tokens tied with the last kept one are kept too.
    """
    batch, vocab = x.shape
    k = jnp.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)
    # A batch with no top-k/top-p row skips the search altogether.
    cutoff = jax.lax.cond(
        jnp.any((k < vocab) | (top_p < 1)),
        lambda: _top_k_top_p_cutoff(x, x_max, e, k, top_p),
        lambda: jnp.full(batch, -jnp.inf, x.dtype))
    # min-p: prob >= min_p * max_prob  <=>  exp(x - max) >= min_p.
    return (x >= cutoff[:, None]) & (e >= min_p[:, None])


def _top_k_top_p_cutoff(x: jax.Array, x_max: jax.Array, e: jax.Array, k: jax.Array,
                        top_p: jax.Array) -> jax.Array:
    """f32[B]: the smallest kept value (-inf: keep all); k is top_k with "off" mapped to V."""
    batch, vocab = x.shape
    keys = _ordered_key(x)                                                   # [B, V]
    cand = min(_CANDIDATES, vocab)
    # Read vals only through gathers: an `exp(vals - vals[:, :1])` made XLA:CPU rewrite this
    # top_k into a full-vocab sort (~300 ms). The smoke test checks the compiled program.
    vals, _ = jax.lax.top_k(x, cand)                                         # [B, C] best first

    fast_k = _ordered_key(jnp.take_along_axis(vals, jnp.minimum(k, cand)[:, None] - 1, 1)[:, 0])
    t_k = jax.lax.cond(
        jnp.any((k > cand) & (k < vocab)),
        lambda: _bisect(keys, jnp.zeros(batch, jnp.uint32),
                        lambda m: jnp.sum(m, -1, dtype=jnp.int32) >= k),
        lambda: jnp.zeros(batch, jnp.uint32))
    t_k = jnp.where(k >= vocab, jnp.uint32(0), jnp.where(k <= cand, fast_k, t_k))  # [B]

    mass_k = jnp.sum(jnp.where(keys >= t_k[:, None], e, 0.0), -1)            # [B]
    need = top_p * mass_k
    cum = jnp.cumsum(jnp.where(_ordered_key(vals) >= t_k[:, None],
                               jnp.exp(vals - x_max), 0.0), -1)             # [B, C]
    reached = cum >= need[:, None]
    fast_p = _ordered_key(jnp.take_along_axis(vals, jnp.argmax(reached, -1)[:, None], 1)[:, 0])
    p_on = top_p < 1
    slow = p_on & ~jnp.any(reached, -1)  # the nucleus reaches past the candidates
    t_p = jax.lax.cond(
        jnp.any(slow),
        lambda: _bisect(keys, t_k, lambda m: jnp.sum(jnp.where(m, e, 0.0), -1) >= need),
        lambda: t_k)
    t_p = jnp.where(p_on, jnp.where(slow, t_p, jnp.maximum(fast_p, t_k)), t_k)
    return jnp.where(t_p == 0, -jnp.inf, _key_to_float(t_p))


_ARGMAX_BLOCK = 1024


def _argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis of [B, V] (the first index of the max), in two levels: each
    block's max, then the first block holding the row max, then the first index of it inside
    that block. On XLA:CPU jnp.argmax's variadic reduce, or a max broadcast back over [B, V] and a
    min of the matching indices, each took ~3 ms at 32 x 49152; this takes ~0.8 ms."""
    batch, vocab = x.shape
    nblocks = -(-vocab // _ARGMAX_BLOCK)
    xb = jnp.pad(x, ((0, 0), (0, nblocks * _ARGMAX_BLOCK - vocab)), constant_values=-jnp.inf)
    xb = xb.reshape(batch, nblocks, _ARGMAX_BLOCK)
    block_max = jnp.max(xb, -1)                                              # [B, NB]
    row_max = jnp.max(block_max, -1, keepdims=True)                          # [B, 1]
    blk = jnp.argmax(block_max == row_max, -1)                               # first block with it
    inner = jnp.take_along_axis(xb, blk[:, None, None], 1)[:, 0]             # [B, BLOCK]
    return (blk * _ARGMAX_BLOCK + jnp.argmax(inner == row_max, -1)).astype(jnp.int32)


def _first(cond: jax.Array, positive: jax.Array) -> jax.Array:
    """Index of the first True in cond, or of the last positive entry if rounding left none."""
    n = cond.shape[-1]
    last = n - 1 - jnp.argmax(positive[:, ::-1], -1)
    return jnp.where(jnp.any(cond, -1), jnp.argmax(cond, -1), last)


def _draw(w: jax.Array, u: jax.Array) -> jax.Array:
    """Inverse-CDF draw of one index per row from unnormalised weights w[B, V] >= 0.

    Two levels (blocks, then inside one block) because a cumsum over the whole vocab costs as
    much as the rest of sampling on XLA:CPU. Zero-weight entries are never picked.
    """
    batch, vocab = w.shape
    nblocks = -(-vocab // _BLOCK)
    w = jnp.pad(w, ((0, 0), (0, nblocks * _BLOCK - vocab))).reshape(batch, nblocks, _BLOCK)
    block_mass = jnp.sum(w, -1)                                              # [B, NB]
    block_cum = jnp.cumsum(block_mass, -1)
    target = u * block_cum[:, -1]                                            # [B], in [0, total)
    blk = _first((block_cum > target[:, None]) & (block_mass > 0), block_mass > 0)
    rest = target - jnp.take_along_axis(block_cum - block_mass, blk[:, None], 1)[:, 0]
    inner = jnp.take_along_axis(w, blk[:, None, None], 1)[:, 0]              # [B, BLOCK]
    idx = _first((jnp.cumsum(inner, -1) > rest[:, None]) & (inner > 0), inner > 0)
    return (blk * _BLOCK + idx).astype(jnp.int32)


def reference(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
              min_p: jax.Array, u: jax.Array) -> jax.Array:
    """i32[B]: sample_tokens in JAX."""
    greedy_token = _argmax(logits)
    greedy = temperature <= 0

    def draw() -> jax.Array:
        # shifted before the scaling, so the row max is exactly 0 however small the temperature:
        # with x = logits / T and x_max = max(x) computed apart, XLA's rounding of the two could
        # differ by an ulp of ~1e16 (T = 3e-16), and exp(x - x_max) lost even the max (token 511
        # of a 300-token vocab)
        x = (logits - jnp.max(logits, -1, keepdims=True)) / jnp.where(greedy, 1.0, temperature)[:, None]
        x_max = jnp.zeros((logits.shape[0], 1), x.dtype)
        e = jnp.exp(x)
        keep = _keep_mask(x, x_max, e, top_k, top_p, min_p)
        return _draw(jnp.where(keep, e, 0.0), u)

    drawn = jax.lax.cond(jnp.all(greedy), lambda: greedy_token, draw)
    return jnp.where(greedy, greedy_token, drawn)


def _native(logits, temperature, top_k, top_p, min_p, u) -> jax.Array:
    out = jax.ShapeDtypeStruct((logits.shape[0],), jnp.int32)
    return jax.ffi.ffi_call(TARGET, out)(logits, temperature, top_k, top_p, min_p, u)


def sample_tokens(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  min_p: jax.Array, u: jax.Array) -> jax.Array:
    """logits [B, V] (cast to f32) and per-row settings [B] (u in [0, 1)) -> one token per row, i32[B]."""
    if logits.ndim != 2 or any(a.shape != logits.shape[:1] for a in (temperature, top_k, top_p, min_p, u)):
        raise ValueError(f"sample_tokens: logits must be [B, V] and each setting [B], got {logits.shape} and "
                         f"{[a.shape for a in (temperature, top_k, top_p, min_p, u)]}")
    args = (logits.astype(jnp.float32), temperature.astype(jnp.float32), top_k.astype(jnp.int32),
            top_p.astype(jnp.float32), min_p.astype(jnp.float32), u.astype(jnp.float32))
    if native_available():
        return jax.lax.platform_dependent(*args, cpu=_native, default=reference)
    return reference(*args)


def top_logprobs_reference(logits: jax.Array, token: jax.Array, n: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """top_logprobs in JAX."""
    chosen, log_z = _chosen_logprob(logits, token)
    top_vals, top_ids = jax.lax.top_k(logits, n)                             # [B, n]
    return chosen, top_ids.astype(jnp.int32), top_vals - log_z[:, None]


def _chosen_logprob(logits: jax.Array, token: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's `token` log-probability [B], and the rows' log-partition [B]."""
    log_z = jax.nn.logsumexp(logits, -1)
    return jnp.take_along_axis(logits, token[:, None], 1)[:, 0] - log_z, log_z


def best_logprob_reference(logits: jax.Array, token: jax.Array, n: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """top_logprobs_reference with only the best of the n filled in (the others id 0 and -inf): a max, not a top-k
    (on a TPU, 1.2 against 3.9 ms for [256, 128256])."""
    chosen, log_z = _chosen_logprob(logits, token)
    ids = jnp.zeros((logits.shape[0], n), jnp.int32).at[:, 0].set(jnp.argmax(logits, -1).astype(jnp.int32))
    lps = jnp.full((logits.shape[0], n), -jnp.inf, jnp.float32).at[:, 0].set(jnp.max(logits, -1) - log_z)
    return chosen, ids, lps


def top_logprobs(logits: jax.Array, token: jax.Array, n: int, *, wanted: jax.Array | None = None,
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The model's log-probabilities from logits [B, V] (cast to f32): of each row's `token` [B], and
    the n <= V largest with their ids ([B, n], best first, ties lower id first, as lax.top_k). wanted i32[]: how
    many of the n the caller reads; at most one lets the JAX reference find the best alone (the native kernel
    costs the same either way)."""
    if logits.ndim != 2 or token.shape != logits.shape[:1] or not 0 < n <= logits.shape[1]:
        raise ValueError(f"top_logprobs: logits must be [B, V], token [B] and 0 < n <= V, got {logits.shape}, "
                         f"{token.shape} and n={n}")
    args = (logits.astype(jnp.float32), token.astype(jnp.int32))
    b = logits.shape[0]

    def call(x: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        out = (jax.ShapeDtypeStruct((b,), jnp.float32), jax.ShapeDtypeStruct((b, n), jnp.int32),
               jax.ShapeDtypeStruct((b, n), jnp.float32))
        return tuple(jax.ffi.ffi_call(LOGPROBS_TARGET, out)(x, t))

    ref = lambda x, t: top_logprobs_reference(x, t, n)  # noqa: E731
    if wanted is not None:
        ref = lambda x, t: jax.lax.cond(wanted > 1, lambda: top_logprobs_reference(x, t, n),  # noqa: E731
                                        lambda: best_logprob_reference(x, t, n))
    if native_available():
        return jax.lax.platform_dependent(*args, cpu=call, default=ref)
    return ref(*args)
