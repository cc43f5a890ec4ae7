"""f32 weights as packed stacks read by the native f32 matmul (engine/layer_stack.StackedF32): q/k/v
and gate/up fused, greedy tokens equal to the per-layer buffers XLA multiplies (the reference path)
on the tiny models and the default model, and a decode step with no switch and no weight copy."""
from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from slipstream.engine.device import layer_stack
from slipstream.engine.device.runner import EngineConfig, JaxEngine
from slipstream.kernels import f32_matmul, native
from tests.conftest import TINY_ENGINE, build_tiny_hf, first_layers
from tests.engine.test_kernel_paths import greedy

needs_native = pytest.mark.skipif(not f32_matmul.native_available(), reason="slipstream.kernels._f32_matmul is not built")


def _per_layer_engine(cfg, model, config, monkeypatch) -> JaxEngine:
    """The same engine with the f32 kernel reported unavailable (for the rest of the test): float
    weights stay PerLayer, XLA's dots multiply them; the other kernels keep their paths."""
    load = native.load
    monkeypatch.setattr(native, "load", lambda kernel, module: False if kernel == "f32_matmul" else load(kernel, module))
    jax.clear_caches()
    return JaxEngine(cfg, model, config, precompile=False)


# Llama's own layout is the default model's (test_default_model_f32_greedy_equals_reference, at a real
# checkpoint's shapes); these add Qwen2's q/k/v biases and Gemma 3's local/global layers and soft cap.
@needs_native
@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_f32_stacks_give_the_per_layer_tokens(tmp_path_factory, monkeypatch, family):
    from slipstream.models.loader import load_hf_dir

    cfg, model = load_hf_dir(build_tiny_hf(str(tmp_path_factory.mktemp(f"f32-{family}")), family))
    config = EngineConfig(**TINY_ENGINE)
    stacked = JaxEngine(cfg, model, config, precompile=False)
    attn = stacked.params["blocks"]["attn"]
    wq = attn["wq"]["w"].get_value()
    assert isinstance(wq, layer_stack.StackedF32)
    assert wq.widths == (cfg.num_heads * cfg.head_dim,) + (cfg.num_kv_heads * cfg.head_dim,) * 2
    assert isinstance(attn["wk"]["w"].get_value(), layer_stack.FusedMember)
    assert isinstance(stacked.params["blocks"]["mlp"]["w_gate"]["w"].get_value(), layer_stack.StackedF32)
    assert isinstance(stacked.params["blocks"]["mlp"]["w_down"]["w"].get_value(), layer_stack.StackedF32)
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, 256, n)] for n in (4, 11, 17)]
    want = greedy(stacked, prompts)

    per_layer = _per_layer_engine(cfg, model, config, monkeypatch)
    assert isinstance(per_layer.params["blocks"]["attn"]["wq"]["w"].get_value(), layer_stack.PerLayer)
    assert greedy(per_layer, prompts) == want


@needs_native
def test_decode_step_has_no_switch_and_no_weight_copy(tiny_model):
    cfg, model = tiny_model
    engine = JaxEngine(cfg, model, EngineConfig(**TINY_ENGINE), precompile=False)
    greedy(engine, [[5, 6, 7]], steps=2)
    hlo = engine._model_exe[1].as_text()
    calls = re.findall(r'custom_call_target="slipstream_f32_matmul"', hlo)
    # q/k/v, o, gate/up and down in the layer loop's body (or in each layer, if XLA unrolls it)
    assert len(calls) in (4, 4 * cfg.num_layers)
    assert " conditional(" not in hlo
    packed = engine.params["blocks"]["attn"]["wq"]["w"].get_value().packed
    stack = f"f32[{','.join(map(str, packed.shape))}]"
    assert not [line for line in hlo.splitlines() if " copy(" in line and stack in line]


@needs_native
def test_default_model_f32_greedy_equals_reference(default_model, monkeypatch):
    """The default model's first 2 layers (a real checkpoint's shapes and weights; the per-layer
    reference picks each layer's buffers in the layer loop, a program that grows with the layer
    count) stacked against the same engine with per-layer buffers."""
    cfg, model = first_layers(*default_model, 2)
    config = EngineConfig(max_slots=4, page_size=16, max_seq_len=256, num_pages=64, max_num_batched_tokens=64,
                          quantize="none")
    stacked = JaxEngine(cfg, model, config, precompile=False)
    rng = np.random.default_rng(11)
    # one prefill of all three: max_num_batched_tokens (64) tokens
    prompts = [[int(t) for t in rng.integers(3, cfg.vocab_size, n)] for n in (7, 23, 34)]
    assert isinstance(stacked.params["blocks"]["mlp"]["w_gate"]["w"].get_value(), layer_stack.StackedF32)
    assert isinstance(stacked.params["blocks"]["attn"]["wq"]["w"].get_value(), layer_stack.StackedF32)
    want = greedy(stacked, prompts, steps=16)
    per_layer = _per_layer_engine(cfg, model, config, monkeypatch)
    assert greedy(per_layer, prompts, steps=16) == want
