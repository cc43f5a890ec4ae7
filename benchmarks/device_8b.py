"""Llama-3.1-8B with dummy int8 weights on one TPU v5e (15.7 GiB): benchmarks/device with the sizes that
fit the chip and a 10-minute call, in two parts (each one call):

    python -m benchmarks.device_8b engine    # HBM, matmuls, decode at 1 and 64 slots x 1k context, 2048 prefill
    python -m benchmarks.device_8b serving   # slipstream serve over a unix socket under slipstream bench

int8 weights (8.7 GB of linears, scale and offset per 32 inputs, plus a 0.66 GB int8 head and the 1 GB bf16
embedding) leave about 6 GB: the KV cache is int8 (67.6 kB a token; bf16 would need 9.4 GB for 64 x 1k).
Serving: 64 prompts of 512 random tokens in, 256 out, all 64 at once (one wave: about 256 steps after
the prefill, ~4 minutes at a few hundred ms a step; 1024/1024 would not finish in the call).
`--dry-run` runs the same parts on this machine's CPU with a shrunk 8B config and tiny sizes.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

from benchmarks import device

MODEL = ["--model", "llama-3.1-8b", "--load-format", "dummy", "--quantize", "int8", "--dtype", "bfloat16",
         "--kv-cache-dtype", "int8"]
ENGINE = ["--phases", "hbm,matmul,engine", "--slots", "1,64", "--context", "1024", "--prefill-tokens", "2048",
          "--steps", "5", "--warmup", "2", "--matmul-m", "1,64,2048", "--matmul-layers", "4", "--phase-timeout", "540"]
SERVING = {"prompts": 64, "concurrency": 64, "input_len": 512, "output_len": 256, "batched_tokens": 1024,
           "page_size": 128, "timeout": 540}
# the dry run: a 2-layer, 64-wide Llama-3.1-8B (its vocabulary and heads' ratio kept) and minimal sizes (an
# 8-token budget: 4 step programs to compile; one matmul row count, the prefill's)
DRY_ENGINE = ["--phases", "hbm,matmul,engine", "--slots", "1,3", "--context", "24", "--prefill-tokens", "8",
              "--steps", "2", "--warmup", "1", "--matmul-m", "8", "--matmul-layers", "2", "--hbm-bytes",
              str(8 << 20)]
DRY_SERVING = {"prompts": 4, "concurrency": 2, "input_len": 16, "output_len": 8, "batched_tokens": 32,
               "page_size": 16, "timeout": 300}


def kv_bytes_per_token(config_path: str) -> int:
    """int8 K and V of one token over all layers, with their f32 scales (as the engine sizes pages)."""
    from slipstream.engine.kv_cache import kv_bytes_per_token as per_token

    with open(config_path) as f:
        cfg = json.load(f)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return per_token(num_layers=cfg["num_hidden_layers"], n_kv_heads=cfg.get("num_key_value_heads", heads),
                     head_dim=head_dim, dtype_bytes=1, scale_bytes=4)


def serving_args(model: list[str], sizes: dict, config_path: str) -> list[str]:
    """The serving part: the server's KV pages sized for every concurrent sequence's whole length."""
    length = sizes["input_len"] + sizes["output_len"] + 1
    page = sizes["page_size"]
    tokens = sizes["concurrency"] * (-(-length // page) + 1) * page
    flags = (f"--kv-cache-memory {tokens * kv_bytes_per_token(config_path)} "
             f"--max-num-batched-tokens {sizes['batched_tokens']}")
    return [*model, "--phases", "serving", "--page-size", str(page), "--serving-prompts", str(sizes["prompts"]),
            "--serving-concurrency", str(sizes["concurrency"]), "--serving-input-len", str(sizes["input_len"]),
            "--serving-output-len", str(sizes["output_len"]), "--phase-timeout", str(sizes["timeout"]),
            "--serve-flags", flags]


def shrunk_preset(folder: str) -> str:
    """Llama-3.1-8B's config with 2 layers of width 64 (4 query heads over 1 KV head), in `folder`."""
    from slipstream.models.registry import PRESET_DIR

    with open(os.path.join(PRESET_DIR, "llama-3.1-8b.json")) as f:
        cfg = json.load(f)
    cfg.update(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=1, head_dim=16)
    path = os.path.join(folder, "llama-3.1-8b-shrunk")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", choices=["engine", "serving"])
    p.add_argument("--dry-run", action="store_true", help="on this machine's CPU: a shrunk 8B config, tiny sizes")
    p.add_argument("--serving-concurrency", type=int, default=None,
                   help="sequences at once (and prompts), if 64 does not fit")
    p.add_argument("--output-dir", default=None, help="default: $OUT/PART if OUT is set, else ./device-8b/PART")
    args = p.parse_args(argv)
    out = args.output_dir or os.path.join(os.environ.get("OUT") or "device-8b", args.part)
    model, engine, sizes = MODEL, ENGINE, dict(SERVING)
    work = tempfile.mkdtemp(prefix="device-8b-") if args.dry_run else None
    try:
        if work:
            model, engine, sizes = ["--model", shrunk_preset(work), *MODEL[2:]], DRY_ENGINE, dict(DRY_SERVING)
        if args.serving_concurrency:
            sizes.update(concurrency=args.serving_concurrency, prompts=args.serving_concurrency)
        from slipstream.models.registry import resolve_model

        config = resolve_model(model[1], "dummy")
        part = [*model, *engine] if args.part == "engine" else serving_args(model, sizes, config)
        print("python -m benchmarks.device " + " ".join(part), flush=True)
        return device.main([*part, "--output-dir", out])
    finally:
        if work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
