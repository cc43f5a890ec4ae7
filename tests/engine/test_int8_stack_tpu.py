"""The TPU's form of int8 layer weights (engine/layer_stack.index_int8_stacks: quantization/layer_forms'
StackedInt8, an Int8Weight stack multiplied at the traced layer index) in a tiny engine on this CPU.

- The model program lowered for TPU hands the Pallas int8 kernel every int8 stack and its scales whole and
  dynamic-slices none of them; the form it replaces (the stacks left to the layer scan) slices each one.
- Run with the TPU branch of quantization/int8.matmul (the kernel, in Pallas' TPU interpreter), greedy
  decoding gives the replaced form's logits bit for bit, and the tokens of the CPU engine's own path.
- On CPU the engine keeps its own forms (PerLayer for these weights)."""
from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest
from flax import nnx

from slipstream.engine.api import SlotState, StepBatch, StepSeq
from slipstream.engine.device import layer_stack, runner
from slipstream.engine.device.runner import EngineConfig, JaxEngine
from slipstream.engine.request import SamplingParams
from slipstream.models.config import ModelConfig
from slipstream.models import dummy
from slipstream.models.dummy import dummy_model
from slipstream.quantization import Int8Weight, int8, weights

# every linear (the LM head too) tiles the kernel: K a multiple of 256, N of 128
CFG = ModelConfig(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=512,
                  vocab_size=384)
CONFIG = EngineConfig(max_slots=2, page_size=8, max_seq_len=64, num_pages=16, max_num_batched_tokens=16,
                      quantize="int8")
LINEARS = 7  # q, k, v, o, gate, up, down

# these run the TPU's path on a CPU (the engine's forms forced, the kernel interpreted); on the chip the
# engine takes that path by itself (benchmarks/device_8b records its forms)
pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the TPU path as it runs on a CPU")


@pytest.fixture(scope="module")
def model():
    return dummy_model(CFG, quantize="int8")


def _engine(model, monkeypatch, form: str, cfg: ModelConfig = CFG, config: EngineConfig = CONFIG) -> JaxEngine:
    """form: "cpu" (the runner's choice on this machine), "index" (the TPU's: StackedInt8) or "slice" (the
    TPU's before: the int8 stacks left to the layer scan, which slices each layer out)."""
    jax.clear_caches()  # traces are shared across engines: trace each form afresh
    if form == "index":
        monkeypatch.setattr(runner, "split_linears", lambda m, **kw: layer_stack.index_int8_stacks(m))
    elif form == "slice":
        monkeypatch.setattr(runner, "split_linears", lambda m, **kw: None)
    return JaxEngine(cfg, model, config, precompile=False)


def _linears(engine: JaxEngine) -> list:
    return [var.get_value() for path, var in nnx.to_flat_state(engine.params["blocks"])
            if not isinstance(var.get_value(), jax.Array) or var.get_value().ndim == 3]


def _stack_types(engine: JaxEngine) -> set[str]:
    """The MLIR types of every int8 stack's arrays (q [L, K, N] i8, scale and offset [L, K/32, N] f32)."""
    types = set()
    for w in _linears(engine):
        w = w.weight if isinstance(w, layer_stack.StackedInt8) else w
        assert isinstance(w, Int8Weight) and w.q.ndim == 3
        for a in (w.q, w.scale, w.offset):
            types.add(f"tensor<{'x'.join(map(str, a.shape))}x{'i8' if a.dtype == np.int8 else 'f32'}>")
    return types


def _tpu_program(engine: JaxEngine) -> list[str]:
    return engine._model_jit.trace(*engine._model_args(2)).lower(lowering_platforms=("tpu",)).as_text().splitlines()


def _sliced(lines: list[str], types: set[str]) -> set[str]:
    return {t for line in lines if "stablehlo.dynamic_slice" in line for t in types if f": ({t}," in line}


def test_tpu_program_reads_int8_stacks_in_place(model, monkeypatch):
    engine = _engine(model, monkeypatch, "index")
    assert [type(w) for w in _linears(engine)] == [layer_stack.StackedInt8] * LINEARS
    types = _stack_types(engine)
    assert len(types) > 3  # q, scale and offset of several shapes
    lines = _tpu_program(engine)
    calls = [line for line in lines if "tpu_custom_call" in line]
    assert all(any(t in call for call in calls) for t in types)  # each stack goes to a kernel whole
    assert not _sliced(lines, types)
    # the check above can fail: the form this replaces slices every one of them out of its stack
    before = _engine(model, monkeypatch, "slice")
    assert [type(w) for w in _linears(before)] == [Int8Weight] * LINEARS
    assert _sliced(_tpu_program(before), types) == types


def _greedy(engine: JaxEngine, prompts: list[list[int]], decodes: int = 1) -> np.ndarray:
    """The logits of the prompts' prefill and of greedy decodes after it, both slots in each step (two
    programs; a decode runs the same program at every position, and each interpreted call takes a
    fraction of a second): [1 + decodes, slots, V]."""
    pages = [list(range(1, 8)), list(range(8, 15))]
    for s, p in enumerate(prompts):
        engine.insert(s, SlotState(p, [], SamplingParams(temperature=0.0)))
    out = [engine.model_logits(StepBatch([StepSeq(s, p, 0, pages[s], True) for s, p in enumerate(prompts)]))]
    for i in range(decodes):
        tokens = out[-1].argmax(-1)
        out.append(engine.model_logits(StepBatch([StepSeq(s, [int(tokens[s])], len(p) + i, pages[s], True)
                                                  for s, p in enumerate(prompts)])))
    for s in range(len(prompts)):
        engine.free(s)
    return np.stack(out)


def test_tpu_path_keeps_greedy_tokens(model, monkeypatch):
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(3, CFG.vocab_size, n)] for n in (9, 7)]  # one prefill of 16 tokens
    cpu = _engine(model, monkeypatch, "cpu")
    assert [type(w) for w in _linears(cpu)] == [layer_stack.PerLayer] * LINEARS  # CPU: its own form
    want = _greedy(cpu, prompts)
    # the TPU branch of int8.matmul in place of XLA's: the Pallas kernel, interpreted, on what TPU would give it
    monkeypatch.setattr(int8, "_xla_matmul", functools.partial(int8._tpu_matmul, interpret=True))
    in_place = _greedy(_engine(model, monkeypatch, "index"), prompts)
    sliced = _greedy(_engine(model, monkeypatch, "slice"), prompts)
    np.testing.assert_array_equal(in_place, sliced)
    np.testing.assert_array_equal(in_place.argmax(-1), want.argmax(-1))
    # the kernel's f32 sums in another order than XLA's dot
    np.testing.assert_allclose(in_place, want, rtol=0, atol=1e-5 * float(np.abs(want).max()))


def test_tpu_path_of_int4_weights_keeps_greedy_tokens(monkeypatch):
    """int4 stacks (4-bit values two a byte, bf16 scales: K a multiple of 512 for the kernel) go to the kernel
    whole in the TPU program, and the interpreted kernel gives the CPU path's logits."""
    monkeypatch.setattr(dummy, "int4_on_cpu", lambda: False)  # the TPU's form (CPU: the native kernel's rows)
    monkeypatch.setattr(weights, "int4_on_cpu", lambda: False)
    cfg = dataclasses.replace(CFG, hidden_size=512, intermediate_size=1024)
    config = dataclasses.replace(CONFIG, quantize="int4")
    model = dummy_model(cfg, quantize="int4")
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(3, cfg.vocab_size, n)] for n in (9, 7)]
    want = _greedy(_engine(model, monkeypatch, "cpu", cfg, config), prompts)
    engine = _engine(model, monkeypatch, "index", cfg, config)
    stacks = [w.weight for w in _linears(engine)]
    assert len(stacks) == LINEARS and all(w.bits == 4 and w.q.shape[1] * 2 == w.shape[1] for w in stacks)
    calls = [line for line in _tpu_program(engine) if "tpu_custom_call" in line]
    assert all(any(f"tensor<{'x'.join(map(str, w.q.shape))}xi8>" in call for call in calls) for w in stacks)
    monkeypatch.setattr(int8, "_xla_matmul", functools.partial(int8._tpu_matmul, interpret=True))
    got = _greedy(_engine(model, monkeypatch, "index", cfg, config), prompts)
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(np.abs(want).max()))


def test_matmul_roofline_takes_the_stacks(model, monkeypatch):
    """benchmarks' matmul-only program multiplies StackedInt8 weights at each layer's index: the products
    of the stacks as the scan-sliced form gives them."""
    from benchmarks.measure import matmul_roofline

    x = np.random.default_rng(5).standard_normal((2, CFG.hidden_size)).astype(np.float32)
    got = matmul_roofline(_engine(model, monkeypatch, "index").params, CFG)(x)
    want = matmul_roofline(_engine(model, monkeypatch, "slice").params, CFG)(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
