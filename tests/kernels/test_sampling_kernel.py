"""The native sampling kernel (kernels/cpu/csrc/sampling.cc) against a float64 numpy oracle of the
contract in kernels/sampling.py and against the JAX reference: greedy rows, temperature, top-k,
top-p, min-p and the draw, on every instruction-set path this CPU has (AVX-512, AVX2, portable),
over odd vocab sizes, ties, masked (-inf) tokens and NaN rows."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from slipstream.kernels import sampling as ks
from tests.kernels.isas import runnable_isas

NATIVE = ks.native_available()
if NATIVE:
    import slipstream.kernels._sampling as ext

ISAS = runnable_isas(ext, ("avx512", "avx2", "portable")) if NATIVE else []

needs_native = pytest.mark.skipif(not NATIVE, reason="slipstream.kernels._sampling is not built")
native = jax.jit(ks._native)
reference = jax.jit(ks.reference)


def settings(rng, b, v):
    return (rng.choice([0.0, 0.3, 1.0, 1.7], b).astype(np.float32),
            rng.choice([0, 1, 3, 50, 200, v, v + 5], b).astype(np.int32),
            rng.choice([1.0, 0.95, 0.5, 0.1], b).astype(np.float32),
            rng.choice([0.0, 0.0, 0.02, 0.3], b).astype(np.float32),
            rng.random(b).astype(np.float32))


def draws(fn, logits, t, k, p, mp, u):
    return np.asarray(fn(*(jnp.asarray(a) for a in (logits, t, k, p, mp, u))))


def kept_cdf(l, t, k, p, mp):
    """The contract in float64: the kept tokens' weights (0 elsewhere), over x as the kernel forms it."""
    x = (l - l.max()) / np.float32(t)  # float32, as both paths compute it
    e = np.exp(x.astype(np.float64))
    v = l.size
    cutoff = -np.inf
    if 0 < k < v:
        cutoff = np.sort(x)[::-1][k - 1]
    if p < 1:
        sel = x >= cutoff
        need = p * e[sel].sum()
        cum = 0.0
        for value in np.unique(x[sel])[::-1]:
            cum += e[x == value].sum()
            if cum >= need:
                cutoff = max(cutoff, value)
                break
    return np.where((x >= cutoff) & (e >= mp), e, 0.0)


def consistent(l, t, k, p, mp, u, token) -> bool:
    """token is what the contract draws for u, up to rounding of the running mass (1e-5)."""
    if t <= 0:
        return token == int(np.argmax(l))
    w = kept_cdf(l, t, k, p, mp)
    if not w[token] > 0:
        return False
    cum = np.cumsum(w)
    target = u * cum[-1]
    return cum[token] - w[token] <= target + 1e-5 * cum[-1] and cum[token] >= target - 1e-5 * cum[-1]


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("b,v,scale", [(9, 1, 1.0), (9, 7, 2.0), (16, 17, 3.0), (32, 300, 1.0),
                                       (16, 1000, 4.0), (8, 49152, 3.0), (4, 49152, 0.2)])
def test_draws_follow_the_contract_and_the_reference(b, v, scale, isa):
    rng = np.random.default_rng(v * 10 + b)
    logits = (rng.normal(size=(b, v)) * scale).astype(np.float32)
    args = (logits, *settings(rng, b, v))
    prev = ext.set_isa(isa)
    try:
        got = draws(native, *args)
    finally:
        ext.set_isa(prev)
    want = draws(reference, *args)
    for r in range(b):
        row = (logits[r], *(a[r] for a in args[1:]))
        assert consistent(*row, got[r]), (r, row[1:], got[r], want[r])
        # the two paths differ only where the running mass is within rounding of u's boundary
        assert got[r] == want[r] or consistent(*row, want[r]), (r, got[r], want[r])
    assert (got == want).mean() >= 0.9


@needs_native
def test_edges_ties_masks_and_nan():
    v = 40
    base = np.linspace(-3, 0, v).astype(np.float32)
    tied = base.copy()
    tied[[5, 30]] = 2.0                      # two tied maxima
    masked = np.full(v, -np.inf, np.float32)
    masked[[3, 11]] = [0.5, 0.25]            # a grammar left two tokens
    nan = base.copy()
    nan[7] = np.nan
    rows = np.stack([tied, tied, tied, tied, masked, masked, np.full(v, -np.inf, np.float32), nan, nan])
    t = np.array([0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0], np.float32)
    k = np.array([0, 1, 0, 0, 0, 0, 0, 0, 0], np.int32)
    p = np.array([1.0, 1.0, 1e-6, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], np.float32)
    mp = np.array([0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0], np.float32)
    for u0 in (0.0, 0.3, 0.7, 0.999999):
        u = np.full(9, u0, np.float32)
        got = draws(native, rows, t, k, p, mp, u)
        assert got[0] == 5                              # greedy: the first of the tied maxima
        for r in (1, 2, 3):                             # top-k 1, a tiny top-p, min-p 1: the tied pair
            assert got[r] == (5 if u0 < 0.5 else 30), (r, u0, got[r])
        assert got[4] in (3, 11) and got[5] == 3        # masked tokens are never drawn
        assert got[6] == 0 and got[7] == 0 and got[8] == 0  # no finite logit, or NaN: token 0
        np.testing.assert_array_equal(got[:6], draws(reference, rows, t, k, p, mp, u)[:6])


@needs_native
def test_draws_follow_the_probabilities():
    """Over many uniforms the drawn frequencies are the kept tokens' renormalised probabilities."""
    v, n = 1000, 4096
    rng = np.random.default_rng(3)
    row = (rng.normal(size=v) * 2).astype(np.float32)
    u = ((np.arange(n) + 0.5) / n).astype(np.float32)
    for t, k, p in [(1.0, 0, 1.0), (0.7, 20, 1.0), (1.3, 0, 0.8)]:
        got = draws(native, np.repeat(row[None], n, 0), np.full(n, t, np.float32), np.full(n, k, np.int32),
                    np.full(n, p, np.float32), np.zeros(n, np.float32), u)
        w = kept_cdf(row, t, k, p, 0.0)
        freq = np.bincount(got, minlength=v) / n
        assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(w))
        np.testing.assert_allclose(freq, w / w.sum(), atol=2.0 / n + 1e-3)


@needs_native
def test_the_compiled_program_calls_the_kernel_and_sorts_nothing():
    b, v = 4, 49152
    args = (jnp.zeros((b, v)), jnp.ones(b), jnp.full(b, 50, jnp.int32), jnp.full(b, 0.9), jnp.zeros(b),
            jnp.full(b, 0.5))
    hlo = jax.jit(ks.sample_tokens).lower(*args).compile().as_text()
    assert ks.TARGET in hlo and " sort(" not in hlo


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        ks.sample_tokens(jnp.zeros((2, 5)), jnp.ones(3), jnp.zeros(2, jnp.int32), jnp.ones(2), jnp.zeros(2),
                         jnp.zeros(2))


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("b,v,n", [(3, 1, 1), (5, 7, 7), (4, 33, 20), (8, 1000, 20), (4, 49152, 20), (2, 49152, 5)])
def test_top_logprobs_equal_the_reference(b, v, n, isa):
    rng = np.random.default_rng(v + n)
    logits = (rng.normal(size=(b, v)) * 3).astype(np.float32)
    logits[0, : min(v, 4)] = logits[0].max()  # ties at the top: lower ids first, as lax.top_k
    token = rng.integers(0, v, b).astype(np.int32)
    prev = ext.set_isa(isa)
    try:
        got = jax.jit(lambda x, t: ks.top_logprobs(x, t, n))(logits, token)
    finally:
        ext.set_isa(prev)
    want = jax.jit(lambda x, t: ks.top_logprobs_reference(x, t, n))(logits, token)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=1e-5, atol=1e-5)
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    np.testing.assert_allclose(np.asarray(got[0]), logits[np.arange(b), token] - lse, rtol=1e-5, atol=1e-5)


def test_top_logprobs_refuse_n_above_the_vocab():
    with pytest.raises(ValueError, match="n <= V"):
        ks.top_logprobs(jnp.zeros((2, 5)), jnp.zeros(2, jnp.int32), 6)


@pytest.mark.parametrize("wanted", [0, 1, 3])
def test_the_reference_with_one_alternative_wanted_gives_the_best_as_the_full_one_does(wanted, monkeypatch):
    """top_logprobs(wanted=...) off the native kernel (as on TPU/GPU): with at most one alternative read, a max
    instead of a top-k; the chosen token's log-probability and the alternatives read equal the full reference's
    (ties: the lower id)."""
    monkeypatch.setattr(ks, "native_available", lambda: False)
    rng = np.random.default_rng(wanted)
    logits = (rng.normal(size=(6, 300)) * 3).astype(np.float32)
    logits[0, 5:9] = logits[0].max() + 1  # a tie at the top
    token = rng.integers(0, 300, 6).astype(np.int32)
    got = jax.jit(lambda x, t, w: ks.top_logprobs(x, t, 20, wanted=w))(logits, token, np.int32(wanted))
    want = ks.top_logprobs_reference(jnp.asarray(logits), jnp.asarray(token), 20)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6, atol=1e-6)
    k = 20 if wanted > 1 else 1
    np.testing.assert_array_equal(np.asarray(got[1])[:, :k], np.asarray(want[1])[:, :k])
    np.testing.assert_allclose(np.asarray(got[2])[:, :k], np.asarray(want[2])[:, :k], rtol=1e-6, atol=1e-6)
    assert int(got[1][0, 0]) == 5
