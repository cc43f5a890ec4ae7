"""The batched sampler jitted once and run on one padded [B, V] batch shape, for the sampling tests."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from slipstream.engine.device.sampling import SamplingArrays, sample

SAMPLE = jax.jit(sample)
# Every run() pads to one shape, so the tests compile `sample` once (plus test_sampling.py's smoke test).
B, V = 256, 300


def run(logits, params, seeds=None, steps=None, counts=None, prompt_mask=None):
    """Sample rows [0, len(params)) of a [B, V] batch; extra rows and columns are padding."""
    n = len(params)
    padded = np.full((B, V), -np.inf, np.float32)
    logits = np.asarray(logits, np.float32)
    padded[:logits.shape[0], :logits.shape[1]] = logits
    arrays = SamplingArrays.from_params(params, [0] * n if seeds is None else seeds,
                                        [0] * n if steps is None else steps, B)
    full_counts = np.zeros((B, V), np.int32)
    full_mask = np.zeros((B, V), bool)
    if counts is not None:
        full_counts[:n, :counts.shape[1]] = counts
    if prompt_mask is not None:
        full_mask[:n, :prompt_mask.shape[1]] = prompt_mask
    out = SAMPLE(jnp.asarray(padded), arrays, jnp.asarray(full_counts), jnp.asarray(full_mask))
    return jax.tree.map(lambda x: np.asarray(x)[:n], out)
