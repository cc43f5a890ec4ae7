"""Group-wise int8 (q8_0): rounding bounds, exact GGUF block conversion, the QuantizedWeight form,
quantization.ops.linear through the kernel, and the loader's q8_0 path on tiny and default models."""
from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import quants

from slipstream.quantization import groupwise, ops
from slipstream.quantization.weights import QuantizedWeight, quantize_weight


@pytest.mark.parametrize("shape", [(5, 64), (7, 70), (3, 1)])
def test_rows_round_to_within_half_a_step_of_their_group(shape):
    rng = np.random.default_rng(0)
    w = rng.standard_normal(shape).astype(np.float32) * rng.uniform(1e-3, 10, (shape[0], 1))
    w[0, : min(32, shape[1])] = 0.0  # an all-zero group
    q, d = groupwise.quantize_rows(w)
    assert q.dtype == np.int8 and q.shape == shape and d.shape == (shape[0], -(-shape[1] // 32))
    assert np.abs(q).max() <= 127 and d[0, 0] == 0.0
    step = np.repeat(d, 32, axis=1)[:, : shape[1]]
    assert np.all(np.abs(groupwise.dequantize_rows(q, d) - w) <= step / 2 * (1 + 1e-6))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_convert_exactly(kind):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((6, 96)).astype(np.float32) + 0.5
    qtype = gguf.GGMLQuantizationType[kind]
    raw = quants.quantize(w, qtype)
    decode = {"Q8_0": groupwise.from_q8_0_blocks, "Q4_0": groupwise.from_q4_0_blocks,
              "Q4_1": groupwise.from_q4_1_blocks}[kind]
    rows = decode(raw, 96)
    assert len(rows) == (3 if kind == "Q4_1" else 2)  # Q4_1's minimum: a group offset
    np.testing.assert_allclose(groupwise.dequantize_rows(*rows), quants.dequantize(raw, qtype), rtol=1e-6, atol=1e-7)


def test_gguf_q4_k_blocks_convert_exactly():
    rng = np.random.default_rng(9)
    n, k = 5, 512
    blocks = rng.integers(0, 256, (n * k // 256, 144), dtype=np.uint8)
    blocks[:, :4] = np.stack([rng.uniform(1e-3, 1e-2, len(blocks)), rng.uniform(1e-3, 1e-2, len(blocks))],
                             axis=1).astype(np.float16).view(np.uint8)  # finite d and dmin
    raw = blocks.reshape(n, -1)
    rows = groupwise.from_q4_k_blocks(raw, k)
    want = quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K).reshape(n, k)
    np.testing.assert_allclose(groupwise.dequantize_rows(*rows), want, rtol=1e-6, atol=1e-8)
    assert rows[0].min() >= 0 and rows[0].max() <= 15


def test_quantized_weight_shape_dequantize_and_scan_slicing():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((3, 70, 21)).astype(np.float32)
    qw = quantize_weight(jnp.asarray(w), "q8_0")
    assert qw.mode == "q8_0" and qw.shape == (3, 70, 21) and qw.ndim == 3
    deq = np.asarray(qw.dequantize())
    assert deq.shape == w.shape
    assert np.abs(deq - w).max() <= np.abs(w).max() / 127
    # lax.scan slices the layer axis off the leaves; the logical shape follows
    _, shapes = jax.lax.scan(lambda c, layer: (c, layer.dequantize().sum(0)), 0.0, qw)
    np.testing.assert_allclose(np.asarray(shapes), deq.sum(1), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("lead", [(), (4,), (2, 3)])
def test_linear_q8_0_tracks_the_float_matmul(lead):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((96, 40)).astype(np.float32) / np.sqrt(96)
    x = rng.standard_normal((*lead, 96)).astype(np.float32)
    qw = quantize_weight(jnp.asarray(w), "q8_0")
    y = np.asarray(jax.jit(ops.linear)(jnp.asarray(x), qw))
    want = x @ w
    assert y.shape == (*lead, 40)
    # both sides rounded to 8 bits per 32 values: ~1% of the output's scale
    assert np.abs(y - want).max() < 0.03 * np.abs(want).max()


def test_linear_with_offsets_and_a16_matches_the_dequantized_weight():
    # Q4_1 rows (asymmetric, offsets): with two-part activations the only error left is ~15-bit x
    rng = np.random.default_rng(6)
    raw = quants.quantize(rng.standard_normal((40, 96)).astype(np.float32) + 1.0, gguf.GGMLQuantizationType.Q4_1)
    rows = groupwise.from_q4_1_blocks(raw, 96)
    x = jnp.asarray(rng.standard_normal((5, 96)).astype(np.float32))
    want = np.asarray(x) @ groupwise.dequantize_rows(*rows).T
    errors = {}
    for mode in ("q8_0", "q8_0-a16"):
        qw = groupwise.pack_one(rows, mode)
        np.testing.assert_allclose(np.asarray(qw.dequantize()), groupwise.dequantize_rows(*rows).T, rtol=1e-6, atol=1e-6)
        errors[mode] = np.abs(np.asarray(jax.jit(ops.linear)(x, qw)) - want).max()
    assert errors["q8_0"] < 0.03 * np.abs(want).max()
    assert errors["q8_0-a16"] < errors["q8_0"] / 50


def test_prepare_keeps_loader_built_q8_0_weights_and_quantizes_the_rest(tiny_llama_dir):
    from flax import nnx

    from slipstream.engine.device.params import prepare_model
    from slipstream.models.loader import load_hf_dir

    _, model = load_hf_dir(tiny_llama_dir)  # a model of its own: the run's checkpoint, loaded afresh
    pre = quantize_weight(model.blocks.attn.wq.w.get_value(), "q8_0")
    model.blocks.attn.wq.w.set_value(pre)
    embed = model.embed.table.get_value()
    out = prepare_model(model, "q8_0-a16", jnp.float32)
    wq = out.blocks.attn.wq.w.get_value()
    assert wq.mode == "q8_0-a16" and wq.q is pre.q  # kept, not requantized
    for lin in (out.blocks.attn.wk, out.blocks.mlp.w_down, out.lm_head):
        assert isinstance(lin.w.get_value(), QuantizedWeight) and lin.w.get_value().mode == "q8_0-a16"
    assert out.embed.table.get_value() is embed  # a gather, never quantized
    assert not any(isinstance(v, QuantizedWeight) for v in jax.tree.leaves(
        nnx.state(out.blocks.attn_norm), is_leaf=lambda x: isinstance(x, QuantizedWeight)))


def test_hf_loader_builds_q8_0_weights_that_track_float(tmp_path):
    from flax import nnx

    from slipstream.models.base import dense_logits
    from slipstream.models.loader import load_hf_dir
    from tests.conftest import build_tiny_hf

    path = build_tiny_hf(str(tmp_path / "tiny"), tie=True)
    cfg, float_model = load_hf_dir(path)
    _, q_model = load_hf_dir(path, quantize="q8_0")
    assert all(isinstance(lin.w.get_value(), QuantizedWeight) for lin in (q_model.blocks.attn.wq, q_model.blocks.mlp.w_down))
    assert q_model.lm_head.w.get_value().shape == (cfg.hidden_size, cfg.vocab_size)  # tied: int8 rows of the embedding
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 12)), jnp.int32)
    ref = np.asarray(nnx.jit(dense_logits)(float_model, tokens))
    got = np.asarray(nnx.jit(dense_logits)(q_model, tokens))
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_default_model_lm_head_comes_straight_from_the_q8_0_embedding(default_model_path, default_gguf_reader):
    from slipstream.models.loader import load_gguf

    reader = default_gguf_reader  # the run's parse of the file (seconds), for the loader and the checks
    cfg, model = load_gguf(default_model_path, quantize="q8_0", reader=reader)
    raw = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert raw.tensor_type == gguf.GGMLQuantizationType.Q8_0
    embed = quants.dequantize(raw.data, raw.tensor_type).reshape(cfg.vocab_size, cfg.hidden_size)
    np.testing.assert_array_equal(np.asarray(model.lm_head.w.get_value().dequantize()), embed.T)
    # the lookup table: the Q8_0 rows as stored, dequantized at lookup to exactly the decoded floats
    table = model.embed.table.get_value()
    assert isinstance(table, groupwise.QuantizedTable) and table.q.dtype == jnp.int8
    assert table.q.nbytes + table.scale.nbytes < 0.3 * embed.nbytes
    tokens = jnp.asarray([0, 1, 7, cfg.vocab_size - 1, 7], jnp.int32)
    np.testing.assert_array_equal(np.asarray(model.embed(tokens, jnp.float32)), embed[np.asarray(tokens)])
    np.testing.assert_array_equal(np.asarray(table.dequantize()), embed)
    w_up = model.blocks.mlp.w_up.w.get_value()
    assert w_up.shape == (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size)
    # the layers are Q4_1: held exactly, the block minimum as the group offset
    up = next(t for t in reader.tensors if t.name == "blk.3.ffn_up.weight")
    assert up.tensor_type == gguf.GGMLQuantizationType.Q4_1
    want = quants.dequantize(up.data, up.tensor_type).reshape(cfg.intermediate_size, cfg.hidden_size).T
    np.testing.assert_allclose(np.asarray(w_up.dequantize()[3]), want, rtol=1e-6, atol=1e-7)
    # ... and packed two to a byte (their q lie in 0..15), the Q8_0 LM head at 8 bits
    assert w_up.q.shape[-1] * 2 == w_up.scale.shape[-1] * 32
    assert model.lm_head.w.get_value().q.shape[-1] == model.lm_head.w.get_value().scale.shape[-1] * 32


def test_stacking_four_and_eight_bit_layers_widens_to_eight_bits():
    from slipstream.kernels import q8_matmul

    rng = np.random.default_rng(5)
    d = rng.random((48, 2)).astype(np.float16).astype(np.float32)
    nibbles = (rng.integers(0, 16, (48, 64)).astype(np.int8), d)
    bytes_ = (rng.integers(-127, 128, (48, 64)).astype(np.int8), d)
    w = groupwise.pack_layers([nibbles, bytes_, nibbles])
    assert w.q.shape == (3, 3, 64 * 16)
    want = [q8_matmul.pack(*r) for r in (nibbles, bytes_, nibbles)]
    np.testing.assert_array_equal(np.asarray(w.q), np.stack([p[0] for p in want]))
    assert groupwise.pack_layers([nibbles, nibbles]).q.shape == (2, 3, 64 * 8)


@pytest.mark.parametrize("shape", [(5, 64), (7, 70), (3, 1)])
def test_4_bit_rows_round_to_within_half_a_step_and_keep_q4_1_grids(shape):
    """quantize_rows4 (int4 on CPU): q in 0..15, f16 scale and minimum per group, within half a step (plus the
    f16 minimum's rounding) of the float rows; rows already on a Q4_1 grid (both ends present) come back exactly."""
    rng = np.random.default_rng(6)
    w = rng.standard_normal(shape).astype(np.float32) * rng.uniform(1e-3, 10, (shape[0], 1))
    w[0, : min(32, shape[1])] = 0.25  # a constant group
    q, d, m = groupwise.quantize_rows4(w)
    assert q.shape == shape and q.min() >= 0 and q.max() <= 15 and d[0, 0] == 0.0
    assert np.all(d == d.astype(np.float16)) and np.all(m == m.astype(np.float16))
    back = groupwise.dequantize_rows(q, d, m)
    slack = np.repeat(d / 2 + np.abs(m) * 2.0 ** -11, 32, axis=1)[:, : shape[1]]
    assert np.all(np.abs(back - w) <= slack * (1 + 1e-6) + 1e-7)
    again = groupwise.quantize_rows4(back)
    np.testing.assert_array_equal(groupwise.dequantize_rows(*again), back)


def test_int4_on_cpu_is_4_bit_rows_in_the_native_kernel(monkeypatch):
    """--quantize int4 where the native kernel runs: a q8_0-a16 QuantizedWeight packed at 4 bits (the bytes of a
    GGUF Q4_1 tensor), whose product is the float64 product of the weight it stores."""
    from slipstream.kernels import q8_matmul
    from slipstream.quantization import weights

    if not weights.int4_on_cpu():
        pytest.skip("the native q8 kernel is not built here")
    rng = np.random.default_rng(7)
    w = rng.standard_normal((2, 128, 48)).astype(np.float32) / 10
    qw = quantize_weight(jnp.asarray(w), "int4")
    assert isinstance(qw, QuantizedWeight) and qw.mode == "q8_0-a16" and qw.logical == (128, 48)
    assert q8_matmul.packed_bits(qw.q.shape[-1], qw.scale.shape[-1]) == 4
    x = rng.standard_normal((3, 128)).astype(np.float32)
    stored = np.asarray(qw.dequantize(), np.float64)
    for layer in range(2):
        want = x.astype(np.float64) @ stored[layer]
        got = ops.linear(jnp.asarray(x), jax.tree.map(lambda a, i=layer: a[i], qw))
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=2e-3 * np.abs(want).max())
    with pytest.raises(ValueError, match="multiple of 64"):
        quantize_weight(jnp.ones((96, 8)), "int4")
    monkeypatch.setattr(weights, "int4_on_cpu", lambda: False)  # elsewhere: the TPU/GPU form
    assert quantize_weight(jnp.asarray(w[0]), "int4").bits == 4
