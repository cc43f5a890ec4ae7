"""Multi-LoRA on the real engine: the tiny Llama with 3 peft adapters, mixed with base-model requests
in one ragged step, against transformers + peft; slots swapped with no recompile; device memory flat
over load/unload cycles."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("peft")

from slipstream.engine.api import SlotState, StepBatch, StepSeq  # noqa: E402
from slipstream.engine.device import layer_stack, runner  # noqa: E402
from slipstream.engine.device.runner import EngineConfig, JaxEngine  # noqa: E402
from slipstream.engine.request import FinishReason, Request, SamplingParams  # noqa: E402
from slipstream.engine.scheduler import OutputProcessor, Scheduler, SchedulerConfig  # noqa: E402
from slipstream.models.lora import load_adapter, lora_targets  # noqa: E402
from tests.conftest import TINY_ENGINE  # noqa: E402
from tests.engine.lora_helpers import ADAPTERS, reference_greedy  # noqa: E402

NAMES = list(ADAPTERS)


class _Detok:
    eos_token_ids = frozenset()

    def decode(self, ids, *, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


@pytest.fixture(scope="module")
def lora_setup(tiny_llama_dir, tiny_model, tiny_lora_adapters, tiny_lora_engine):
    """(base dir, name -> adapter dir, name -> LoraAdapter, engine with 2 LoRA slots of rank 8)."""
    cfg, model = tiny_model
    dirs = tiny_lora_adapters[1]
    targets = lora_targets(model)
    adapters = {n: load_adapter(n, d, targets, cfg.num_layers, 8) for n, d in dirs.items()}
    return tiny_llama_dir, dirs, adapters, tiny_lora_engine


def test_one_step_mixes_adapters_and_base_with_peft_logits(lora_setup):
    base_dir, dirs, adapters, engine = lora_setup
    prompt = [5, 17, 33, 99, 7, 200, 3]
    before = engine.compile_count
    for group in ({"attn": 1, "mlp": 2}, {"all": 2, "attn": 1}):  # the second swaps "mlp" out for "all"
        seqs = [StepSeq(slot=0, token_ids=prompt, start_pos=0, page_ids=[1], sample=True)]
        engine.insert(0, SlotState(prompt, (), SamplingParams(temperature=0.0)))
        for i, (name, lora_slot) in enumerate(group.items(), 1):
            engine.insert(i, SlotState(prompt, (), SamplingParams(temperature=0.0), lora_slot=lora_slot,
                                       lora=adapters[name]))
            seqs.append(StepSeq(slot=i, token_ids=prompt, start_pos=0, page_ids=[1 + i], sample=True,
                                lora_slot=lora_slot))
        logits = engine.model_logits(StepBatch(seqs))
        base_ref = reference_greedy(base_dir, None, prompt, 1)[1][0]
        np.testing.assert_allclose(logits[0], base_ref, atol=1e-4)
        for row, name in enumerate(group, 1):
            ref = reference_greedy(base_dir, dirs[name], prompt, 1)[1][0]
            np.testing.assert_allclose(logits[row], ref, atol=1e-4, err_msg=name)
            assert np.abs(ref - base_ref).max() > 1e-2  # the adapter changes the output
    for slot in range(3):
        engine.free(slot)
    assert engine.compile_count == before


def test_prompt_scores_under_an_adapter_are_peft_s(lora_setup):
    """Prompt scoring (echo with logprobs) in one step with a base-model sequence: each sequence's prompt tokens'
    log-probabilities are transformers + peft's under its own adapter (or none)."""
    base_dir, dirs, adapters, engine = lora_setup
    prompt = [5, 17, 33, 99, 7, 200, 3]
    engine.insert(0, SlotState(prompt, (), SamplingParams(temperature=0.0, prompt_logprobs=0)))
    engine.insert(1, SlotState(prompt, (), SamplingParams(temperature=0.0, prompt_logprobs=0), lora_slot=1,
                               lora=adapters["all"]))
    step = engine.launch(StepBatch([
        StepSeq(slot=0, token_ids=prompt, start_pos=0, page_ids=[1], sample=True, targets=prompt[1:]),
        StepSeq(slot=1, token_ids=prompt, start_pos=0, page_ids=[2], sample=True, lora_slot=1,
                targets=prompt[1:])]))
    step.result()
    for scores, adapter in zip(step.scores(), (None, dirs["all"])):
        for i, score in enumerate(scores, 1):
            logits = reference_greedy(base_dir, adapter, prompt[:i], 1)[1][0].astype(np.float64)
            want = logits[prompt[i]] - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
            np.testing.assert_allclose(score.logprob, want, atol=1e-4, err_msg=f"{adapter} position {i}")
    assert abs(step.scores()[0][-1].logprob - step.scores()[1][-1].logprob) > 1e-3  # the adapter changes them
    for slot in range(2):
        engine.free(slot)


def test_scheduler_serves_adapters_and_base_together_with_swaps(lora_setup):
    """8 requests over 3 adapters and the base with 2 slots: every request's greedy tokens equal
    transformers + peft's, slots are swapped, nothing compiles; the prefix cache never shares KV
    across adapters (the same prompt under each)."""
    base_dir, dirs, adapters, engine = lora_setup
    scheduler = Scheduler(engine, OutputProcessor(_Detok()), SchedulerConfig(max_queue=64))
    scheduler.start()
    shared = [9, 8, 7, 6, 5, 4, 3, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]  # two full pages of 8
    picks = [None, "attn", "mlp", "all", "all", None, "mlp", "attn"]
    try:
        before = engine.compile_count
        first = scheduler.submit(Request(shared, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)))
        first.result(timeout=120)  # the base model's pages of `shared` are cached now
        requests = [Request(shared if i % 2 else shared[:9] + [40 + i],
                            SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                            lora=None if name is None else adapters[name]) for i, name in enumerate(picks)]
        streams = [scheduler.submit(r) for r in requests]
        results = [s.result(timeout=300) for s in streams]
        for req, name, res in zip(requests, picks, results):
            assert res.error is None and res.finish_reason == FinishReason.LENGTH
            want, _ = reference_greedy(base_dir, None if name is None else dirs[name], req.prompt_ids, 6)
            assert res.token_ids == want, (name, req.prompt_ids)
        assert scheduler._planner.lora.swaps > 0
        assert engine.compile_count == before
    finally:
        scheduler.shutdown()


def test_an_adapter_slot_in_use_is_not_rebound(lora_setup):
    from slipstream.engine.lora_registry import LoraSlotTable

    _, _, adapters, _ = lora_setup
    table = LoraSlotTable(2)
    a = table.acquire(adapters["attn"])
    b = table.acquire(adapters["mlp"])
    assert {a, b} == {1, 2}
    assert table.acquire(adapters["all"]) is None  # both in use: the request waits
    assert table.acquire(adapters["attn"]) == a    # shared by a second request
    table.release(b)
    assert table.acquire(adapters["all"]) == b    # the idle slot, swapped
    table.release(a)
    assert table.in_use() == {a: 1, b: 1}


def test_load_unload_cycles_keep_device_memory_flat(lora_setup):
    _, _, adapters, engine = lora_setup
    order = [adapters[n] for n in NAMES]

    def live():
        arrays = jax.live_arrays()
        return len(arrays), sum(a.nbytes for a in arrays)

    engine.lora.ensure(1, order[0])
    before, compiles = live(), engine.compile_count
    for i in range(100):
        engine.lora.ensure(1 + i % 2, order[i % 3])
    assert live() == before
    assert engine.compile_count == compiles


@pytest.mark.parametrize("quantize", ["q8_0-a16", "int8", "int8-stacked"])
def test_adapters_over_int8_base_weights(lora_setup, tiny_model, quantize, monkeypatch):
    """LoRA in f32 on top of int8 linears (CPU's fused group-wise stacks, the accelerators' int8; stacked:
    in the TPU's form, layer_stack.StackedInt8): the adapter's logits stay as close to transformers + peft
    as the base model's are to transformers."""
    base_dir, dirs, adapters, _ = lora_setup
    cfg, model = tiny_model
    stacked = quantize == "int8-stacked"
    if stacked:
        monkeypatch.setattr(runner, "split_linears", lambda m, **kw: layer_stack.index_int8_stacks(m))
        jax.clear_caches()  # traces are shared across engines: trace this form afresh
        quantize = "int8"
    engine = JaxEngine(cfg, model, EngineConfig(**{**TINY_ENGINE, "quantize": quantize}, max_loras=1,
                                                max_lora_rank=8), precompile=False)
    if stacked:
        assert isinstance(engine.params["blocks"]["attn"]["wq"]["w"].get_value(), layer_stack.StackedInt8)
    prompt = [5, 17, 33, 99, 7, 200, 3]
    engine.insert(0, SlotState(prompt, (), SamplingParams(temperature=0.0)))
    engine.insert(1, SlotState(prompt, (), SamplingParams(temperature=0.0), lora_slot=1, lora=adapters["all"]))
    logits = engine.model_logits(StepBatch([
        StepSeq(slot=0, token_ids=prompt, start_pos=0, page_ids=[1], sample=True),
        StepSeq(slot=1, token_ids=prompt, start_pos=0, page_ids=[2], sample=True, lora_slot=1)]))
    base_ref = reference_greedy(base_dir, None, prompt, 1)[1][0]
    lora_ref = reference_greedy(base_dir, dirs["all"], prompt, 1)[1][0]
    base_err = np.abs(logits[0] - base_ref).max()
    lora_err = np.abs(logits[1] - lora_ref).max()
    print(quantize, base_err, lora_err, np.abs(lora_ref - base_ref).max())
    assert 0 < base_err < 0.05 and lora_err < 2 * base_err + 1e-3
    assert logits[1].argmax() == lora_ref.argmax()


def test_the_fused_int8_mlp_adds_the_adapters_deltas_as_the_unfused_one(lora_setup, tiny_model, monkeypatch):
    """Over CPU's group-wise int8 stacks the gated MLP kernel stays on under LoRA: gate's and up's deltas go
    into the gate | up product, down's comes from gate | up (silu(gate) * up formed by the delta kernel).
    Its logits equal those of the same engine with the MLP unfused (silu(gate) * up in XLA, then the down
    projection and its delta), far closer than the adapter moves them."""
    from slipstream.kernels.q8_matmul import gated_native
    from slipstream.quantization import layer_forms

    if not gated_native():
        pytest.skip("no native gated int8 MLP kernel on this CPU")
    _, _, adapters, _ = lora_setup
    cfg, model = tiny_model
    prompt = [5, 17, 33, 99, 7, 200, 3]
    out = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(layer_forms.StackedPick, "gated_down", lambda *a, **kw: None)
        jax.clear_caches()  # traces are shared across engines: trace this form afresh
        engine = JaxEngine(cfg, model, EngineConfig(**{**TINY_ENGINE, "quantize": "q8_0-a16"}, max_loras=1,
                                                    max_lora_rank=8), precompile=False)
        assert engine.lora.packed
        engine.insert(0, SlotState(prompt, (), SamplingParams(temperature=0.0)))
        engine.insert(1, SlotState(prompt, (), SamplingParams(temperature=0.0), lora_slot=1, lora=adapters["mlp"]))
        out[fused] = engine.model_logits(StepBatch([
            StepSeq(slot=0, token_ids=prompt, start_pos=0, page_ids=[1], sample=True),
            StepSeq(slot=1, token_ids=prompt, start_pos=0, page_ids=[2], sample=True, lora_slot=1)]))
    jax.clear_caches()
    moved = np.abs(out[True][1] - out[True][0]).max()
    assert moved > 0.05
    np.testing.assert_allclose(out[True], out[False], rtol=0, atol=2e-3 * moved)


def test_speculative_decoding_verifies_drafts_under_each_adapter(lora_setup):
    """n-gram drafts are verified with their sequence's adapter: repetitive prompts (drafts accepted)
    under two adapters and the base model give transformers + peft's greedy tokens."""
    from slipstream.engine.speculative import SpeculativeConfig

    base_dir, dirs, adapters, engine = lora_setup
    spec = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=3, prompt_lookup_min=1,
                             disable_by_batch_size=16)
    scheduler = Scheduler(engine, OutputProcessor(_Detok()), SchedulerConfig(speculative=spec))
    scheduler.start()
    picks = [None, "attn", "all"]
    prompts = [([7, 8, 9] * 4)[:10], [3, 4] * 5, [11, 12, 13, 14] * 2]
    try:
        results = scheduler.generate([Request(p, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                                              lora=None if n is None else adapters[n])
                                      for p, n in zip(prompts, picks)])
        for p, n, res in zip(prompts, picks, results):
            assert res.token_ids == reference_greedy(base_dir, None if n is None else dirs[n], p, 8)[0], n
        assert scheduler.stats().spec_draft_tokens > 0
    finally:
        scheduler.shutdown(timeout=5)


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_other_architectures_serve_peft_adapters(tmp_path, family):
    """Every architecture's linears are the same seam: an adapter on all of them under Qwen3 (q/k
    norms) and Gemma 3 (GeGLU, sliding and global layers) gives transformers + peft's logits."""
    from slipstream.models.loader import load_hf_dir
    from tests.conftest import build_tiny_hf
    from tests.engine.lora_helpers import make_adapter

    base_dir = build_tiny_hf(str(tmp_path / family), family)
    adapter_dir = make_adapter(base_dir, str(tmp_path / "adapter"), 4, 8, list(ADAPTERS["all"][2]))
    cfg, model = load_hf_dir(base_dir)
    adapter = load_adapter("a", adapter_dir, lora_targets(model), cfg.num_layers, 8)
    engine = JaxEngine(cfg, model, EngineConfig(**TINY_ENGINE, max_loras=1, max_lora_rank=8), precompile=False)
    prompt = [5, 17, 33, 99, 7, 200, 3, 9, 10, 11]
    engine.insert(0, SlotState(prompt, (), SamplingParams(temperature=0.0)))
    engine.insert(1, SlotState(prompt, (), SamplingParams(temperature=0.0), lora_slot=1, lora=adapter))
    logits = engine.model_logits(StepBatch([
        StepSeq(slot=0, token_ids=prompt, start_pos=0, page_ids=[1, 2], sample=True),
        StepSeq(slot=1, token_ids=prompt, start_pos=0, page_ids=[3, 4], sample=True, lora_slot=1)]))
    base_ref = reference_greedy(base_dir, None, prompt, 1)[1][0]
    np.testing.assert_allclose(logits[0], base_ref, atol=1e-4)
    np.testing.assert_allclose(logits[1], reference_greedy(base_dir, adapter_dir, prompt, 1)[1][0], atol=1e-4)


def test_multi_host_workers_get_an_adapters_weights_only_when_a_slot_loads_it(lora_setup):
    from slipstream.engine.distributed.multihost import LockstepEngine

    _, _, adapters, engine = lora_setup

    class Group:
        sent = []

        def send(self, msg):
            self.sent.append(msg)

    lead = LockstepEngine(engine, Group())
    params = SamplingParams(temperature=0.0, seed=1)
    engine.lora.resident[1] = None  # a slot that holds nothing yet
    for name in ("attn", "attn", "mlp", "mlp"):
        lead.insert(0, SlotState([1, 2], (), params, lora_slot=1, lora=adapters[name]))
    shipped = [msg[2].lora for msg in Group.sent]
    assert [a and a.name for a in shipped] == ["attn", None, "mlp", None]
    engine.insert(0, SlotState([1, 2], (), params, lora_slot=1))  # a worker: the slot holds "mlp"
    engine.lora.resident[2] = None
    with pytest.raises(ValueError, match="holds no adapter"):
        engine.insert(0, SlotState([1, 2], (), params, lora_slot=2))
    engine.free(0)


def test_packed_slot_stacks_hold_and_multiply_what_plain_ones_do(lora_setup, tiny_model):
    """XLA:CPU's packed stacks (kernels/f32_matmul's layout, read at the layer index by
    kernels/lora_delta) against the plain [L, in, S*r] / [L, S*r, out] ones: the same adapters written
    into the same slots (swaps included) unpack to the same A and B, and give each token the same delta
    in a scanned layer loop."""
    from slipstream.engine.device.lora_slots import LoraSlots
    from slipstream.kernels import f32_matmul as f32
    from slipstream.quantization import ops
    from slipstream.quantization.lora import LoraWeight, PackedStack

    if not f32.native_available():
        pytest.skip("kernels/f32_matmul's native kernel is not built")
    _, _, adapters, engine = lora_setup
    assert engine.lora.packed  # what the engine serves on CPU
    cfg, model = tiny_model
    targets = lora_targets(model)
    slots = [LoraSlots(targets, cfg.num_layers, 3, 8, np.float32, packed=packed) for packed in (False, True)]
    for s in slots:
        for slot, name in ((1, "attn"), (2, "mlp"), (3, "all"), (1, "all"), (3, "mlp")):
            s.ensure(slot, adapters[name])
    for m, (a, b) in slots[0].stacks.items():
        pa, pb = slots[1].stacks[m]
        np.testing.assert_array_equal(f32.unpack(pa, a.shape[-1]), a)
        np.testing.assert_array_equal(f32.unpack(pb, b.shape[-1]), b)
    token_slots = np.array([0, 1, 2, 3, 3, 1, 0], np.int32)
    x = jax.random.normal(jax.random.key(0), (len(token_slots), cfg.hidden_size), np.float32)
    for m in ("q_proj", "gate_proj"):
        y = jax.random.normal(jax.random.key(1), (len(token_slots), targets[m].d_out), np.float32)
        outs = []
        for s in slots:
            a, b = s.stacks[m]
            if s.packed:
                a, b = PackedStack(a, 3 * 8), PackedStack(b, targets[m].d_out)
            w = LoraWeight(None, a, b, jnp.broadcast_to(token_slots, (cfg.num_layers, len(token_slots))), 8)
            leaves, treedef = jax.tree.flatten(w, is_leaf=ops.per_layer)

            def body(carry, i, leaves=leaves, treedef=treedef):
                layer = [ops.pick(leaf, i) if ops.per_layer(leaf) else leaf[i] for leaf in leaves]
                return carry, jax.tree.unflatten(treedef, layer).add_to(y, x)
            outs.append(np.asarray(jax.lax.scan(body, 0, np.arange(cfg.num_layers, dtype=np.int32))[1]))
        np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-6, err_msg=m)
        delta = outs[0] - np.asarray(y)
        assert np.abs(delta[:, 0]).max() == 0 and np.abs(delta[:, 1]).max() > 1e-3  # base token, adapter token
