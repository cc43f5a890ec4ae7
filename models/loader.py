"""Checkpoint loaders: an HF directory (config.json + safetensors, sharded or not) or a GGUF file.

Both produce (ModelConfig, params) with the pytree layout of models/llama.py: weights [in, out],
layers stacked on a leading axis. Errors name the file, the tensor and the expected shape.
With quantize="q8_0" (or "q8_0-a16") the linear weights and the LM head are built as group-wise
int8 one tensor at a time, so no float copy of them ever exists; GGUF Q8_0/Q4_0/Q4_1/Q4_K blocks
convert exactly, other types are rounded to Q8_0.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Callable, Iterator

import numpy as np
from tqdm import tqdm

from models.config import ModelConfig


class ModelLoadError(ValueError):
    """A checkpoint that cannot be used: missing, corrupt, truncated or of the wrong shape."""


# our name -> (HF suffix under model.layers.{i}., GGUF suffix under blk.{i}., transpose)
_LINEARS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
# A tensor handed over as group-wise int8 rows: (q int8 [out, in], d f32 [out, in/32][, offsets like d]).
Q8Rows = tuple
GROUPWISE = ("q8_0", "q8_0-a16")

_LAYER_TENSORS = {
    "attn_norm": ("input_layernorm.weight", "attn_norm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", "ffn_norm.weight", False),
    "wq": ("self_attn.q_proj.weight", "attn_q.weight", True),
    "wk": ("self_attn.k_proj.weight", "attn_k.weight", True),
    "wv": ("self_attn.v_proj.weight", "attn_v.weight", True),
    "wo": ("self_attn.o_proj.weight", "attn_output.weight", True),
    "bq": ("self_attn.q_proj.bias", "attn_q.bias", False),
    "bk": ("self_attn.k_proj.bias", "attn_k.bias", False),
    "bv": ("self_attn.v_proj.bias", "attn_v.bias", False),
    "w_gate": ("mlp.gate_proj.weight", "ffn_gate.weight", True),
    "w_up": ("mlp.up_proj.weight", "ffn_up.weight", True),
    "w_down": ("mlp.down_proj.weight", "ffn_down.weight", True),
}


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of each tensor as stored in checkpoints ([out, in] for linears), per layer."""
    d, hd, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    qd, kvd = cfg.num_heads * hd, cfg.num_kv_heads * hd
    shapes = {"attn_norm": (d,), "mlp_norm": (d,), "wq": (qd, d), "wk": (kvd, d), "wv": (kvd, d),
              "wo": (d, qd), "w_gate": (f, d), "w_up": (f, d), "w_down": (d, f)}
    if cfg.attention_bias:
        shapes.update(bq=(qd,), bk=(kvd,), bv=(kvd,))
    return shapes


def _device(arr: np.ndarray, dtype):
    """A host array on the default device in `dtype`. device_put hands numpy's buffer over, where
    jnp.asarray compiles a copy program per shape (extra peak memory at load)."""
    import jax
    import jax.numpy as jnp

    arr = np.ascontiguousarray(arr, np.float32 if np.dtype(jnp.dtype(dtype)) == np.float32 else None)
    out = jax.device_put(arr)
    return out if out.dtype == jnp.dtype(dtype) else out.astype(dtype)


def trim_host_heap() -> None:
    """Hand the loader's freed numpy temporaries back to the OS (glibc keeps them otherwise, and the
    KV cache and compiled programs allocated next would add to them in the peak RSS)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def _q8_rows(arr) -> Q8Rows:
    """A checkpoint linear [out, in], float or already Q8 rows -> Q8 rows."""
    from quantization.groupwise import quantize_rows

    return arr if isinstance(arr, tuple) else quantize_rows(arr)


def _assemble(cfg: ModelConfig, get: Callable[[str, str, tuple[int, ...]], np.ndarray | Q8Rows | None],
              names: Callable[[str, int], str], top: dict[str, str], source: str,
              dtype, progress: bool, quantize: str = "none") -> dict:
    """Build the stacked params pytree, fetching each tensor by checkpoint name with a shape check.
    `get` may return Q8 rows (only when a group-wise `quantize` asks for them)."""
    from kernels.q8_matmul import pack
    from quantization.groupwise import dequantize_rows, pack_one, stack_packed

    if quantize not in ("none", *GROUPWISE):
        raise ValueError(f"the loader quantizes to {' or '.join(GROUPWISE)} only (got {quantize!r}); other "
                         "modes are a params transform after loading (engine/params.py)")
    groupwise = quantize in GROUPWISE
    shapes = expected_shapes(cfg)
    per_layer: dict[str, list] = {k: [] for k in shapes}
    bar = tqdm(total=cfg.num_layers * len(shapes) + 3, desc=f"loading {os.path.basename(source)}",
               unit="tensor", file=sys.stderr, disable=not progress, leave=False)
    for i in range(cfg.num_layers):
        for key, shape in shapes.items():
            arr = get(names(key, i), key, shape)
            if arr is None:
                raise ModelLoadError(f"{source}: missing tensor {names(key, i)} (expected shape {shape})")
            if groupwise and key in _LINEARS:
                per_layer[key].append(pack(*_q8_rows(arr)))  # packed now: the unpacked rows go at once
            else:
                per_layer[key].append(arr.T if _LAYER_TENSORS[key][2] else arr)
            bar.update()
    params: dict = {"layers": {}}
    for k in list(per_layer):  # pop: each layer's host copies go as soon as its stack exists
        v = per_layer.pop(k)
        if groupwise and k in _LINEARS:
            n_out, n_in = shapes[k]
            params["layers"][k] = stack_packed(v, n_in, n_out, quantize)
        else:
            params["layers"][k] = _device(np.stack(v), dtype)
        del v
    for key, shape in (("embed", (cfg.vocab_size, cfg.hidden_size)), ("final_norm", (cfg.hidden_size,))):
        arr = get(top[key], key, shape)
        if arr is None:
            raise ModelLoadError(f"{source}: missing tensor {top[key]} (expected shape {shape})")
        if isinstance(arr, tuple):  # a Q8_0 embedding: the int8 rows are the tied LM head as they are
            if cfg.tie_embeddings:
                params["lm_head"] = pack_one(arr, quantize)
            arr = dequantize_rows(*arr)
        elif key == "embed" and groupwise and cfg.tie_embeddings:
            params["lm_head"] = pack_one(_q8_rows(arr), quantize)
        params[key] = _device(arr, dtype)
        del arr
        bar.update()
    if not cfg.tie_embeddings:
        arr = get(top["lm_head"], "lm_head", (cfg.vocab_size, cfg.hidden_size))
        if arr is None:
            raise ModelLoadError(f"{source}: missing tensor {top['lm_head']} (the model does not tie embeddings)")
        if groupwise:
            params["lm_head"] = pack_one(_q8_rows(arr), quantize)
        else:
            params["lm_head"] = _device(arr.T, dtype)
    bar.update()
    bar.close()
    trim_host_heap()
    return params


def _check_shape(source: str, name: str, arr: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if tuple(arr.shape) != tuple(shape):
        raise ModelLoadError(f"{source}: tensor {name} has shape {tuple(arr.shape)}, expected {tuple(shape)}")
    if not np.issubdtype(arr.dtype, np.floating) and arr.dtype.name != "bfloat16":
        raise ModelLoadError(f"{source}: tensor {name} has dtype {arr.dtype}, expected a float type")
    return arr


# ---- HF directory ------------------------------------------------------------------------------

def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from None
        return [os.path.join(path, f) for f in sorted(set(weight_map.values()))]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files found")
    return [os.path.join(path, f) for f in files]


def _iter_safetensors(files: list[str]) -> Iterator[tuple[str, str, np.ndarray]]:
    from safetensors import SafetensorError, safe_open

    for file in files:
        try:
            with safe_open(file, framework="flax") as f:
                for name in f.keys():
                    yield file, name, np.asarray(f.get_tensor(name).astype("float32"))
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{file}: cannot read safetensors file ({e})") from None


def load_hf_dir(path: str, *, dtype="float32", progress: bool = False,
                quantize: str = "none") -> tuple[ModelConfig, dict]:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ModelLoadError(f"{path}: no config.json (expected an HF model directory)")
    cfg = ModelConfig.from_hf_json(cfg_path)
    tensors: dict[str, tuple[str, np.ndarray]] = {}
    for file, name, arr in _iter_safetensors(_safetensors_files(path)):
        tensors[name] = (file, arr)

    def get(name: str, key: str, shape: tuple[int, ...]) -> np.ndarray | None:
        if name not in tensors:
            return None
        file, arr = tensors[name]
        return _check_shape(file, name, arr, shape)

    def names(key: str, i: int) -> str:
        return f"model.layers.{i}.{_LAYER_TENSORS[key][0]}"

    top = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}
    return cfg, _assemble(cfg, get, names, top, path, dtype, progress, quantize)


# ---- GGUF --------------------------------------------------------------------------------------

def read_gguf(path: str):
    """Open a GGUF file, turning the reader's low-level failures into one clear error."""
    import gguf

    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: no such file")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def gguf_metadata(reader) -> dict:
    meta = {}
    for key, field in reader.fields.items():
        try:
            meta[key] = field.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"GGUF metadata field {key} is corrupt ({e})") from None
    return meta


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert-time Q/K row permutation (interleaved -> rotate-half RoPE layout)."""
    out_dim = w.shape[0]
    return (w.reshape(n_heads, out_dim // n_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _gguf_q8_rows(t, shape: tuple[int, ...]) -> Q8Rows | None:
    """A Q8_0, Q4_0, Q4_1 or Q4_K tensor as Q8 rows without rounding anything; None for other types."""
    import gguf

    from quantization.groupwise import from_q4_0_blocks, from_q4_1_blocks, from_q4_k_blocks, from_q8_0_blocks

    decode = {gguf.GGMLQuantizationType.Q8_0: from_q8_0_blocks,
              gguf.GGMLQuantizationType.Q4_0: from_q4_0_blocks,
              gguf.GGMLQuantizationType.Q4_1: from_q4_1_blocks,
              gguf.GGMLQuantizationType.Q4_K: from_q4_k_blocks}.get(t.tensor_type)
    if decode is None or len(shape) != 2:
        return None
    return decode(np.asarray(t.data).reshape(shape[0], -1), shape[1])


def load_gguf(path: str, *, dtype="float32", progress: bool = False,
              quantize: str = "none") -> tuple[ModelConfig, dict]:
    import gguf

    reader = read_gguf(path)
    meta = gguf_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    cfg = ModelConfig.from_gguf_metadata(meta, has_output_tensor="output.weight" in tensors)
    permute = meta.get("general.architecture") == "llama"

    def get(name: str, key: str, shape: tuple[int, ...]) -> np.ndarray | None:
        t = tensors.get(name)
        if t is None:
            return None
        logical = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims innermost first
        if logical != tuple(shape):
            raise ModelLoadError(f"{path}: tensor {name} has shape {logical}, expected {tuple(shape)}")
        if quantize in GROUPWISE and key in (*_LINEARS, "embed", "lm_head"):
            rows = _gguf_q8_rows(t, shape)
            if rows is not None:
                if not all(np.isfinite(v).all() for v in rows[1:]):
                    raise ModelLoadError(f"{path}: tensor {name} has NaN or infinite block scales (corrupt file?)")
                if permute and key in ("wq", "wk"):
                    heads = cfg.num_heads if key == "wq" else cfg.num_kv_heads
                    rows = tuple(_unpermute_rope(v, heads) for v in rows)
                return rows
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        except (ValueError, NotImplementedError, TypeError) as e:
            raise ModelLoadError(
                f"{path}: tensor {name} ({t.tensor_type.name}, shape {tuple(shape)}) cannot be decoded: {e}"
            ) from None
        if not np.isfinite(arr).all():
            raise ModelLoadError(f"{path}: tensor {name} contains NaN or infinite values (corrupt file?)")
        if permute and key in ("wq", "bq"):
            arr = _unpermute_rope(arr, cfg.num_heads)
        elif permute and key in ("wk", "bk"):
            arr = _unpermute_rope(arr, cfg.num_kv_heads)
        return arr

    def names(key: str, i: int) -> str:
        return f"blk.{i}.{_LAYER_TENSORS[key][1]}"

    top = {"embed": "token_embd.weight", "final_norm": "output_norm.weight", "lm_head": "output.weight"}
    return cfg, _assemble(cfg, get, names, top, path, dtype, progress, quantize)


def load_model(path: str, *, dtype="float32", progress: bool = False,
               quantize: str = "none") -> tuple[ModelConfig, dict]:
    """Load an HF directory or a .gguf file (quantize="q8_0"/"q8_0-a16": linear weights as group-wise int8)."""
    if os.path.isdir(path):
        return load_hf_dir(path, dtype=dtype, progress=progress, quantize=quantize)
    if path.endswith(".gguf") or os.path.isfile(path):
        return load_gguf(path, dtype=dtype, progress=progress, quantize=quantize)
    raise ModelLoadError(f"{path}: not a directory or a .gguf file")
