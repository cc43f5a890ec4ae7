"""The native CPU ragged paged attention equals the numpy oracle and the pure-JAX reference (output and the
written cache) on every instruction set this CPU has, and a scan over layers runs it with no cache copy."""
from __future__ import annotations

import platform
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from slipstream.kernels import attention, native
from slipstream.kernels.attention import k_page_from_cache
from tests.kernels.attention_cases import make_case, oracle
from tests.kernels.isas import runnable_isas

if native.reference_forced():
    pytest.skip("SLIPSTREAM_KERNELS=reference: the native kernel is off", allow_module_level=True)
if not native.load("ragged_paged_attention", "ragged_paged_attention"):
    pytest.fail("slipstream.kernels._ragged_paged_attention did not build or load: run `pip install -e .`", pytrace=False)

from slipstream.kernels import _ragged_paged_attention as ext  # noqa: E402  (built extension, loaded above)
from slipstream.kernels.attention_native import ragged_paged_attention_cpu  # noqa: E402

ISAS = runnable_isas(ext, ("portable", "avx2", "avx512", "avx512_vnni"))   # every path this CPU can run

# (q_lens, cached keys before the step, KV heads, group, head_dim, page_size)
SHAPES = {
    "decode-smollm": ([1] * 7, [383, 17, 0, 64, 15, 100, 1], 3, 3, 64, 16),
    "mixed-gqa8-hd128": ([1, 1, 37, 5], [100, 3, 0, 20], 1, 8, 128, 16),
    "prefill-512-mha": ([512], [0], 2, 1, 64, 16),
    "decode-mha-hd128": ([1, 2, 1], [70, 33, 16], 2, 1, 128, 16),
    "long-decode-split": ([1, 1], [1500, 900], 3, 3, 64, 16),
    "rows-6-3-15-ps6": ([2, 1, 5], [40, 7, 100], 2, 3, 64, 6),   # items of 1..8 rows, chunks of 1..6 keys
    "odd-hd24-ps5": ([3, 1, 9], [17, 40, 2], 2, 3, 24, 5),
    "odd-hd40-ps8": ([2, 7, 1], [33, 0, 8], 1, 3, 40, 8),
    "odd-hd72-ps16": ([4, 1], [29, 50], 2, 3, 72, 16),
}
KV_DTYPES = ("float32", "bfloat16", "int8")


def _args(case):
    cache = {k: jnp.asarray(v) for k, v in case.cache.items()}
    return (jnp.asarray(case.q), jnp.asarray(case.k_new), jnp.asarray(case.v_new), cache, jnp.int32(case.layer),
            jnp.asarray(case.kv_lens), jnp.asarray(case.page_indices), jnp.asarray(case.cu_q_lens),
            jnp.asarray(case.num_seqs))


@pytest.fixture(autouse=True)
def _best_isa_after():
    best = ext.isa()
    yield
    ext.set_isa(best)


def _tolerance(kv_dtype: str, isa: str, head_dim: int) -> float:
    """Output atol (rtol is at least 1e-4). The VNNI path (int8 KV, head_dim 64/128) feeds q and p to vpdpbusd as two int8 parts
    each, ~16 bits: score errors ~2e-5, far below the int8 K/V's own ~0.4% (measured worst over 60
    seeds: 1.1e-4 + 1.1e-4 |x|)."""
    if kv_dtype != "int8":
        return 3e-5
    return 3e-4 if isa == "avx512_vnni" and head_dim in (64, 128) else 1e-4


def _assert_matches(out, cache, want, want_cache, case, kv_dtype, what, tol):
    np.testing.assert_allclose(np.asarray(out), want, atol=tol, rtol=max(tol, 1e-4), err_msg=what)
    assert not np.asarray(out)[sum(case.q_lens):].any(), f"{what}: padding tokens must get zeros"
    for name, arr in want_cache.items():   # the new K/V (quantized for int8) and nothing else was written
        got = np.asarray(cache[name])
        assert got.dtype == arr.dtype, name
        np.testing.assert_array_equal(got.astype(np.float32), arr.astype(np.float32), err_msg=f"{what}: {name}")


@pytest.mark.parametrize("window", [None, 29])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_native_matches_oracle(shape, kv_dtype, window):
    q_lens, cached, kvh, group, hd, ps = SHAPES[shape]
    rng = np.random.default_rng(abs(hash((shape, kv_dtype, window))) % 2**32)
    case = make_case(rng, q_lens=q_lens, cached=cached, kv_heads=kvh, group=group, head_dim=hd, page_size=ps,
                     int8=kv_dtype == "int8", dtype=jnp.dtype(kv_dtype) if kv_dtype != "int8" else np.float32,
                     pad_seqs=2, pad_tokens=5)
    scale = hd ** -0.5
    want, want_cache = oracle(case, sm_scale=scale, sliding_window=window)
    fn = jax.jit(ragged_paged_attention_cpu, static_argnames=("sm_scale", "sliding_window"))
    for isa in ISAS:
        ext.set_isa(isa)
        out, cache = fn(*_args(case), sm_scale=scale, sliding_window=window)
        _assert_matches(out, cache, want, want_cache, case, kv_dtype, f"{shape} {kv_dtype} window={window} {isa}",
                        _tolerance(kv_dtype, isa, hd))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_consecutive_pages_match_oracle(kv_dtype):
    """Sequences whose pages are one run of ids (what the allocator hands out; the kernel then leaves the
    prefetching to the hardware), long enough that their KV ranges split across threads, beside a prefill chunk."""
    rng = np.random.default_rng(11)
    case = make_case(rng, q_lens=[1, 1, 1, 40], cached=[383, 700, 15, 90], kv_heads=3, group=3, head_dim=64,
                     page_size=16, int8=kv_dtype == "int8",
                     dtype=jnp.dtype(kv_dtype) if kv_dtype != "int8" else np.float32, consecutive=True)
    assert (np.diff(case.page_indices[0, :24]) == 1).all()
    want, want_cache = oracle(case, sm_scale=0.125)
    fn = jax.jit(ragged_paged_attention_cpu, static_argnames=("sm_scale",))
    for isa in ISAS:
        ext.set_isa(isa)
        out, cache = fn(*_args(case), sm_scale=0.125)
        _assert_matches(out, cache, want, want_cache, case, kv_dtype, f"consecutive {kv_dtype} {isa}",
                        _tolerance(kv_dtype, isa, 64))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_load_ahead_modes_read_the_same_keys(kv_dtype):
    """Touching a block's K/V before computing it, leaving runs of pages to the hardware prefetchers, or
    prefetching a block ahead (load_ahead 'all' / 'scattered' / 'prefetch'), changes only timing: outputs are
    bitwise equal and match the oracle, on pages in one run, scattered, and a table mixing both (a run broken
    mid-sequence)."""
    rng = np.random.default_rng(5)
    fn = jax.jit(ragged_paged_attention_cpu, static_argnames=("sm_scale",))
    try:
        for layout in ("consecutive", "scattered", "mixed"):
            case = make_case(rng, q_lens=[1, 1, 1, 9], cached=[383, 260, 31, 150], kv_heads=3, group=3,
                             head_dim=64, page_size=16, int8=kv_dtype == "int8",
                             dtype=jnp.dtype(kv_dtype) if kv_dtype != "int8" else np.float32,
                             consecutive=layout != "scattered")
            if layout == "mixed":  # sequence 0's second half moves to the pages of sequence 1's first half
                a, b = case.page_indices[0, 12:18].copy(), case.page_indices[1, :6].copy()
                case.page_indices[0, 12:18], case.page_indices[1, :6] = b, a
            want, want_cache = oracle(case, sm_scale=0.125)
            outs = {}
            for mode in ("all", "scattered", "prefetch"):
                assert ext.load_ahead(mode) == mode
                out, cache = fn(*_args(case), sm_scale=0.125)
                _assert_matches(out, cache, want, want_cache, case, kv_dtype, f"{layout} {kv_dtype} {mode}",
                                _tolerance(kv_dtype, ext.isa(), 64))
                outs[mode] = np.asarray(out)
            for mode in ("scattered", "prefetch"):
                np.testing.assert_array_equal(outs["all"], outs[mode], err_msg=f"{layout} {kv_dtype} {mode}")
    finally:
        ext.load_ahead("default")
    with pytest.raises(ValueError, match="load_ahead"):
        ext.load_ahead("sometimes")


@pytest.mark.parametrize("known, huge_pages, enabled", [(True, "0", False), (False, "1", True)])
def test_environment_sets_load_ahead_and_huge_pages(known, huge_pages, enabled):
    """SLIPSTREAM_KV_LOAD_AHEAD picks the mode the kernel starts with (a known mode other than this CPU's
    default, so the environment shows); a value it does not know keeps the default, and the start-up log says
    so. SLIPSTREAM_KV_HUGE_PAGES=0 keeps the K/V cache off 2 MiB pages (kernels.native passes it to the kernel at
    load); any other value leaves them on. One process for both settings."""
    import os
    import subprocess
    import sys

    default = ext.load_ahead("default")
    load_ahead = next(m for m in ("all", "prefetch") if m != default) if known else "sometimes"
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
            "from slipstream.kernels import native, _ragged_paged_attention as ext\n"
            "native.load('ragged_paged_attention', 'ragged_paged_attention')\n"
            "print('MODE', ext.load_ahead(), 'DEFAULT', ext.load_ahead('default'))\n"
            "print('ENABLED', ext.huge_pages()['enabled'])\n")
    env = {**os.environ, "SLIPSTREAM_KV_LOAD_AHEAD": load_ahead, "SLIPSTREAM_KV_HUGE_PAGES": huge_pages}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env).stdout
    got = out.split("MODE ")[1].split()[0]
    assert out.split("DEFAULT ")[1].split()[0] == default, out
    assert got == (load_ahead if known else default), out
    assert ("is not 'all', 'scattered' or 'prefetch'" in out) == (not known), out
    assert f"load_ahead={got}" in out, out
    assert f"ENABLED {enabled}" in out, out


def test_random_ragged_batches_match_reference():
    """Random ragged batches through the seam (kernels.attention) against the pure-JAX reference."""
    rng = np.random.default_rng(7)
    seam = jax.jit(attention.ragged_paged_attention, static_argnames=("sm_scale", "sliding_window"))
    ref = jax.jit(attention.ragged_paged_attention_reference, static_argnames=("sm_scale", "sliding_window"))
    for trial in range(6):
        n = int(rng.integers(1, 6))
        q_lens = [int(x) for x in rng.choice([1, 1, 2, 7, 16, 33], n)]
        cached = [int(x) for x in rng.integers(0, 200, n)]
        kvh, group = [(1, 1), (3, 3), (1, 8), (2, 3)][trial % 4]
        int8 = bool(trial % 2)
        window = [None, 5, 64][trial % 3]
        case = make_case(rng, q_lens=q_lens, cached=cached, kv_heads=kvh, group=group, head_dim=64, page_size=16,
                         int8=int8, pad_seqs=int(rng.integers(0, 3)), pad_tokens=int(rng.integers(0, 4)),
                         max_pages=20)
        got, got_cache = seam(*_args(case), sm_scale=0.125, sliding_window=window)
        want, want_cache = ref(*_args(case), sm_scale=0.125, sliding_window=window)
        what = f"trial {trial}: q_lens={q_lens} cached={cached} kv={kvh} g={group} int8={int8} window={window}"
        tol = _tolerance("int8" if int8 else "float32", ext.isa(), 64)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=max(tol, 1e-4), rtol=max(tol, 1e-4),
                                   err_msg=what)
        for name in want_cache:
            np.testing.assert_array_equal(np.asarray(got_cache[name]), np.asarray(want_cache[name]), err_msg=what)


def _scan_step(layers: int):
    def step(cache, q, k_new, v_new, kv_lens, page_indices, cu_q_lens, num_seqs):
        def layer(carry, i):
            out, carry = attention.ragged_paged_attention(q, k_new, v_new, carry, i, kv_lens, page_indices,
                                                          cu_q_lens, num_seqs, sm_scale=0.125)
            return carry, out

        return jax.lax.scan(layer, cache, jnp.arange(layers, dtype=jnp.int32))

    return jax.jit(step, donate_argnums=0)


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
@pytest.mark.parametrize("kv_heads", [1, 3])
def test_scan_over_layers_makes_no_cache_copy(kv_dtype, kv_heads):
    """The model's layer loop: cache as the scan carry, donated; the compiled step writes it in place."""
    layers, seqs, pages, ps, hd = 4, 3, 13, 16, 64
    shape = (layers, kv_heads, pages, ps, hd)
    if kv_dtype == "int8":
        cache = {"k": jnp.zeros(shape, jnp.int8), "v": jnp.zeros(shape, jnp.int8),
                 "k_scale": jnp.zeros(shape[:4]), "v_scale": jnp.zeros(shape[:4])}
    else:
        cache = {"k": jnp.zeros(shape), "v": jnp.zeros(shape)}
    tokens = seqs + 2
    args = (jnp.ones((tokens, 3 * kv_heads, hd)), jnp.ones((tokens, kv_heads, hd)), jnp.ones((tokens, kv_heads, hd)),
            jnp.asarray([5, 20, 1], jnp.int32), jnp.asarray([[1, 0], [2, 3], [4, 0]], jnp.int32),
            jnp.asarray([0, 1, 2, 3], jnp.int32), jnp.asarray([3], jnp.int32))
    hlo = _scan_step(layers).lower(cache, *args).compile().as_text()
    assert "slipstream_ragged_paged_attention" in hlo, "the native kernel is not in the compiled step"
    cache_dims = {",".join(map(str, buf.shape)) for buf in cache.values()}
    copies = [line.strip() for line in hlo.splitlines() if re.search(r"\bcopy(-start)?\(", line)
              and any(f"[{dims}]" in line.split("=", 1)[1].split("copy")[0] for dims in cache_dims)]
    assert not copies, "cache-sized copies in the compiled step:\n" + "\n".join(copies)

    # and the step still computes: the new K/V of layer 2 are where the page table says
    new_cache, _ = _scan_step(layers)(cache, *args)
    k = np.asarray(k_page_from_cache(new_cache["k"]))   # rows in order (f32 and int8 K pages are word-major)
    assert np.any(k[2, :, 1, 4] != 0) and np.any(k[2, :, 3, 3] != 0) and not np.any(k[:, :, 5:])


def _huge_kib_over(ptr: int, nbytes: int) -> tuple[int, int]:
    """(KiB of the buffer's 2 MiB-aligned interior, AnonHugePages KiB of the mappings that overlap it) from
    /proc/self/smaps. madvise splits a heap mapping at the advised range, but it may merge with a neighbour."""
    lo, hi = -(-ptr // (2 << 20)) * (2 << 20), (ptr + nbytes) // (2 << 20) * (2 << 20)
    total, overlaps = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                a, b = (int(x, 16) for x in head.split("-"))
                overlaps = a < hi and lo < b
            elif overlaps and head == "AnonHugePages:":
                total += int(line.split()[1])
    return (hi - lo) >> 10, total


def test_large_cache_ends_up_on_huge_pages():
    """The first call on a cache buffer of several MiB puts its 2 MiB-aligned part on transparent huge pages
    (MADV_COLLAPSE), and the step still computes what the oracle does."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read()
    except OSError:
        pytest.skip("no transparent huge pages on this kernel")
    release = tuple(int(x) for x in re.findall(r"\d+", platform.release())[:2])
    if "[never]" in thp or release < (6, 1) or not ext.huge_pages()["enabled"]:
        pytest.skip(f"THP {thp.strip()!r}, Linux {platform.release()} (MADV_COLLAPSE needs 6.1), "
                    f"kernel setting {ext.huge_pages()}")
    rng = np.random.default_rng(3)
    case = make_case(rng, q_lens=[1] * 6, cached=[900, 700, 899, 1000, 513, 640], kv_heads=3, group=3, head_dim=64,
                     page_size=16)   # k and v: 2 layers x 3 heads x 297 pages x 4 KiB = 7 MiB each
    assert case.cache["k"].nbytes > 6 << 20
    before = ext.huge_pages()["collapsed_bytes"]
    want, want_cache = oracle(case, sm_scale=0.125)
    out, cache = jax.jit(ragged_paged_attention_cpu, static_argnames=("sm_scale",))(*_args(case), sm_scale=0.125)
    _assert_matches(out, cache, want, want_cache, case, "float32", "huge pages", _tolerance("float32", ext.isa(), 64))
    assert ext.huge_pages()["collapsed_bytes"] >= before + (4 << 20), ext.huge_pages()
    for name in ("k", "v"):
        want_kib, huge_kib = _huge_kib_over(cache[name].unsafe_buffer_pointer(), cache[name].nbytes)
        assert want_kib >= 4096 and huge_kib >= want_kib, f"{name}: {huge_kib} of {want_kib} KiB on huge pages"
