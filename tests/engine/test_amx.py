"""Engine-level, on Intel CPUs with AMX: greedy output with the q8 matmul's int8 tile path equals that with its
AVX-512 VNNI path, token for token, with the tile unit on its default row window and on every call (the prefill
steps and the one-row decode steps alike); the q8_0-a16 layer stacks need no bf16 copies for it."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from slipstream.engine.device.runner import EngineConfig, JaxEngine
from slipstream.kernels import native
from slipstream.quantization.layer_forms import StackedQ8
from tests.conftest import TINY_ENGINE
from tests.engine.test_kernel_paths import greedy
from tests.kernels.isas import runnable_isas
from tests.kernels.q8_cases import AMX_MIN_ROWS


def q8_extension():
    if not native.load("q8_matmul", "q8_matmul"):
        pytest.skip("the native q8 matmul is not built (or SLIPSTREAM_KERNELS=reference)")
    import slipstream.kernels._q8_matmul as ext

    if "amx" not in runnable_isas(ext, ("amx",)):
        pytest.skip("this CPU has no AMX-INT8/BF16, or the OS did not grant the tile state (lscpu: amx_int8)")
    return ext


def test_greedy_with_amx_equals_vnni(tiny_model):
    ext = q8_extension()
    cfg, params = tiny_model
    rng = np.random.default_rng(11)
    prompts = [[int(t) for t in rng.integers(3, 256, n)] for n in (60, 64, 50, 45, 48)]  # <= 68: the 10 pages of 8 greedy() gives each
    assert sum(map(len, prompts)) >= AMX_MIN_ROWS  # the prefill step's matmuls have as many rows
    config = EngineConfig(**{**TINY_ENGINE, "max_slots": len(prompts), "num_pages": 96, "max_num_batched_tokens": 320,
                             "quantize": "q8_0-a16", "kv_cache_dtype": "bfloat16"})
    engine = JaxEngine(cfg, params, config, precompile=False)
    stacks = [leaf for leaf in jax.tree_util.tree_leaves(engine.params, is_leaf=lambda v: isinstance(v, StackedQ8))
              if isinstance(leaf, StackedQ8)]
    assert stacks and all(s.tiles is None for s in stacks)  # no bf16 copies unless SLIPSTREAM_AMX_BF16=1
    prev = ext.set_isa("avx512_vnni")
    try:
        with_vnni = greedy(engine, prompts)
        ext.set_isa("amx")
        assert greedy(engine, prompts) == with_vnni
        rows = ext.amx_rows(1, 1 << 30, 1, -1)  # every call on the tile unit
        try:
            assert greedy(engine, prompts) == with_vnni
        finally:
            ext.amx_rows(*rows)
    finally:
        ext.set_isa(prev)
