"""Checkpoint loaders: an HF directory (config.json + safetensors, sharded or not) or a GGUF file.

Both produce (ModelConfig, model): the architecture's NNX module (models/architectures.py) with every
weight its declaration (the class's WEIGHTS) names, linears [in, out], layers stacked on a leading
axis. Errors name the file, the tensor and the expected shape.
With quantize="q8_0" (or "q8_0-a16") the linear weights, the LM head and the embedding's lookup
table are built as group-wise int8 one tensor at a time, so no float copy of them ever exists; GGUF
Q8_0/Q4_0/Q4_1/Q4_K blocks convert exactly, other types are rounded to Q8_0. A sparse MoE's experts
(any quantized mode, either format) are rounded to per-channel int8 one expert at a time as they are read.
"""
from __future__ import annotations

import functools
import json
import os
import sys
from typing import Callable

import numpy as np
from tqdm import tqdm

from slipstream.models.base import CausalLM, Weight
from slipstream.models.config import ModelConfig
from slipstream.models.gguf_config import config_from_gguf


class ModelLoadError(ValueError):
    """A checkpoint that cannot be used: missing, corrupt, truncated or of the wrong shape."""


# A tensor handed over as group-wise int8 rows: (q int8 [out, in], d f32 [out, in/32][, offsets like d]).
Q8Rows = tuple
GROUPWISE = ("q8_0", "q8_0-a16")


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


_ROWS_AT_ONCE = 1 << 22  # weights rounded per quantize_rows call: its f32 temporaries stay ~16 MiB each


def _q8_rows(arr) -> Q8Rows:
    """A checkpoint linear [out, in], float (any dtype) or already Q8 rows -> Q8 rows. Rounded a block
    of rows at a time (each row's groups are its own), so a vocabulary-sized LM head needs no f32 copy
    of itself and of quantize_rows' temporaries next to it."""
    from slipstream.quantization.groupwise import quantize_rows

    if isinstance(arr, tuple):
        return arr
    n, k = arr.shape
    step = max(1, _ROWS_AT_ONCE // max(k, 1))
    if n <= step:
        return quantize_rows(arr)
    q = np.empty((n, k), np.int8)
    d = None
    for start in range(0, n, step):
        q_part, d_part = quantize_rows(arr[start:start + step])
        if d is None:
            d = np.empty((n, d_part.shape[1]), d_part.dtype)
        q[start:start + step], d[start:start + step] = q_part, d_part
    return q, d


# get(checkpoint name, declaration, expected checkpoint shape) -> the tensor, Q8 rows, or None; for an expert
# weight stored one tensor per layer (shape [E, out, in]), one reader per expert
Getter = Callable[[str, Weight, tuple[int, ...]], "np.ndarray | Q8Rows | None"]


def _assemble(cfg: ModelConfig, get: Getter, name_of: Callable[[Weight], str | None], source: str,
              dtype, progress: bool, quantize: str = "none"):
    """Build the architecture's module and fill each declared weight (models/base.Weight) from the
    checkpoint with a shape check; per-layer tensors are stacked [L, ...]. `get` may return Q8 rows
    (only when a group-wise `quantize` asks for them)."""
    from flax import nnx

    from slipstream.models.architectures import build_abstract
    from slipstream.models.layers import Linear
    from slipstream.quantization.groupwise import dequantize_rows, pack_one, pack_rows, stack_packed, table_from_rows

    if quantize not in ("none", *GROUPWISE):
        raise ValueError(f"the loader quantizes to {' or '.join(GROUPWISE)} only (got {quantize!r})")
    groupwise = quantize in GROUPWISE
    get = _fused_parts(cfg, get)
    model = build_abstract(cfg)
    graphdef, state = nnx.split(model)
    variables = dict(nnx.to_flat_state(state))
    declared = [w for w in type(model).WEIGHTS if tuple(w.path.split(".")) in variables]
    missing_decl = set(variables) - {tuple(w.path.split(".")) for w in declared}
    if missing_decl:  # a module weight without a declaration is a bug in the architecture file
        raise RuntimeError(f"{type(model).__name__} declares no checkpoint name for {sorted(missing_decl)}")
    bar = tqdm(total=sum(max(1, w.num_stacked(cfg)) * max(1, cfg.num_experts * w.experts) for w in declared),
               unit="tensor",
               desc=f"loading {os.path.basename(source)}", file=sys.stderr, disable=not progress, leave=False)
    tied_head = None
    for w in declared:
        var = variables[tuple(w.path.split("."))]
        shape = tuple(var.get_value().shape)
        if w.experts:
            var.set_value(_experts(cfg, w, shape, get, name_of(w), source, dtype, quantize != "none", bar))
            continue
        stacked = w.num_stacked(cfg)
        one = shape[1:] if stacked else shape
        stored = tuple(reversed(one)) if w.linear else one  # checkpoints hold linears [out, in]
        name = name_of(w)
        tensors = []
        for i in range(max(stacked, 1)):
            full = None if name is None else name.format(i=i)
            arr = None if full is None else get(full, w, stored)
            if arr is None:
                raise ModelLoadError(f"{source}: missing tensor {full or w.path} (expected shape {stored})")
            if w.path == "embed.table" and groupwise:
                # the lookup table as int8 rows (a Q8_0 embedding as stored: it looks up exactly),
                # dequantized per token; a tied head packs the same rows
                arr = _q8_rows(arr)
                if cfg.tie_embeddings:
                    tied_head = pack_one(arr, quantize)
            elif isinstance(arr, tuple) and not w.linear:
                arr = dequantize_rows(*arr)
            if groupwise and w.linear:  # packed now: the unpacked rows go at once
                tensors.append(pack_rows(_q8_rows(arr)) if w.per_layer else _q8_rows(arr))
            else:
                tensors.append(arr.T if w.linear else arr)
            bar.update()
        if isinstance(tensors[0], tuple) and not w.linear:
            value = table_from_rows(tensors[0])
        elif groupwise and w.linear:
            value = (stack_packed(tensors, one[0], one[1], quantize) if w.per_layer
                     else pack_one(tensors[0], quantize))
        else:
            value = _device(np.stack(tensors) if stacked else tensors[0], dtype)
        del tensors
        var.set_value(value)
    bar.close()
    model = nnx.merge(graphdef, state)
    if tied_head is not None:
        head = nnx.eval_shape(lambda: Linear(cfg.hidden_size, cfg.vocab_size, ("embed", "vocab")))
        head.w.set_value(tied_head)
        model.lm_head = head
    trim_host_heap()
    return model


def _fused_parts(cfg: ModelConfig, get: Getter) -> Getter:
    """`get` that also reads "name[part]": those rows of a fused checkpoint tensor (Phi-3's q / k / v of qkv_proj,
    gate / up of gate_up_proj), float or Q8 rows alike. The fused tensor is read once per part."""
    q, kv, f = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    spans = {"q": (0, q, q + 2 * kv), "k": (q, q + kv, q + 2 * kv), "v": (q + kv, q + 2 * kv, q + 2 * kv),
             "gate": (0, f, 2 * f), "up": (f, 2 * f, 2 * f)}  # (first row, end, rows of the fused tensor)

    def read(name: str, w: Weight, shape: tuple[int, ...]):
        if not name.endswith("]"):
            return get(name, w, shape)
        fused, part = name[:-1].split("[")
        start, stop, rows = spans[part]
        whole = get(fused, w, (rows, *shape[1:]))
        if whole is None:
            return None
        return tuple(v[start:stop] for v in whole) if isinstance(whole, tuple) else whole[start:stop]

    return read


def _experts(cfg: ModelConfig, w: Weight, shape: tuple[int, ...], get: Getter, name: str | None, source: str, dtype,
             rounded: bool, bar):
    """A sparse MoE's expert weight (quantization/experts.ExpertStack [L, E, in, out]) from one checkpoint
    tensor per layer and expert (HF) or per layer (GGUF); rounded (a quantized load): each expert to per-channel
    int8 as it is read, so the float temporaries are one expert's."""
    import jax
    import jax.numpy as jnp

    from slipstream.quantization.experts import ExpertStack, round_numpy

    layers, experts, k, n = shape
    out = np.empty(shape, np.int8 if rounded else np.dtype(jnp.dtype(dtype)))
    scale = np.empty((layers, experts, n), np.float32) if rounded else None
    # "{e}" in the name: one checkpoint tensor per expert (HF); else one per layer [E, out, in] (GGUF), which `get`
    # hands over as one reader per expert
    stacked = name is not None and "{e}" not in name
    for i in range(layers):
        if stacked:
            readers = get(name.format(i=i), w, (experts, n, k))
            if readers is None:
                raise ModelLoadError(f"{source}: missing tensor {name.format(i=i)} (expected shape {(experts, n, k)})")
        for e in range(experts):
            if stacked:
                arr = readers[e]()
            else:
                full = None if name is None else name.format(i=i, e=e)
                arr = None if full is None else get(full, w, (n, k))
                if arr is None:
                    raise ModelLoadError(f"{source}: missing tensor {full or w.path} (expected shape {(n, k)}; "
                                         "experts are read one tensor per expert, as the Hub's checkpoints and "
                                         "transformers' save_pretrained store them)")
            if rounded:
                out[i, e], scale[i, e] = round_numpy(np.asarray(arr, np.float32).T)
            else:
                out[i, e] = arr.T
            bar.update()
    if rounded:
        return ExpertStack(jax.device_put(out), jax.device_put(scale))
    return ExpertStack(_device(out, dtype))


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


def hf_names(name: str, aliases: tuple[tuple[str, str], ...]) -> list[str]:
    """A declared HF tensor name and the names the architecture's other checkpoint layouts give it."""
    return [name, *(other + name[len(prefix):] for prefix, other in aliases if name.startswith(prefix))]


def load_hf_dir(path: str, *, dtype="float32", progress: bool = False,
                quantize: str = "none") -> tuple[ModelConfig, CausalLM]:
    """Tensors are read one at a time as _assemble asks for them (models/safetensors_file.py): with a
    group-wise `quantize`, host memory holds the int8 model plus one float tensor being rounded."""
    from slipstream.models.safetensors_file import SafetensorsError, index_files

    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ModelLoadError(f"{path}: no config.json (expected an HF model directory)")
    from slipstream.models.architectures import model_class

    cfg = ModelConfig.from_hf_json(cfg_path)
    try:
        where = index_files(_safetensors_files(path))
    except SafetensorsError as e:
        raise ModelLoadError(str(e)) from None
    aliases = model_class(cfg).HF_ALIASES

    def get(name: str, w: Weight, shape: tuple[int, ...]) -> np.ndarray | None:
        name = next((n for n in hf_names(name, aliases) if n in where), None)
        if name is None:
            return None
        file = where[name]
        try:
            arr = file.read(name)
        except SafetensorsError as e:
            raise ModelLoadError(str(e)) from None
        return _check_shape(file.path, name, arr, shape)

    return cfg, _assemble(cfg, get, lambda w: w.hf, path, dtype, progress, quantize)


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

    from slipstream.quantization.groupwise import from_q4_0_blocks, from_q4_1_blocks, from_q4_k_blocks, from_q8_0_blocks

    decode = {gguf.GGMLQuantizationType.Q8_0: from_q8_0_blocks,
              gguf.GGMLQuantizationType.Q4_0: from_q4_0_blocks,
              gguf.GGMLQuantizationType.Q4_1: from_q4_1_blocks,
              gguf.GGMLQuantizationType.Q4_K: from_q4_k_blocks}.get(t.tensor_type)
    if decode is None or len(shape) != 2:
        return None
    return decode(np.asarray(t.data).reshape(shape[0], -1), shape[1])


def load_gguf(path: str, *, dtype="float32", progress: bool = False, quantize: str = "none",
              reader=None) -> tuple[ModelConfig, CausalLM]:
    """reader: the file already opened with read_gguf (the tokenizer reads the same one)."""
    import gguf

    reader = reader or read_gguf(path)
    meta = gguf_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    factors = [tensors.get(f"rope_factors_{kind}.weight") for kind in ("short", "long")]
    cfg = config_from_gguf(meta, has_output_tensor="output.weight" in tensors, rope_factors=(
        None if None in factors else tuple(np.asarray(t.data, np.float32).reshape(-1).tolist() for t in factors)))
    permute = meta.get("general.architecture") == "llama"
    # llama.cpp's converter stores Gemma's (1 + w) norm weights with the 1 added; the module adds it itself
    norm_shift = 1.0 if meta.get("general.architecture") == "gemma3" else 0.0

    def checked(name: str, shape: tuple[int, ...]):
        t = tensors.get(name)
        logical = None if t is None else tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims innermost first
        if t is not None and logical != tuple(shape):
            raise ModelLoadError(f"{path}: tensor {name} has shape {logical}, expected {tuple(shape)}")
        return t

    def dequantized(name: str, t, shape: tuple[int, ...], data=None) -> np.ndarray:
        try:
            arr = gguf.quants.dequantize(t.data if data is None else data, t.tensor_type).reshape(shape)
        except (ValueError, NotImplementedError, TypeError) as e:
            raise ModelLoadError(
                f"{path}: tensor {name} ({t.tensor_type.name}, shape {tuple(shape)}) cannot be decoded: {e}"
            ) from None
        arr = arr.astype(np.float32)
        if not np.isfinite(arr).all():
            raise ModelLoadError(f"{path}: tensor {name} contains NaN or infinite values (corrupt file?)")
        return arr

    def experts(name: str, shape: tuple[int, ...]) -> list[Callable[[], np.ndarray]] | None:
        """A layer's experts [E, out, in] as one reader per expert, each dequantizing only its expert (a float copy
        of a Qwen3-30B-A3B layer's 128 would be 0.8 GB): llama.cpp's one tensor per layer (blk.{i}.ffn_gate_exps)
        or older Mixtral files' one per expert (blk.{i}.ffn_gate.{e})."""
        one = shape[1:]
        t = checked(name, shape)
        if t is not None:
            return [functools.partial(dequantized, f"{name}[{e}]", t, one, t.data[e]) for e in range(shape[0])]
        per_expert = name.replace("_exps.weight", ".{e}.weight")
        if per_expert == name or per_expert.format(e=0) not in tensors:
            return None

        def read(full: str) -> np.ndarray:
            t = checked(full, one)
            if t is None:
                raise ModelLoadError(f"{path}: missing tensor {full} (expected shape {one}; the file stores one tensor "
                                     f"per expert from {per_expert.format(e=0)} on)")
            return dequantized(full, t, one)

        return [functools.partial(read, per_expert.format(e=e)) for e in range(shape[0])]

    def get(name: str, w: Weight, shape: tuple[int, ...]):
        if w.experts:
            return experts(name, shape)
        t = checked(name, shape)
        if t is None:
            return None
        heads = {"q": cfg.num_heads, "k": cfg.num_kv_heads}.get(w.rope_permute) if permute else None
        if quantize in GROUPWISE and (w.linear or w.path == "embed.table"):
            rows = _gguf_q8_rows(t, shape)
            if rows is not None:
                if not all(np.isfinite(v).all() for v in rows[1:]):
                    raise ModelLoadError(f"{path}: tensor {name} has NaN or infinite block scales (corrupt file?)")
                if heads:
                    rows = tuple(_unpermute_rope(v, heads) for v in rows)
                return rows
        arr = dequantized(name, t, shape)
        if norm_shift and name.endswith("norm.weight"):
            arr = arr - np.float32(norm_shift)
        return _unpermute_rope(arr, heads) if heads else arr

    return cfg, _assemble(cfg, get, lambda w: w.gguf, path, dtype, progress, quantize)


def load_model(path: str, *, dtype="float32", progress: bool = False, quantize: str = "none",
               reader=None) -> tuple[ModelConfig, CausalLM]:
    """Load an HF directory or a .gguf file (quantize="q8_0"/"q8_0-a16": linear weights as group-wise int8;
    reader: a GGUF file already opened with read_gguf)."""
    if os.path.isdir(path):
        return load_hf_dir(path, dtype=dtype, progress=progress, quantize=quantize)
    if path.endswith(".gguf") or os.path.isfile(path):
        return load_gguf(path, dtype=dtype, progress=progress, quantize=quantize, reader=reader)
    raise ModelLoadError(f"{path}: not a directory or a .gguf file")
