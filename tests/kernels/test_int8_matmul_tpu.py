"""The Pallas TPU group-wise int8 matmul (kernels/tpu/int8_matmul.py), in Pallas' TPU interpret mode on CPU,
equals the dequantize-then-dot reference (odd row counts, one to three blocks along K and N, with and without
offsets, bf16 and f32 activations, both ways of dequantizing, a stack read in place at a layer index, also
through int8.matmul); shapes that do not tile keep XLA's path; and quantization.int8.matmul lowers to the
kernel only for TPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from slipstream.kernels.tpu import int8_matmul as kernel
from slipstream.kernels.tpu import nibbles
from slipstream.quantization import int8


def _weight(rng, k: int, n: int, offset: bool, layers: int | None = None) -> int8.Int8Weight:
    """Random int8 values, a power-of-two scale and an offset of a whole number of scales (|q + c| < 256) per
    group and channel: every dequantized weight is exact in bf16 whether or not q * s + o is fused, so the
    kernel and the reference differ only in the order of their f32 sums."""
    lead = () if layers is None else (layers,)
    g = k // int8.GROUP
    q = rng.integers(-128, 128, lead + (k, n))
    scale = 2.0 ** rng.integers(-6, 1, lead + (g, n))
    off = _put(scale * rng.integers(-64, 65, lead + (g, n)), jnp.float32) if offset else None
    return int8.Int8Weight(q=_put(q, jnp.int8), scale=_put(scale, jnp.float32), offset=off)


def _put(values, dtype) -> jax.Array:
    """Host values in `dtype` on the device (cast on the host: a cast on the device compiles per shape)."""
    return jax.device_put(np.asarray(values).astype(jnp.dtype(dtype)))


def _reference(x: jax.Array, w: int8.Int8Weight) -> np.ndarray:
    """x @ w dequantized to x's dtype, products and sums in f32."""
    return np.asarray(_reference_product(x, w))


@jax.jit  # one program a shape (each eager step compiled its own)
def _reference_product(x: jax.Array, w: int8.Int8Weight) -> jax.Array:
    wf = w.dequantize(x.dtype).astype(jnp.float32)
    return jnp.dot(x.astype(jnp.float32), wf, precision=jax.lax.Precision.HIGHEST)


def _close(y, ref) -> None:
    y = np.asarray(y)
    assert y.shape == ref.shape and y.dtype == np.float32
    # f32 sums of the same products in another order: relative to the product's scale
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * float(np.abs(ref).max()))


CASES = [  # m, k, n, block_k, block_n, offset, x dtype, dequant ("+i32": widened through int32)
    (1, 256, 128, 256, 128, True, "float32", "groups"),
    (5, 768, 384, 256, 128, True, "bfloat16", "groups"),      # 3 x 3 blocks
    (17, 512, 256, 256, 128, False, "float32", "groups"),     # 2 x 2 blocks, symmetric (no offsets)
    (3, 512, 384, 512, 128, False, "bfloat16", "groups"),     # one K block, 3 N blocks
    (33, 768, 256, 256, 256, True, "float32", "reshape"),
    (7, 512, 384, 256, 128, False, "bfloat16", "reshape"),
    (2, 512, 256, 256, 128, True, "bfloat16", "groups+i32"),
]


@pytest.mark.parametrize("m,k,n,bk,bn,offset,dtype,dequant", CASES)
def test_kernel_matches_dequantized_dot(m, k, n, bk, bn, offset, dtype, dequant):
    rng = np.random.default_rng(m + k + n)
    w = _weight(rng, k, n, offset)
    x = _put(rng.standard_normal((m, k)), dtype)
    dequant, _, widen = dequant.partition("+")
    y = kernel.int8_matmul(x, w.q, w.scale, w.offset, block_k=bk, block_n=bn, dequant=dequant,
                           via_int32=widen == "i32", interpret=True)
    _close(y, _reference(x, w))


def test_streamed_activations():
    """x over the resident size streams in [M, bk] blocks, each read once per column block."""
    rng = np.random.default_rng(3)
    m, k, n = 2100, 1024, 256          # 2112 padded rows x 1024 f32 = 8.25 MiB > X_RESIDENT_BYTES
    assert _pad(m) * k * 4 > kernel.X_RESIDENT_BYTES
    w = _weight(rng, k, n, True)
    x = _put(rng.standard_normal((m, k)), jnp.float32)
    y = kernel.int8_matmul(x, w.q, w.scale, w.offset, block_k=512, block_n=128, interpret=True)
    _close(y, _reference(x, w))


def _pad(m: int) -> int:
    return -(-m // kernel.ROW_ALIGN) * kernel.ROW_ALIGN


def test_stack_read_at_a_layer_index():
    rng = np.random.default_rng(4)
    stack = _weight(rng, 512, 256, True, layers=3)
    x = _put(rng.standard_normal((4, 512)), jnp.bfloat16)
    for layer in (0, 2):
        y = kernel.int8_matmul(x, stack.q, stack.scale, stack.offset, jnp.int32(layer), block_k=256,
                               block_n=128, interpret=True)
        one = int8.Int8Weight(q=stack.q[layer], scale=stack.scale[layer], offset=stack.offset[layer])
        _close(y, _reference(x, one))


def test_default_blocks():
    """Llama-3-8B's shapes: 2 MiB int8 blocks in decode; at 2048 rows the VMEM estimate stays in budget."""
    assert kernel.blocks(1, 4096, 14336) == (2048, 1024)
    assert kernel.blocks(1, 14336, 4096) == (2048, 1024)
    assert kernel.blocks(64, 4096, 6144) == (2048, 1024)
    for k, n in ((4096, 14336), (14336, 4096), (4096, 6144)):
        bk, bn = kernel.blocks(2048, k, n)
        assert k % bk == 0 and bk % 256 == 0 and n % bn == 0 and bn % 128 == 0
        assert kernel.vmem_estimate(2048, k, bk, bn, 2, True) <= kernel.VMEM_BUDGET


@pytest.mark.parametrize("k,n,group", [(288, 128, 32), (512, 200, 32), (100, 128, 32), (512, 256, 64)])
def test_shapes_that_do_not_tile_have_no_blocks(k, n, group):
    assert kernel.blocks(4, k, n, group=group) is None
    if group != kernel.GROUP:
        return
    with pytest.raises(ValueError, match="no blocks"):
        kernel.int8_matmul(jnp.zeros((4, k), jnp.float32), jnp.zeros((k, n), jnp.int8),
                           jnp.ones((-(-k // 32), n), jnp.float32), interpret=True)


def test_bad_inputs_raise():
    q, s = jnp.zeros((256, 128), jnp.int8), jnp.ones((8, 128), jnp.float32)
    with pytest.raises(ValueError, match="inputs"):
        kernel.int8_matmul(jnp.zeros((2, 512), jnp.float32), q, s, interpret=True)
    with pytest.raises(ValueError, match="scale"):
        kernel.int8_matmul(jnp.zeros((2, 256), jnp.float32), q, s[:4], interpret=True)
    with pytest.raises(ValueError, match="layer"):
        kernel.int8_matmul(jnp.zeros((2, 256), jnp.float32), q[None], s[None], interpret=True)
    with pytest.raises(ValueError, match="tile"):
        kernel.int8_matmul(jnp.zeros((2, 256), jnp.float32), q, s, block_k=128, interpret=True)


def _lowered(fn, *args, platform: str) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("offset", [True, False])
def test_int8_matmul_lowers_to_the_kernel_only_for_tpu(offset):
    rng = np.random.default_rng(5)
    w = _weight(rng, 512, 256, offset)
    x = _put(rng.standard_normal((2, 3, 512)), jnp.bfloat16)
    assert "tpu_custom_call" in _lowered(int8.matmul, x, w, platform="tpu")
    assert "tpu_custom_call" not in _lowered(int8.matmul, x, w, platform="cpu")
    # off TPU the XLA branch runs: exactly the dequantize-then-dot product
    y = int8.matmul(x, w)
    assert y.shape == (2, 3, 256)
    ref = jnp.einsum("mk,kn->mn", x.reshape(6, 512), w.dequantize(x.dtype), preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(np.asarray(y).reshape(6, 256), np.asarray(ref))


def test_untiled_shapes_and_forced_reference_keep_xla_on_tpu(monkeypatch):
    rng = np.random.default_rng(6)
    x = _put(rng.standard_normal((4, 288)), jnp.bfloat16)
    assert "tpu_custom_call" not in _lowered(int8.matmul, x, _weight(rng, 288, 128, True), platform="tpu")
    w = _weight(rng, 512, 256, True)
    x = _put(rng.standard_normal((4, 512)), jnp.bfloat16)
    monkeypatch.setenv("SLIPSTREAM_KERNELS", "reference")
    assert "tpu_custom_call" not in _lowered(int8.matmul, x, w, platform="tpu")


def test_per_channel_mode_is_unchanged():
    """int8-channel weights keep their own dots (the kernel is for the group-wise mode only)."""
    rng = np.random.default_rng(7)
    w = int8.quantize(_put(rng.standard_normal((512, 256)), jnp.float32), "int8-channel")
    x = _put(rng.standard_normal((4, 512)), jnp.bfloat16)
    assert "tpu_custom_call" not in _lowered(int8.matmul, x, w, platform="tpu")


STACK_CASES = [  # m, k, n, offset, x dtype: odd row counts, one to three blocks each way
    (1, 512, 256, True, "bfloat16"),
    (5, 768, 384, True, "float32"),
    (17, 256, 128, False, "bfloat16"),
]


@pytest.mark.parametrize("m,k,n,offset,dtype", STACK_CASES)
def test_stack_at_a_layer_index_equals_the_layer_alone(m, k, n, offset, dtype):
    """int8.matmul of a stack [L, K, N] at a traced layer index gives what the layer's own weight gives: the
    TPU branch (the kernel reading the stack in place, interpreted) bit for bit against the kernel on the
    layer's slice, and the XLA branch (the layer sliced out) bit for bit against the slice's product."""
    rng = np.random.default_rng(m * k + n)
    stack = _weight(rng, k, n, offset, layers=3)
    x = _put(rng.standard_normal((m, k)), dtype)
    rest = () if stack.offset is None else (stack.offset,)
    tpu = jax.jit(lambda x, i, *w: int8._tpu_matmul(x, i, *w, interpret=True))
    for layer in (2, 1):
        one = jax.tree.map(lambda a: a[layer], stack)
        index = jnp.int32(layer)
        in_place = tpu(x, index, stack.q, stack.scale, *rest)
        sliced = tpu(x, jnp.int32(0), one.q, one.scale, *(() if one.offset is None else (one.offset,)))
        np.testing.assert_array_equal(np.asarray(in_place), np.asarray(sliced))
        _close(in_place, _reference(x, one))
        got = jax.jit(lambda x, i: int8.matmul(x, stack, layer=i))(x, index)  # off TPU: the XLA branch
        np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(int8.matmul)(x, one)))


def test_stack_at_a_layer_index_lowers_to_the_kernel_on_the_whole_stack():
    """Lowered for TPU, the product by layer i of a stack hands the kernel the int8 stack and its scales
    whole: no dynamic-slice of them (the layer's blocks are read in place)."""
    rng = np.random.default_rng(8)
    stack = _weight(rng, 512, 256, True, layers=3)
    x = _put(rng.standard_normal((3, 512)), jnp.bfloat16)
    text = _lowered(lambda x, i: int8.matmul(x, stack, layer=i), x, jnp.int32(1), platform="tpu")
    (call,) = [line for line in text.splitlines() if "tpu_custom_call" in line]
    assert "tensor<3x512x256xi8>" in call and call.count("tensor<3x16x256xf32>") == 2
    assert "dynamic_slice" not in text
    assert "tpu_custom_call" not in _lowered(lambda x, i: int8.matmul(x, stack, layer=i), x, jnp.int32(1),
                                             platform="cpu")


def test_stack_paths_without_the_kernel_slice_the_layer():
    """Shapes that do not tile and per-channel weights multiply layer i's slice, as before."""
    rng = np.random.default_rng(9)
    x = _put(rng.standard_normal((4, 288)), jnp.float32)
    cases = [_weight(rng, 288, 128, True, layers=2),
             int8.quantize(_put(rng.standard_normal((2, 288, 128)), jnp.float32), "int8-channel")]
    for stack in cases:
        text = _lowered(lambda x, i: int8.matmul(x, stack, layer=i), x, jnp.int32(1), platform="tpu")
        assert "tpu_custom_call" not in text and "dynamic_slice" in text
        one = jax.tree.map(lambda a: a[1], stack)
        np.testing.assert_array_equal(np.asarray(int8.matmul(x, stack, layer=jnp.int32(1))),
                                      np.asarray(int8.matmul(x, one)))


def test_layer_index_goes_with_a_stack():
    rng = np.random.default_rng(10)
    stack = _weight(rng, 256, 128, True, layers=2)
    x = jnp.zeros((1, 256), jnp.float32)
    with pytest.raises(ValueError, match="stack"):
        int8.matmul(x, stack)
    with pytest.raises(ValueError, match="stack"):
        int8.matmul(x, jax.tree.map(lambda a: a[0], stack), layer=jnp.int32(0))


def _weight4(rng, k: int, n: int, offset: bool, scale_dtype, layers: int | None = None) -> int8.Int8Weight:
    """4-bit values (-8..7) packed two a byte, power-of-two scales and whole-scale offsets (exact in bf16), in
    `scale_dtype`: every dequantized weight is exact, as in _weight."""
    lead = () if layers is None else (layers,)
    g = k // int8.GROUP
    q = _put(rng.integers(-8, 8, lead + (k, n)), jnp.int8)
    scale = 2.0 ** rng.integers(-6, 1, lead + (g, n))
    off = _put(scale * rng.integers(-16, 17, lead + (g, n)), scale_dtype) if offset else None
    return int8.Int8Weight(q=nibbles.pack4(q), scale=_put(scale, scale_dtype), offset=off, bits=4)


def test_nibbles_round_trip_and_layout():
    """pack4 puts input 64j + i in byte row 32j + i's low nibble and input 64j + 32 + i in its high one."""
    q = _put(np.random.default_rng(0).integers(-8, 8, (2, 128, 3)), jnp.int8)
    packed = nibbles.pack4(q)
    assert packed.shape == (2, 64, 3) and packed.dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(nibbles.unpack4(packed)), np.asarray(q))
    b = np.asarray(packed).astype(np.uint8)
    np.testing.assert_array_equal(b[:, 32 + 5] & 0xF, np.asarray(q[:, 64 + 5]) & 0xF)
    np.testing.assert_array_equal(b[:, 32 + 5] >> 4, np.asarray(q[:, 64 + 32 + 5]) & 0xF)
    with pytest.raises(ValueError, match="multiple of 64"):
        nibbles.pack4(jnp.zeros((96, 4), jnp.int8))


CASES4 = [  # m, k, n, block_k, block_n, offset, x dtype, scale dtype
    (1, 512, 128, 512, 128, True, "float32", "bfloat16"),
    (5, 1024, 384, 512, 128, True, "bfloat16", "bfloat16"),   # 2 x 3 blocks
    (17, 512, 256, 256, 128, False, "float32", "float32"),    # f32 scales: blocks of 256, symmetric
    (3, 256, 256, None, None, True, "bfloat16", "bfloat16"),  # bf16 scales, K of 256: all of K in one block
]


@pytest.mark.parametrize("m,k,n,bk,bn,offset,dtype,sdtype", CASES4)
def test_4bit_kernel_matches_dequantized_dot(m, k, n, bk, bn, offset, dtype, sdtype):
    rng = np.random.default_rng(m + k + n)
    w = _weight4(rng, k, n, offset, sdtype)
    x = _put(rng.standard_normal((m, k)), dtype)
    y = kernel.int8_matmul(x, w.q, w.scale, w.offset, block_k=bk, block_n=bn, bits=4, interpret=True)
    _close(y, _reference(x, w))
    if bk is None:
        assert kernel.blocks(m, k, n, bits=4, scale_bytes=2) == (256, 256)


def test_4bit_stack_at_a_layer_index_through_int8_matmul():
    """int8.matmul of a 4-bit stack at a traced layer: the TPU branch (interpreted kernel on the packed stack in
    place) gives the XLA branch's product of the layer's weight."""
    rng = np.random.default_rng(11)
    stack = _weight4(rng, 512, 256, True, jnp.bfloat16, layers=3)
    x = _put(rng.standard_normal((4, 512)), jnp.bfloat16)
    tpu = jax.jit(lambda x, i, *w: int8._tpu_matmul(x, i, *w, bits=4, interpret=True))
    for layer in (2, 0):
        one = jax.tree.map(lambda a: a[layer], stack)
        got = tpu(x, jnp.int32(layer), stack.q, stack.scale, stack.offset)
        _close(got, _reference(x, one))
        _close(int8.matmul(x, stack, layer=jnp.int32(layer)), _reference(x, one))
    text = _lowered(lambda x, i: int8.matmul(x, stack, layer=i), x, jnp.int32(1), platform="tpu")
    (call,) = [line for line in text.splitlines() if "tpu_custom_call" in line]
    assert "tensor<3x256x256xi8>" in call and call.count("tensor<3x16x256xbf16>") == 2


def test_4bit_bad_inputs_raise():
    q, s = jnp.zeros((128, 128), jnp.int8), jnp.ones((8, 128), jnp.bfloat16)
    x = jnp.zeros((2, 256), jnp.float32)
    with pytest.raises(ValueError, match="bits"):
        kernel.int8_matmul(x, q, s, bits=4, dequant="reshape", interpret=True)
    with pytest.raises(ValueError, match="share a dtype"):
        kernel.int8_matmul(x, q, s, s.astype(jnp.float32), bits=4, interpret=True)
    with pytest.raises(ValueError, match="inputs"):
        kernel.int8_matmul(x, q, s, interpret=True)  # 8-bit reading of a packed weight: 128 inputs, not 256
