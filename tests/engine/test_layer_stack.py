"""XLA:CPU's forms of the layer weights (quantization/layer_forms.py, chosen by engine/layer_stack.py): int8 stacks read at the layer index,
q/k/v and gate/up fused into one kernel call each, give the same logits as per-layer buffers picked
by a switch, and the compiled decode step has no switch and no copy of a weight."""
from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from slipstream.engine.device import layer_stack
from slipstream.engine.api import SlotState, StepBatch, StepSeq
from slipstream.engine.request import SamplingParams
from slipstream.engine.device.runner import EngineConfig, JaxEngine
from slipstream.kernels import native
from slipstream.quantization import layer_forms
from tests.conftest import TINY_ENGINE, build_tiny_hf

needs_native = pytest.mark.skipif(not native.load("q8_matmul", "q8_matmul"), reason="slipstream.kernels._q8_matmul is not built")


def _logits(engine: JaxEngine, prompt: list[int], decodes: int = 3) -> np.ndarray:
    """The logits of a prompt's prefill and of a few greedy decodes after it, stacked."""
    pages = list(range(1, 11))
    engine.insert(0, SlotState(prompt, [], SamplingParams(temperature=0.0)))
    out = [engine.model_logits(StepBatch([StepSeq(0, prompt, 0, pages, True)]))[0]]
    for i in range(decodes):
        token = int(np.argmax(out[-1]))
        out.append(engine.model_logits(StepBatch([StepSeq(0, [token], len(prompt) + i, pages, True)]))[0])
    engine.free(0)
    return np.stack(out)


@needs_native
@pytest.mark.parametrize("family,quantize", [("llama", "q8_0-a16"), ("qwen2", "q8_0"), ("gemma3", "q8_0-a16")])
def test_fused_stacks_equal_per_layer_buffers(tmp_path_factory, monkeypatch, family, quantize):
    from slipstream.models.loader import load_hf_dir

    cfg, model = load_hf_dir(build_tiny_hf(str(tmp_path_factory.mktemp(f"stack-{family}")), family))
    config = EngineConfig(**{**TINY_ENGINE, "quantize": quantize})
    # the same math in both forms: the stacks' gated MLP (silu formed in the down kernel) has its own test
    monkeypatch.setattr(layer_forms, "gated_native", lambda: False)
    jax.clear_caches()  # traces are shared across engines (models' per-layer jit): trace afresh
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, 256, 11)]
    fused = JaxEngine(cfg, model, config, precompile=False)
    attn = fused.params["blocks"]["attn"]
    assert isinstance(attn["wq"]["w"].get_value(), layer_stack.StackedQ8)
    assert attn["wq"]["w"].get_value().widths == (cfg.num_heads * cfg.head_dim,) + (cfg.num_kv_heads * cfg.head_dim,) * 2
    assert isinstance(attn["wv"]["w"].get_value(), layer_stack.FusedMember)
    assert isinstance(fused.params["blocks"]["mlp"]["w_up"]["w"].get_value(), layer_stack.FusedMember)
    want = _logits(fused, prompt)

    split = layer_stack.split_linears
    monkeypatch.setattr("slipstream.engine.device.runner.split_linears", lambda model, **kw: split(model, stack_int8=False))
    per_layer = JaxEngine(cfg, model, config, precompile=False)
    assert isinstance(per_layer.params["blocks"]["attn"]["wq"]["w"].get_value(), layer_stack.PerLayer)
    np.testing.assert_array_equal(_logits(per_layer, prompt), want)


@needs_native
@pytest.mark.parametrize("quantize", ["q8_0", "q8_0-a16"])
def test_gated_mlp_forms_silu_of_gate_times_up_in_the_down_kernel(tiny_model, monkeypatch, quantize):
    if not layer_forms.gated_native():
        pytest.skip("the gated path runs with the AVX-512 kernel only")
    cfg, model = tiny_model
    config = EngineConfig(**{**TINY_ENGINE, "quantize": quantize})
    prompt = [int(t) for t in np.random.default_rng(4).integers(3, 256, 13)]
    jax.clear_caches()
    gated = JaxEngine(cfg, model, config, precompile=False)
    got = _logits(gated, prompt)
    hlo = gated._model_exe[1].as_text()
    # the down projection takes gate/up's output whole: no [T, F] product of XLA's in between
    assert len(re.findall(r"gated = 1", hlo)) == 1
    monkeypatch.setattr(layer_forms, "gated_native", lambda: False)
    jax.clear_caches()
    unfused = JaxEngine(cfg, model, config, precompile=False)
    want = _logits(unfused, prompt)
    assert "gated = 1" not in unfused._model_exe[1].as_text()
    # the kernel's f32 silu is a few ulps from XLA's: an activation may round to the next int8 step
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * np.abs(want).max())
    assert (got.argmax(-1) == want.argmax(-1)).all()


@needs_native
def test_decode_step_has_no_switch_and_no_weight_copy(tiny_model):
    cfg, model = tiny_model
    engine = JaxEngine(cfg, model, EngineConfig(**{**TINY_ENGINE, "quantize": "q8_0"}), precompile=False)
    _logits(engine, [5, 6, 7], decodes=1)
    hlo = engine._model_exe[1].as_text()
    calls = re.findall(r'custom_call_target="slipstream_q8_matmul"', hlo)
    # q/k/v, o, gate/up and down in the layer loop's body (or in each layer, if XLA unrolls it); the LM head
    assert len(calls) in (4 + 1, 4 * cfg.num_layers + 1)
    assert " conditional(" not in hlo
    stacked = {f"u8[{cfg.num_layers},{a.shape[1]},{a.shape[2]}]" for a in
               (engine.params["blocks"]["attn"][n]["w"].get_value().weight.q for n in ("wq", "wo"))}
    copies = [line for line in hlo.splitlines() if " copy(" in line and any(s in line for s in stacked)]
    assert not copies
