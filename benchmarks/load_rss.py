"""Peak host memory of loading a real-size HF checkpoint into group-wise int8.

`write DIR --preset NAME`: an HF directory of the preset's shape with random bf16 weights, written
tensor by tensor (never the model in RAM), sharded like HF's, with the synthetic tokenizer.
`load DIR --quantize q8_0-a16`: models.loader.load_model in this process, then its peak RSS
(getrusage) against the bytes of the loaded weights (int8 linears and embedding rows with their scales,
float rest).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import struct
import sys
import time

import ml_dtypes
import numpy as np

SHARD_BYTES = 4 << 30
BLOCK = 1 << 24  # random values drawn once; each tensor is a window of them at a random offset


def _hf_shapes(cfg) -> dict[str, tuple[int, ...]]:
    from slipstream.models.architectures import build_abstract
    from flax import nnx

    model = build_abstract(cfg)
    flat = {".".join(map(str, p)): v.get_value().shape for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    shapes = {}
    for w in type(model).WEIGHTS:
        if w.path not in flat:
            continue
        shape = flat[w.path]
        one = shape[1:] if w.per_layer else shape
        stored = tuple(reversed(one)) if w.linear else tuple(one)
        for i in range(cfg.num_layers if w.per_layer else 1):
            shapes[w.hf.format(i=i)] = stored
    return shapes


def write(path: str, preset: str) -> None:
    from slipstream.models.config import ModelConfig
    from slipstream.models.dummy_tokenizer import synthetic_tokenizer
    from slipstream.models.registry import PRESET_DIR

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(PRESET_DIR, f"{preset}.json")) as f:
        raw = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f, indent=1)
    cfg = ModelConfig.from_hf_dict(raw)
    tok = synthetic_tokenizer(cfg)
    tok._hf.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": tok.bos_token, "eos_token": tok.eos_token, "add_bos_token": tok.add_bos,
                   "chat_template": tok.chat_template}, f)
    shards, current, size = [], [], 0
    for name, shape in _hf_shapes(cfg).items():
        nbytes = int(np.prod(shape)) * 2
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append((name, shape))
        size += nbytes
    shards.append(current)
    rng = np.random.default_rng(0)
    block = (rng.standard_normal(2 * BLOCK, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    weight_map = {}
    for s, tensors in enumerate(shards):
        file = f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for name, shape in tensors:
            nbytes = int(np.prod(shape)) * 2
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = file
        head = json.dumps(header).encode()
        head += b" " * (-len(head) % 8)
        with open(os.path.join(path, file), "wb") as f:
            f.write(struct.pack("<Q", len(head)) + head)
            for name, shape in tensors:
                count = int(np.prod(shape))
                if name.endswith("norm.weight"):
                    f.write(np.ones(count, ml_dtypes.bfloat16).tobytes())
                    continue
                for start in range(0, count, BLOCK):  # a tensor is written a window of BLOCK at a time
                    n = min(BLOCK, count - start)
                    at = int(rng.integers(0, BLOCK))
                    f.write(block[at:at + n].tobytes())
        print(f"wrote {file} ({offset / 2**30:.2f} GiB)", file=sys.stderr, flush=True)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def load(path: str, quantize: str) -> dict:
    from flax import nnx

    from slipstream.models.loader import load_model
    from slipstream.quantization import QuantizedWeight
    from slipstream.quantization.groupwise import QuantizedTable

    start = time.perf_counter()
    cfg, model = load_model(path, quantize=quantize)
    seconds = time.perf_counter() - start
    int8 = other = 0
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = var.get_value()
        quantized = isinstance(value, QuantizedWeight | QuantizedTable)  # linears; the embedding's int8 rows
        leaves = [value.q, value.scale] + ([value.offset] if value.offset is not None else []) \
            if quantized else [value]
        nbytes = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in leaves)
        if quantized:
            int8 += nbytes
        else:
            other += nbytes
    head = model.lm_head.w.get_value() if model.lm_head is not None else None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = {"load_s": round(seconds, 1), "peak_rss_gib": peak / 2**30, "int8_weight_gib": int8 / 2**30,
           "float_weight_gib": other / 2**30, "all_weight_gib": (int8 + other) / 2**30,
           "peak_over_int8": peak / int8, "peak_over_all_weights": peak / (int8 + other),
           "tied_head": head is not None and cfg.tie_embeddings}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write")
    w.add_argument("path")
    w.add_argument("--preset", default="llama-3.1-8b")
    ld = sub.add_parser("load")
    ld.add_argument("path")
    ld.add_argument("--quantize", default="q8_0-a16")
    args = p.parse_args(argv)
    if args.command == "write":
        write(args.path, args.preset)
    else:
        print(json.dumps(load(args.path, args.quantize), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
