"""Property cases of the TPU ragged paged attention kernel, shared by the interpret-mode tests (CPU) and
the device check (tests/kernels/tpu_attention_check.py): the kernel against the pure-JAX reference."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from slipstream.kernels.attention import k_page_from_cache, k_words_major, ragged_paged_attention_reference
from slipstream.kernels.tpu import layout
from slipstream.kernels.tpu.ragged_paged_attention import ragged_paged_attention
from tests.kernels.attention_cases import make_case


@dataclasses.dataclass(frozen=True)
class Spec:
    name: str
    q_lens: tuple[int, ...]
    cached: tuple[int, ...]
    kv_heads: int = 2
    group: int = 4
    head_dim: int = 128
    page_size: int = 16
    int8: bool = False
    dtype: str = "float32"          # KV cache dtype of float caches
    q_dtype: str = "float32"        # q, k_new, v_new (bf16: the kernel's bf16 matmuls)
    window: int | None = None
    soft_cap: float | None = None


# decodes, prefill chunks (fresh and after a prefix hit: the query starts mid-sequence), mixed;
# every case has padding tokens and a padding row past num_seqs
SPECS = (
    Spec("decode_gqa4_hd128", q_lens=(1, 1, 1), cached=(40, 5, 16)),
    Spec("prefill_gqa1_hd64", q_lens=(20, 7), cached=(0, 0), kv_heads=2, group=1, head_dim=64),
    Spec("prefix_hit_gqa8_bf16", q_lens=(19,), cached=(32,), kv_heads=1, group=8, dtype="bfloat16",
         q_dtype="bfloat16"),
    Spec("mixed_window_softcap", q_lens=(1, 1, 17, 3), cached=(37, 0, 9, 20), window=12, soft_cap=5.0),
    Spec("mixed_int8_hd64", q_lens=(1, 18, 1), cached=(33, 14, 2), head_dim=64, int8=True),
    Spec("mixed_int8_hd128", q_lens=(1, 9), cached=(21, 30), kv_heads=2, group=2, int8=True),
    # heads of 64: an even count is read in pairs (layout.pairs_heads; prefill_gqa1_hd64 too), an odd one padded
    Spec("mixed_hd64_3kv_bf16", q_lens=(1, 6), cached=(25, 3), kv_heads=3, group=3, head_dim=64,
         dtype="bfloat16", q_dtype="bfloat16"),
)


def build(spec: Spec, seed: int = 0):
    """(args of ragged_paged_attention with a merged cache, kwargs)."""
    rng = np.random.default_rng(seed)
    c = make_case(rng, q_lens=list(spec.q_lens), cached=list(spec.cached), kv_heads=spec.kv_heads,
                  group=spec.group, head_dim=spec.head_dim, page_size=spec.page_size, int8=spec.int8,
                  dtype=np.float32)
    std = {k: jnp.asarray(v) for k, v in c.cache.items()}
    if not spec.int8:
        std = {k: v.astype(spec.dtype) for k, v in std.items()}
    if k_words_major(std):
        std["k"] = k_page_from_cache(std["k"])
    qd = jnp.dtype(spec.q_dtype)
    args = (jnp.asarray(c.q, qd), jnp.asarray(c.k_new, qd), jnp.asarray(c.v_new, qd), layout.from_standard(std),
            jnp.int32(c.layer), jnp.asarray(c.kv_lens), jnp.asarray(c.page_indices), jnp.asarray(c.cu_q_lens),
            jnp.asarray(c.num_seqs))
    kwargs = dict(sm_scale=spec.head_dim ** -0.5, sliding_window=spec.window, soft_cap=spec.soft_cap)
    return args, kwargs, sum(spec.q_lens)


def tolerance(spec: Spec) -> float:
    """f32 everywhere: 1e-4; bf16 pages or int8 with f32 matmuls: 2e-3; bf16 matmuls (bf16 q): 2e-2."""
    if spec.q_dtype != "float32":
        return 2e-2
    return 1e-4 if spec.dtype == "float32" and not spec.int8 else 2e-3


def check(spec: Spec, *, interpret: bool, atol: float, **block_kw) -> tuple[float, float]:
    """Run kernel and reference; returns (max |out diff|, max |cache diff|); raises AssertionError on a
    mismatch beyond atol, padding tokens not zero, or a K/V write that differs."""
    args, kwargs, n_real = build(spec)
    kernel = jax.jit(lambda *a: ragged_paged_attention(*a, **kwargs, interpret=interpret, **block_kw))
    out, cache = kernel(*args)
    with jax.default_matmul_precision("float32"):   # the oracle's f32 matmuls exact on TPU too
        want, want_cache = jax.jit(lambda *a: ragged_paged_attention_reference(*a, **kwargs))(*args)
    out, want = np.asarray(out, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(out).all(), "non-finite outputs"
    assert not out[n_real:].any(), "padding tokens must get zeros"
    err = float(np.abs(out - want).max())
    np.testing.assert_allclose(out, want, atol=atol, rtol=atol)
    cache_err = 0.0
    for name in want_cache:
        a, b = np.asarray(cache[name], np.float32), np.asarray(want_cache[name], np.float32)
        cache_err = max(cache_err, float(np.abs(a - b).max()))
        np.testing.assert_array_equal(a, b, err_msg=f"cache[{name!r}] after the K/V write")
    return err, cache_err
