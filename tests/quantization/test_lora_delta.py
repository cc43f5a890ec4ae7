"""The LoRA delta's two forms agree: dense over every slot, and grouped by slot in tiles (TilePlan),
for any mix of slots, base-model tokens and step sizes (whole blocks or not)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from slipstream.quantization.lora import LoraWeight, tile_plan


def _slot_mixes(rng, slots: int, t: int):
    yield rng.integers(0, slots + 1, t)                                   # shuffled, base tokens among them
    yield np.sort(rng.integers(0, slots + 1, t))[::-1].copy()              # runs, in reverse slot order
    yield np.full(t, slots)                                                # one adapter (a prefill chunk)
    yield np.zeros(t, np.int64)                                            # the base model only
    yield np.where(rng.random(t) < 0.5, 0, 1)                              # base and the first slot
    yield np.concatenate([np.arange(min(t, 8)) % slots + 1, np.full(t - min(t, 8), 2)])  # decodes + a chunk


@pytest.mark.parametrize("slots,rank,t,block", [(4, 16, 288, 32), (4, 16, 50, 16), (3, 4, 7, 4), (8, 2, 64, 8),
                                                 (2, 8, 33, 32), (4, 2, 5, 32)])
def test_tiles_equal_the_dense_delta(slots, rank, t, block):
    rng = np.random.default_rng(t)
    a = jnp.asarray(rng.standard_normal((24, slots * rank)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((slots * rank, 10)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((t, 24)), jnp.float32)
    for mix in _slot_mixes(rng, slots, t):
        token_slots = jnp.asarray(mix.astype(np.int32))
        dense = np.asarray(LoraWeight(None, a, b, token_slots, None, rank).delta(x))
        plan = tile_plan(token_slots, slots, block)
        tiled = np.asarray(LoraWeight(None, a, b, token_slots, plan, rank).delta(x))
        np.testing.assert_allclose(tiled, dense, rtol=1e-5, atol=1e-4, err_msg=str(mix))
        assert not tiled[mix == 0].any()                                   # base tokens get no delta
        # each token on an adapter is in exactly one kept tile row: the tiles cover it once
        kept = np.asarray(plan.rows)[np.asarray(plan.keep)]
        assert sorted(kept.tolist()) == sorted(np.flatnonzero(mix > 0).tolist())
