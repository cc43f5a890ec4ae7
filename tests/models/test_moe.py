"""Sparse-MoE models (models/moe.py): both ways of running the sorted (token, expert) rows give each pair its
expert's output, int8 experts stay close to float, greedy generation through the engine (chunked prefill and
decode of several sequences) equals transformers', and unsupported MoE configs are refused by name."""
from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from slipstream.engine.api import SlotState, StepBatch, StepSeq
from slipstream.engine.device.params import prepare_model
from slipstream.engine.device.runner import EngineConfig, JaxEngine
from slipstream.engine.request import SamplingParams
from slipstream.kernels import int8_channel_matmul as icm
from slipstream.models import moe
from slipstream.models.base import dense_logits
from slipstream.models.config import ModelConfig
from slipstream.models.loader import load_hf_dir
from slipstream.quantization import experts as ex
from slipstream.quantization.layer_packing import pack_experts
from tests.conftest import build_tiny_hf

LOGPROB_TOL = 0.02  # tests/quantization/test_int8_engine.py's bound on int8 weights' log-probabilities


@pytest.fixture(scope="module")
def olmoe_dir(tmp_path_factory) -> str:
    return build_tiny_hf(str(tmp_path_factory.mktemp("olmoe")), "olmoe")


@pytest.fixture(scope="module")
def olmoe(olmoe_dir):
    return load_hf_dir(olmoe_dir)


def _pairs_reference(x, chosen, top_k, gate, up, down):
    """Each pair's expert output in numpy: down_e(silu(gate_e x) * up_e x)."""
    out = []
    for j, e in enumerate(chosen):
        xt = x[j // top_k]
        g, u = xt @ gate[e], xt @ up[e]
        out.append((g / (1 + np.exp(-g)) * u) @ down[e])
    return np.stack(out)


@pytest.mark.parametrize("tokens", [3, 64])
def test_block_loop_and_ragged_dot_give_every_pair_its_experts_output(tokens):
    """A decode-sized step (few rows: one small block per used expert) and a prefill-sized one (skewed routing: an
    expert over several blocks, another unused), float and int8 experts, both the CPU's block loop and the grouped
    ragged_dot (the TPU's path, run here as XLA:CPU's dense lowering)."""
    rng = np.random.default_rng(0)
    e, d, f, top_k = 4, 32, 16, 2
    x = rng.standard_normal((tokens, d)).astype(np.float32)
    weights = [rng.standard_normal((2, e, *shape)).astype(np.float32) / np.sqrt(shape[0]) for shape in
               ((d, f), (d, f), (f, d))]
    # expert 0 takes most pairs, expert 3 none
    chosen = rng.choice(3, size=tokens * top_k, p=[0.7, 0.2, 0.1]).astype(np.int32)
    layer = 1
    want = _pairs_reference(x, chosen, top_k, *(w[layer] for w in weights))
    float_stacks = [ex.ExpertStack(jnp.asarray(w)) for w in weights]
    int8_stacks = [ex.quantize_experts(s) for s in float_stacks]
    assert moe.block_rows(tokens * top_k, e) * 2 < (chosen == 0).sum() or tokens == 3
    for stacks, tol in ((float_stacks, 1e-5), (int8_stacks, 0.02)):
        picks = tuple(s.pick(jnp.int32(layer)) for s in stacks)
        args = (jnp.asarray(x), jnp.asarray(chosen), jnp.argsort(chosen, stable=True),
                jnp.bincount(chosen, length=e).astype(jnp.int32))
        blocks = jax.jit(lambda *a: moe._block_rows(*a, picks=picks, top_k=top_k))(*args)
        ragged = jax.jit(lambda *a: moe._ragged_rows(*a, picks=picks, top_k=top_k))(*args)
        scale = np.abs(want).max()
        np.testing.assert_allclose(np.asarray(blocks), want, rtol=0, atol=tol * scale)
        np.testing.assert_allclose(np.asarray(ragged), want, rtol=0, atol=tol * scale)
    # the CPU's packed int8 experts: every expert's rows in one per-channel kernel call per projection, gate and up
    # fused (as the engine packs them) or apart
    for forms in (pack_experts(*int8_stacks), tuple(ex.pack_numpy(s) for s in int8_stacks)):
        packed = tuple(form.pick(jnp.int32(layer)) for form in forms)
        got = jax.jit(lambda *a: moe.expert_rows(*a, picks=packed, top_k=top_k))(jnp.asarray(x), jnp.asarray(chosen))
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=0.02 * np.abs(want).max())


@pytest.mark.parametrize("tokens, dtype", [(3, "float32"), (64, "float32"), (40, "bfloat16")])
def test_tpu_kernel_path_gives_every_pair_its_experts_output(tokens, dtype):
    """The TPU's int8 path (kernels/tpu/expert_matmul.py under Pallas' interpreter): a decode-sized step and
    prefill-sized ones with skewed routing (an expert over several blocks, another unused) give what the block loop
    gives, and the product of the rounded weights."""
    rng = np.random.default_rng(1)
    e, d, f, top_k, layer = 4, 256, 128, 2, 1
    x = jnp.asarray(rng.standard_normal((tokens, d)), dtype)
    stacks = [ex.quantize_experts(ex.ExpertStack(jnp.asarray(rng.standard_normal((2, e, *shape)) / np.sqrt(shape[0]),
                                                             jnp.float32)))
              for shape in ((d, f), (d, f), (f, d))]
    chosen = rng.choice(3, size=tokens * top_k, p=[0.7, 0.2, 0.1]).astype(np.int32)
    rounded = [np.asarray(s.w[layer], np.float32) * np.asarray(s.scale[layer])[:, None, :] for s in stacks]
    want = _pairs_reference(np.asarray(x.astype(jnp.float32)), chosen, top_k, *rounded)
    picks = tuple(s.pick(jnp.int32(layer)) for s in stacks)
    assert ex.kernel_applies(picks, x)
    args = (x, jnp.asarray(chosen), jnp.argsort(chosen, stable=True), jnp.bincount(chosen, length=e).astype(jnp.int32))
    block = 16 if tokens > 3 else None  # prefill-sized: an expert over several blocks
    got = jax.jit(lambda *a: moe.kernel_rows(*a, picks=picks, top_k=top_k, block=block, interpret=True))(*args)
    loop = jax.jit(lambda *a: moe._block_rows(*a, picks=picks, top_k=top_k))(*args)
    assert got.shape == (tokens * top_k, d) and got.dtype == jnp.float32
    tol = (1e-5 if dtype == "float32" else 2e-2) * np.abs(want).max()
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=tol)
    np.testing.assert_allclose(np.asarray(got), np.asarray(loop), rtol=0, atol=tol)


def test_tpu_kernel_on_each_devices_slice_adds_up_to_the_whole():
    """The TPU's int8 path as each device runs it under tensor parallelism (engine/device/sharding.py; Pallas'
    interpreter, one slice after another): gate and up cut to 128 of their 256 columns with their scales, down to
    128 of its 256 inputs with its scales whole; the slices' mixtures (models/moe.mixture's weighting) add up to
    the whole experts' mixture."""
    rng = np.random.default_rng(4)
    e, d, f, top_k, tokens, layer, n = 4, 256, 256, 2, 24, 1, 2
    gate, up, down = [ex.quantize_experts(ex.ExpertStack(jnp.asarray(rng.standard_normal((2, e, *shape))
                                                                      / np.sqrt(shape[0]), jnp.float32)))
                      for shape in ((d, f), (d, f), (f, d))]
    x = jnp.asarray(rng.standard_normal((tokens, d)), jnp.float32)
    weights, chosen = jax.lax.top_k(jax.nn.softmax(jnp.asarray(rng.standard_normal((tokens, e)) * 2), -1), top_k)
    chosen = chosen.reshape(-1).astype(jnp.int32)
    args = (x, chosen, jnp.argsort(chosen, stable=True), jnp.bincount(chosen, length=e).astype(jnp.int32))

    @jax.jit
    def mixture(stacks):
        rows = moe.kernel_rows(*args, picks=tuple(s.pick(jnp.int32(layer)) for s in stacks), top_k=top_k, block=16,
                               interpret=True)                                        # [T*k,D]
        return jnp.sum((rows * weights.reshape(-1, 1)).reshape(tokens, top_k, d), axis=1)

    whole = np.asarray(mixture((gate, up, down)))
    cut = f // n
    parts = []
    for s in range(n):
        cols = slice(s * cut, (s + 1) * cut)
        stacks = (ex.ExpertStack(gate.w[..., cols], gate.scale[..., cols]),
                  ex.ExpertStack(up.w[..., cols], up.scale[..., cols]), ex.ExpertStack(down.w[:, :, cols], down.scale))
        assert ex.kernel_applies(tuple(st.pick(jnp.int32(layer)) for st in stacks), x)
        parts.append(np.asarray(mixture(stacks)))
    np.testing.assert_allclose(sum(parts), whole, rtol=0, atol=1e-5 * np.abs(whole).max())
    # each slice's share is its own: neither the whole nor nothing
    assert all(0.1 * np.abs(whole).max() < np.abs(part - whole).max() for part in parts)


def test_int8_experts_lower_to_the_kernel_only_for_tpu():
    """Lowered for TPU, a layer's int8 experts are two kernel calls (gate and up together, then down): no loop, no
    grouped dot of a converted stack; for CPU, no kernel."""
    e, d, f, top_k = 8, 256, 128, 2
    stacks = [ex.ExpertStack(jnp.zeros((2, e, *shape), jnp.int8), jnp.ones((2, e, shape[1]), jnp.float32))
              for shape in ((d, f), (d, f), (f, d))]

    def rows(x, chosen, layer):
        return moe.expert_rows(x, chosen, tuple(s.pick(layer) for s in stacks), top_k)

    for tokens in (1, 64):  # fewer pairs than experts, and more
        args = (jnp.zeros((tokens, d), jnp.bfloat16), jnp.zeros((tokens * top_k,), jnp.int32), jnp.int32(1))
        tpu = jax.jit(rows).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
        assert tpu.count("tpu_custom_call") == 2 and "ragged_dot" not in tpu and "stablehlo.while" not in tpu
        cpu = jax.jit(rows).trace(*args).lower(lowering_platforms=("cpu",)).as_text()
        assert "tpu_custom_call" not in cpu


def test_grouped_matmul_gives_each_row_its_groups_product():
    """kernels/int8_channel_matmul.grouped_matmul: each group's rows, bit for bit, what a call on those rows alone at
    the group's weight gives them (empty groups among them); rows past the groups are 0."""
    rng = np.random.default_rng(1)
    k, n, stack, first = 96, 40, 6, 2
    weights = [icm.pack(rng.integers(-127, 128, (k, n), dtype=np.int8), rng.uniform(0.5, 1.5, n).astype(np.float32))
               for _ in range(stack)]
    packed, scales, colsum = (jnp.asarray(np.stack(parts)) for parts in zip(*weights))
    sizes = np.array([3, 0, 17, 1], np.int32)
    x = rng.standard_normal((sizes.sum() + 2, k)).astype(np.float32)
    got = np.asarray(jax.jit(lambda x, s: icm.grouped_matmul(x, packed, scales, colsum, s, first, n=n, parts=2))(
        x, jnp.asarray(sizes)))
    start = np.concatenate([[0], np.cumsum(sizes)])
    for g, size in enumerate(sizes):
        rows = x[start[g]:start[g + 1]]
        one = icm.int8_channel_matmul(jnp.asarray(rows), packed, scales, colsum, n=n, parts=2, layer=first + g)
        if icm.native_available():
            np.testing.assert_array_equal(got[start[g]:start[g + 1]], np.asarray(one))
        else:
            np.testing.assert_allclose(got[start[g]:start[g + 1]], np.asarray(one), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[start[-1]:], 0)


def _log_softmax(z):
    z = np.asarray(z, np.float64)
    return z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)


@pytest.mark.parametrize("mode", ["int8", "q8_0-a16"])
def test_int8_experts_stay_close_to_float(olmoe, mode):
    """The TPU's default (experts per-channel int8, multiplied through XLA here) and the CPU's (q8_0-a16 dense
    linears; experts packed for the native kernel as the engine packs them): log-probabilities within the int8
    tests' bound of f32's, and the same greedy tokens wherever f32's lead is clear."""
    from slipstream.engine.device.layer_stack import split_linears

    cfg, model = olmoe
    tokens = np.random.default_rng(3).integers(3, 256, (2, 24)).astype(np.int32)
    ref = _log_softmax(nnx.jit(dense_logits)(model, tokens))
    quantized = prepare_model(nnx.clone(model), mode, jnp.float32)
    assert quantized.blocks.mlp.w_down.get_value().w.dtype == jnp.int8
    if mode == "q8_0-a16":
        split_linears(quantized)
        assert isinstance(quantized.blocks.mlp.w_down.get_value(), ex.PackedExperts)
    got = _log_softmax(nnx.jit(dense_logits)(quantized, tokens))
    assert np.abs(got - ref).max() < LOGPROB_TOL
    assert np.abs(got - ref).max() > 1e-6  # rounded, not the float weights
    # a greedy token may differ only where f32's top two are closer than the error allows
    top2 = np.sort(ref, axis=-1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > 2 * LOGPROB_TOL
    assert (got.argmax(-1) == ref.argmax(-1))[clear].all() and clear.any()


def test_greedy_generation_through_the_engine_equals_transformers(olmoe, olmoe_dir):
    """Three sequences at once: prompts prefilled in chunks beside the others' decodes, then 8 greedy tokens each,
    in f32: every token equals transformers' greedy generation."""
    import transformers

    cfg, model = olmoe
    engine = JaxEngine(cfg, model, EngineConfig(max_slots=3, page_size=8, max_seq_len=64, num_pages=24,
                                                max_num_batched_tokens=16, quantize="none"), precompile=False)
    rng = np.random.default_rng(5)
    prompts = [list(map(int, rng.integers(3, 256, n))) for n in (19, 7, 12)]
    new = 8
    hf = transformers.AutoModelForCausalLM.from_pretrained(olmoe_dir, dtype=torch.float32).eval()
    want = []
    for p in prompts:  # greedy by hand: generate() would stop at, or with min_new_tokens mask, the EOS id
        ids = list(p)
        with torch.no_grad():
            for _ in range(new):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        want.append(ids[len(p):])
    pages = [[1 + 8 * s + i for i in range(8)] for s in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=new)
    for slot, p in enumerate(prompts):
        engine.insert(slot, SlotState(p, [], params))
    done, got = [0, 0, 0], [[], [], []]
    while any(len(g) < new for g in got):
        seqs = []
        for s, p in enumerate(prompts):
            if done[s] < len(p):  # a prefill chunk of up to 5 tokens, sampled at the prompt's end
                n = min(5, len(p) - done[s])
                seqs.append(StepSeq(s, p[done[s]:done[s] + n], done[s], pages[s], done[s] + n == len(p)))
                done[s] += n
            elif len(got[s]) < new:
                seqs.append(StepSeq(s, [got[s][-1]], len(p) + len(got[s]) - 1, pages[s], True))
        for seq, sampled in zip([q for q in seqs if q.sample], engine.step(StepBatch(seqs))):
            got[seq.slot].append(sampled.token_id)
    assert got == want


def _config(path: str) -> dict:
    with open(f"{path}/config.json") as f:
        return json.load(f)


@pytest.mark.parametrize("change, message", [
    ({"mlp_only_layers": [1]}, r"layers \[1\] have a dense MLP"),
    ({"decoder_sparse_step": 2}, r"layers \[0, 2\] have a dense MLP"),
    ({"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "shared_expert_intermediate_size": 32},
     "Qwen2MoeForCausalLM.*not supported"),
    ({"shared_expert_intermediate_size": 32}, "shared experts are not supported"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok <= num_experts"),
])
def test_unsupported_moe_configs_are_refused_by_name(tmp_path_factory, change, message):
    raw = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
           "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
           "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "vocab_size": 256, "decoder_sparse_step": 1, "mlp_only_layers": []}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict({**raw, **change})


def test_olmoe_clip_qkv_is_refused(olmoe_dir):
    raw = _config(olmoe_dir)
    with pytest.raises(ValueError, match="clip_qkv"):
        ModelConfig.from_hf_dict({**raw, "clip_qkv": 8.0})


def test_tensor_parallel_that_cannot_split_the_experts_is_refused_with_the_sizes(olmoe):
    """Each device holds an equal slice of every expert's hidden dimension (OLMoE's tiny experts: 48 units); whole
    experts per device (expert parallelism) is refused by name."""
    from slipstream.engine.device.sharding import ShardingConfig, TensorParallel

    with pytest.raises(ValueError, match=r"tensor_parallel 5 does not divide .*moe_intermediate_size 48.*2, 3, 4, 6"):
        TensorParallel(olmoe[0], 5)
    with pytest.raises(ValueError, match="expert parallelism"):
        ShardingConfig(expert="model")


@pytest.mark.parametrize("shards", [2, 4])
def test_experts_packed_per_shard_add_up_to_the_whole(shards):
    """pack_experts(shards=n), as tensor parallelism packs them: shard s holds gate's and up's columns and down's
    inputs of slice s of every expert's hidden dimension, fused per shard; the shards' MLPs, each through the
    grouped kernel on its own packing, add up to the pairs' outputs. The whole packing is not multiplied."""
    rng = np.random.default_rng(2)
    e, d, f, top_k, tokens, layer = 4, 32, 16, 2, 12, 1
    stacks = [ex.quantize_experts(ex.ExpertStack(jnp.asarray(rng.standard_normal((2, e, *shape)) / np.sqrt(shape[0]),
                                                             jnp.float32)))
              for shape in ((d, f), (d, f), (f, d))]
    rounded = [np.asarray(s.w[layer], np.float32) * np.asarray(s.scale[layer])[:, None, :] for s in stacks]
    x = rng.standard_normal((tokens, d)).astype(np.float32)
    chosen = rng.choice(e, size=tokens * top_k).astype(np.int32)
    want = _pairs_reference(x, chosen, top_k, *rounded)
    gate, up, down = pack_experts(*stacks, shards=shards)
    assert gate.shards == down.shards == shards and gate.widths == (f // shards,) * 2 and down.widths == (d,)
    entries = 2 * e
    assert gate.packed.shape[0] == down.packed.shape[0] == shards * entries

    def one(form, s):
        return dataclasses.replace(form, packed=form.packed[s * entries:(s + 1) * entries],
                                   scales=form.scales[s * entries:(s + 1) * entries],
                                   colsum=form.colsum[s * entries:(s + 1) * entries], shards=1)

    got = sum(np.asarray(moe.expert_rows(jnp.asarray(x), jnp.asarray(chosen), (
        one(gate, s).pick(jnp.int32(layer)), up, one(down, s).pick(jnp.int32(layer))), top_k)) for s in range(shards))
    np.testing.assert_allclose(got, want, rtol=0, atol=0.02 * np.abs(want).max())
    with pytest.raises(ValueError, match="one shard per device"):
        moe.expert_rows(jnp.asarray(x), jnp.asarray(chosen), (gate.pick(jnp.int32(layer)), up,
                                                                down.pick(jnp.int32(layer))), top_k)
