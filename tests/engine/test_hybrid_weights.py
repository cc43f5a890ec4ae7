"""The hybrid CPU weights (EngineConfig.prompt_weights): a step's prompt rows multiply the layers' int8-channel-w16
form, its generated tokens' rows the q8_0-a16 one. A row's role is its token's (a position before its request's
prompt length), so a request's output does not depend on the step it lands in: batched or alone, preempted and
recomputed, prefix-cache hit or miss, with speculative drafts or without."""
from __future__ import annotations

import random

import jax
import numpy as np
import pytest

from slipstream.engine.api import SlotState, StepBatch, StepSeq
from slipstream.engine.device import runner
from slipstream.engine.request import Request, SamplingParams
from slipstream.kernels import int8_channel_matmul as icm
from slipstream.kernels import native
from slipstream.kernels.q8_matmul import gated_input, q8_matmul
from slipstream.quantization import layer_forms
from tests.conftest import TINY_ENGINE
from tests.engine.test_scheduler_real import _SmallBudget
from tests.engine.test_speculative_engine import SPEC, _prompts, _run, prefix_sharing_requests

needs_native = pytest.mark.skipif(
    not (native.load("q8_matmul", "q8_matmul") and icm.native_available()),
    reason="the hybrid weights run the native q8_matmul and int8_channel_matmul kernels")

HYBRID = {**TINY_ENGINE, "quantize": "q8_0-a16", "prompt_weights": "w16", "kv_cache_dtype": "float32",
          "max_slots": 16, "max_num_batched_tokens": 64}


@pytest.fixture(scope="module")
def hybrid_engine(tiny_model):
    cfg, params = tiny_model
    return runner.JaxEngine(cfg, params, runner.EngineConfig(**HYBRID), precompile=False)


@needs_native
def test_a_hybrid_stack_multiplies_each_row_range_on_its_form(hybrid_engine):
    blocks = hybrid_engine.params["blocks"]
    qkv = blocks["attn"]["wq"]["w"].get_value()
    gate_up, down = (blocks["mlp"][name]["w"].get_value() for name in ("w_gate", "w_down"))
    assert all(isinstance(s, layer_forms.StackedHybrid) for s in (qkv, gate_up, down))
    layer = np.int32(1)
    x = np.random.default_rng(0).standard_normal((9, blocks["attn"]["wq"]["w"].get_value().default.weight.logical[0]),
                                                 np.float32)

    def forms(stack, x, gated=False):  # each form over every row
        w, p = stack.default.weight, stack.prompt
        q8 = q8_matmul(x, w.q, w.scale, w.offset, n=w.logical[1], parts=2, layer=layer, gated=gated)
        w16 = icm.int8_channel_matmul(gated_input(x) if gated else x, p.packed, p.scales, p.colsum,
                                      n=w.logical[1], parts=2, layer=layer, residual=p.residual)
        return np.asarray(q8), np.asarray(w16)

    q8, w16 = forms(qkv, x)
    assert not np.array_equal(q8, w16)
    h = np.asarray(gate_up.bound(np.int32(4)).matmul(x, layer))
    g_q8, g_w16 = forms(down, h, gated=True)
    for split in (0, 4, 9):
        y = np.asarray(jax.jit(lambda s, x: qkv.bound(s).matmul(x, layer))(np.int32(split), x))
        np.testing.assert_array_equal(y[:split], q8[:split])
        np.testing.assert_array_equal(y[split:], w16[split:])
        g = np.asarray(down.bound(np.int32(split)).gated_down(h, layer))
        np.testing.assert_array_equal(g[:split], g_q8[:split])
        np.testing.assert_array_equal(g[split:], g_w16[split:])
    # unbound (no step's split): every row on q8_0-a16
    np.testing.assert_array_equal(np.asarray(qkv.matmul(x, layer)), q8)


def _kv_and_logits(engine, prompt: list[int]) -> tuple[dict, list[np.ndarray]]:
    """The K/V of pages 1 (the prompt's, a whole page) and 2 (where only the decode's token is written) after a
    prompt's prefill and one greedy decode, and both steps' logits."""
    pages = [1, 2]
    engine.insert(0, SlotState(prompt, [], SamplingParams(temperature=0.0)))
    try:
        logits = [engine.model_logits(StepBatch([StepSeq(0, prompt, 0, pages, True)]))[0]]
        token = int(np.argmax(logits[0]))
        logits.append(engine.model_logits(StepBatch([StepSeq(0, [token], len(prompt), pages, True)]))[0])
    finally:
        engine.free(0)
    return {name: np.asarray(a)[:, :, 1:3].copy() for name, a in engine.cache.items()}, logits


@needs_native
def test_prompt_rows_take_w16_and_the_generated_row_q8(hybrid_engine, monkeypatch):
    prompt = [int(t) for t in np.random.default_rng(1).integers(3, 256, TINY_ENGINE["page_size"])]
    kv, logits = _kv_and_logits(hybrid_engine, prompt)
    monkeypatch.setattr(runner.JaxEngine, "prompt_rows_from", lambda self, batch: 0)        # every row on w16
    kv_w16, logits_w16 = _kv_and_logits(hybrid_engine, prompt)
    monkeypatch.setattr(runner.JaxEngine, "prompt_rows_from", lambda self, batch: 1 << 20)  # every row on q8_0-a16
    kv_q8, logits_q8 = _kv_and_logits(hybrid_engine, prompt)
    for name in kv:  # [L, KV, page, ...]
        np.testing.assert_array_equal(kv[name][:, :, 0], kv_w16[name][:, :, 0])
        assert not np.array_equal(kv[name][:, :, 0], kv_q8[name][:, :, 0])
        # the generated token's K/V in layer 0 (which reads no earlier position): q8_0-a16's
        np.testing.assert_array_equal(kv[name][0, :, 1], kv_q8[name][0, :, 1])
        assert not np.array_equal(kv[name][0, :, 1], kv_w16[name][0, :, 1])
    np.testing.assert_array_equal(logits[0], logits_w16[0])
    assert not np.array_equal(logits[0], logits_q8[0])
    assert not np.array_equal(logits[1], logits_w16[1]) and not np.array_equal(logits[1], logits_q8[1])


@needs_native
def test_a_step_puts_prompt_chunks_last_and_never_across_the_prompt_end(hybrid_engine):
    engine = hybrid_engine
    engine.insert(0, SlotState([5, 6, 7, 8], [], SamplingParams(temperature=0.0)))
    engine.insert(1, SlotState([9, 10], [], SamplingParams(temperature=0.0)))
    try:
        with pytest.raises(ValueError, match="crosses its prompt's end"):
            engine.model_logits(StepBatch([StepSeq(0, [5, 6, 7, 8, 11], 0, [1], True)]))
        with pytest.raises(ValueError, match="prompt chunks last"):
            engine.model_logits(StepBatch([StepSeq(0, [5, 6, 7, 8], 0, [1], True),
                                           StepSeq(1, [12], 2, [2], True)]))
    finally:
        engine.free(0)
        engine.free(1)


def _alone(engine, requests) -> list:
    """Each request's greedy tokens and their logprobs when it runs by itself, with no prefix cache."""
    return [_out(_run(engine, [r], None, enable_prefix_cache=False)[0][0]) for r in requests]


def _out(res):
    assert res.error is None, res.error
    return res.token_ids, [lp.logprob for lp in res.logprobs]


@needs_native
def test_greedy_output_is_the_requests_own_batched_preempted_cached_and_speculated(hybrid_engine):
    """Token for token, and without speculation logprob for logprob exactly (every row's arithmetic is its role's
    whatever else the step holds: a row on the other form moves a logprob by ~1e-5 here). Verification rows attend
    as a chunk, which sums ~1e-6 apart from a one-row decode in every weight mode: tokens equal, logprobs close."""
    rnd = random.Random(11)
    prompts = [r.prompt_ids for r in prefix_sharing_requests(rnd)[:16]] + _prompts(rnd, 6)
    requests = [Request(p, SamplingParams(temperature=0.0, max_tokens=rnd.randint(4, 16), ignore_eos=True,
                                          logprobs=0)) for p in prompts]
    alone = _alone(hybrid_engine, requests)
    small = _SmallBudget(hybrid_engine, num_pages=14)  # 13 usable pages of 8 tokens: preemption
    for spec in (None, SPEC):
        results, stats = _run(small, requests, spec, max_num_batched_tokens=24)
        for req, res, (tokens, logprobs) in zip(requests, results, alone):
            got_tokens, got_logprobs = _out(res)
            assert got_tokens == tokens, (spec, req)
            if spec is None:
                assert got_logprobs == logprobs, req
            else:
                np.testing.assert_allclose(got_logprobs, logprobs, rtol=0, atol=1e-4)
        assert stats.preemptions > 0 and stats.prefix_hits > 0
        assert spec is None or stats.spec_accepted_tokens > 0


def test_the_setting_picks_the_hybrid_only_with_q8_0_a16_on_cpu(monkeypatch):
    config = runner.EngineConfig
    assert not config(prompt_weights="same").prompt_w16("cpu")
    assert not config(quantize="q8_0-a16").prompt_w16("cpu")       # an explicit q8_0-a16 keeps one form
    assert not config().prompt_w16("tpu")
    with pytest.raises(ValueError, match="needs q8_0-a16 weights on CPU"):
        config(prompt_weights="w16").prompt_w16("tpu")
    with pytest.raises(ValueError, match="prompt_weights must be one of"):
        config(prompt_weights="bf16")
    with pytest.raises(ValueError, match="goes with quantize q8_0-a16"):
        config(quantize="int8-channel-w16", prompt_weights="w16")
    with pytest.raises(ValueError, match="goes with quantize q8_0-a16"):
        config(prompt_weights="w16", tensor_parallel=2)
    if native.load("q8_matmul", "q8_matmul") and icm.native_available():
        assert config(quantize="q8_0-a16", prompt_weights="w16").prompt_w16("cpu")
        import importlib

        amx = importlib.import_module("slipstream.kernels._int8_channel_matmul").isa() == "amx"
        assert config().prompt_w16("cpu") == amx  # auto: where the per-channel kernel runs on the tile unit


@needs_native
def test_lora_deltas_apply_on_both_forms(tiny_model, tiny_lora_adapters):
    pytest.importorskip("peft")
    from slipstream.models.lora import load_adapter, lora_targets

    cfg, model = tiny_model
    adapters = {n: load_adapter(n, d, lora_targets(model), cfg.num_layers, 8) for n, d in tiny_lora_adapters[1].items()}
    prompt = [5, 17, 33, 99, 7, 200, 3]
    out = {}
    for form in ("same", "w16"):
        engine = runner.JaxEngine(cfg, model, runner.EngineConfig(**{**HYBRID, "prompt_weights": form, "max_loras": 1,
                                                                     "max_lora_rank": 8}), precompile=False)
        engine.insert(0, SlotState(prompt, (), SamplingParams(temperature=0.0)))
        engine.insert(1, SlotState(prompt, (), SamplingParams(temperature=0.0), lora_slot=1, lora=adapters["all"]))
        seqs = [StepSeq(0, prompt, 0, [1], True), StepSeq(1, prompt, 0, [2], True, lora_slot=1)]
        prefill = engine.model_logits(StepBatch(seqs))
        tokens = [int(np.argmax(row)) for row in prefill]
        decode = engine.model_logits(StepBatch([StepSeq(s, [t], len(prompt), [1 + s], True, lora_slot=s)
                                                for s, t in enumerate(tokens)]))
        out[form] = np.stack([prefill, decode])
    assert np.abs(out["w16"][:, 1] - out["w16"][:, 0]).max() > 1e-2  # the adapter changes the output
    np.testing.assert_allclose(out["w16"], out["same"], atol=2e-3)    # the forms differ by their roundings only
    assert not np.array_equal(out["w16"][0], out["same"][0])
