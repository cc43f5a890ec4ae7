"""Engine-level: greedy output with the native CPU kernels equals the pure-JAX references'."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from slipstream.engine.api import SlotState, StepBatch, StepSeq
from slipstream.engine.request import SamplingParams
from slipstream.engine.device.runner import EngineConfig, JaxEngine
from slipstream.kernels import native
from tests.conftest import TINY_ENGINE

STEPS = 12


def greedy(engine: JaxEngine, prompts: list[list[int]], steps: int = STEPS) -> list[list[int]]:
    """All prompts prefilled in one mixed step, then decoded together for `steps` steps (also used by
    tests/engine/test_tensor_parallel.py)."""
    pages = [list(range(1 + 10 * i, 11 + 10 * i)) for i in range(len(prompts))]
    for slot, prompt in enumerate(prompts):
        engine.insert(slot, SlotState(prompt, [], SamplingParams(temperature=0.0)))
    out = [[] for _ in prompts]
    rows = [StepSeq(s, p, 0, pages[s], True) for s, p in enumerate(prompts)]
    for _ in range(steps):
        for s, sampled in enumerate(engine.step(StepBatch(rows))):
            out[s].append(sampled.token_id)
        rows = [StepSeq(s, [out[s][-1]], len(prompts[s]) + len(out[s]) - 1, pages[s], True)
                for s in range(len(prompts))]
    for slot in range(len(prompts)):
        engine.free(slot)
    return out


# each weight mode with the K/V dtype its `auto` means on CPU (pinned: the reference engine below would
# resolve `auto` without the native attention kernel)
@pytest.mark.parametrize("quantize,kv", [("none", "float32"), ("q8_0-a16", "bfloat16")])
def test_greedy_with_native_kernels_equals_reference(tiny_model, monkeypatch, quantize, kv):
    if not (native.load("ragged_paged_attention", "ragged_paged_attention")
            and native.load("q8_matmul", "q8_matmul") and native.load("f32_matmul", "f32_matmul")):
        pytest.skip("native kernels not built (or SLIPSTREAM_KERNELS=reference): nothing to compare")
    cfg, params = tiny_model
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(3, 256, n)] for n in (5, 9, 14)]
    config = EngineConfig(**{**TINY_ENGINE, "quantize": quantize, "kv_cache_dtype": kv})
    engine = JaxEngine(cfg, params, config, precompile=False)
    # f32 weights go to the native f32 matmul (engine/layer_stack.StackedF32), int8 ones to q8_matmul
    wq = engine.params["blocks"]["attn"]["wq"]["w"].get_value()
    assert type(wq).__name__ == ("StackedF32" if quantize == "none" else "StackedQ8")
    with_native = greedy(engine, prompts)
    assert native.kernel_paths()["f32_matmul"] == "native"
    # the references: every kernel seam asks native.load while tracing; dropping JAX's trace caches
    # makes the second engine trace afresh (models.llama's per-layer matmuls are one shared jit)
    monkeypatch.setattr(native, "load", lambda kernel, module: False)
    jax.clear_caches()
    with_reference = greedy(JaxEngine(cfg, params, config, precompile=False), prompts)
    assert with_native == with_reference


def test_auto_kv_cache_is_bf16_on_cpu_with_int8_weights_and_the_native_attention(tiny_model, monkeypatch):
    """The CPU default stores K/V in bf16 (half f32's bytes per token, so twice the pages in the same
    --kv-cache-memory); f32 weights, an explicit dtype, or the pure-JAX attention keep their own."""
    if jax.default_backend() != "cpu" or not (native.load("ragged_paged_attention", "ragged_paged_attention")
                                              and native.load("q8_matmul", "q8_matmul")):
        pytest.skip("the bf16 default needs the native CPU kernels")
    cfg, params = tiny_model
    base = {k: v for k, v in TINY_ENGINE.items() if k != "quantize"}
    assert EngineConfig(**base).kv_dtype() == jnp.bfloat16                     # quantize auto: q8_0-a16
    assert EngineConfig(**base, quantize="q8_0").kv_dtype() == jnp.bfloat16
    assert EngineConfig(**base, quantize="none").kv_dtype() == jnp.float32
    assert EngineConfig(**base, kv_cache_dtype="float32").kv_dtype() == jnp.float32
    assert EngineConfig(**base, kv_cache_dtype="int8").kv_dtype() == jnp.int8
    default = JaxEngine(cfg, params, EngineConfig(**{**base, "num_pages": None, "kv_cache_memory": 8 << 20}),
                        precompile=False)
    f32 = JaxEngine(cfg, params, EngineConfig(**{**base, "num_pages": None, "kv_cache_memory": 8 << 20,
                                                 "kv_cache_dtype": "float32"}), precompile=False)
    assert default.kv_dtype == jnp.bfloat16 and f32.kv_dtype == jnp.float32
    assert f32.bytes_per_token == 2 * default.bytes_per_token
    assert default.num_pages - 1 >= 2 * (f32.num_pages - 1) - 1                  # twice the pages, same budget
    monkeypatch.setattr(native, "load", lambda kernel, module: kernel != "ragged_paged_attention")
    assert EngineConfig(**base).kv_dtype() == jnp.float32                       # XLA:CPU's reference: f32
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, bfloat16, int8"):
        EngineConfig(**base, kv_cache_dtype="fp8")
