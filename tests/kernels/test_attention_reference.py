"""The pure-JAX ragged paged attention equals a loop-per-sequence oracle on mixed batches."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.attention import ragged_paged_attention_reference
from tests.kernels.attention_cases import make_case, oracle


def _run(case, **kw):
    fn = jax.jit(ragged_paged_attention_reference, static_argnames=("sm_scale", "sliding_window"))
    cache = {k: jnp.asarray(v) for k, v in case.cache.items()}
    return fn(jnp.asarray(case.q), jnp.asarray(case.k_new), jnp.asarray(case.v_new), cache,
              jnp.int32(case.layer), jnp.asarray(case.kv_lens), jnp.asarray(case.page_indices),
              jnp.asarray(case.cu_q_lens), jnp.asarray(case.num_seqs), **kw)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("window", [None, 7])
def test_mixed_batch_matches_oracle(int8, window):
    rng = np.random.default_rng(0)
    # decodes first (one token each, long contexts), then prefill chunks: fresh, after cached pages
    case = make_case(rng, q_lens=[1, 1, 1, 9, 17], cached=[30, 5, 0, 0, 12], kv_heads=2, group=3,
                     head_dim=16, page_size=4, int8=int8)
    scale = 16 ** -0.5
    out, cache = _run(case, sm_scale=scale, sliding_window=window)
    want, want_cache = oracle(case, sm_scale=scale, sliding_window=window)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5 if not int8 else 1e-4, rtol=1e-4)
    assert not np.asarray(out)[sum(case.q_lens):].any(), "padding tokens must get zeros"
    for name, arr in want_cache.items():
        np.testing.assert_allclose(np.asarray(cache[name]), arr, atol=1e-6)
