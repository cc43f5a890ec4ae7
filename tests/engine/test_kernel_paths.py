"""Engine-level: greedy output with the native CPU kernels equals the pure-JAX references'."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from engine.api import SlotState, StepBatch, StepSeq
from engine.request import SamplingParams
from engine.runner import EngineConfig, JaxEngine
from kernels import native
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


@pytest.mark.parametrize("quantize", ["none", "q8_0-a16"])
def test_greedy_with_native_kernels_equals_reference(tiny_model, monkeypatch, quantize):
    if not (native.load("ragged_paged_attention", "ragged_paged_attention")
            and native.load("q8_matmul", "q8_matmul") and native.load("f32_matmul", "f32_matmul")):
        pytest.skip("native kernels not built (or SLIPSTREAM_KERNELS=reference): nothing to compare")
    cfg, params = tiny_model
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(3, 256, n)] for n in (5, 9, 14)]
    config = EngineConfig(**{**TINY_ENGINE, "quantize": quantize})
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
