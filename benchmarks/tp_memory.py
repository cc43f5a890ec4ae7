"""Per-device bytes of weights and KV pages under tensor parallelism, on virtual CPU devices; with
--check, also whether greedy tokens at each TP equal TP=1's.

    flock /tmp/slipstream-bench.lock .venv/bin/python -m benchmarks.tp_memory [--model PATH] [--check 16]

The KV cache is the same number of pages at every TP (what TP=1 gets from --kv-cache-memory), so the
columns compare like for like; the engine itself budgets --kv-cache-memory per device.

Measured (AMD EPYC, 8 virtual CPU devices, jax 0.10.2; `--tp 1,2,3,4 --check 12`, 1092 pages = 768 MiB
of f32 KV). The default model, SmolLM2-135M, has 9 query heads over 3 KV heads: at TP=3 the heads
split (one KV head per device); at TP=2 and 4 they do not divide, so attention and the KV cache stay
whole on every device and only the MLP and the vocabulary split.

    weights   TP  KV layout   weights MiB/device  KV MiB/device  total MiB/device  greedy == TP=1
    f32        1  -                        513.1          767.8            1280.9  True
    f32        2  replicated               307.3          767.8            1075.1  True
    f32        3  split                    171.1          255.9             427.1  True
    f32        4  replicated               204.3          767.8             972.1  True
    q8_0-a16   1  -                        265.1          767.8            1032.9  True
    q8_0-a16   2  replicated               148.4          767.8             916.2  True
    q8_0-a16   3  split                     88.4          255.9             344.4  True
    q8_0-a16   4  replicated                90.1          767.8             857.9  True
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before JAX starts

import argparse  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.startup_bench import cpu_model  # noqa: E402
from engine.kv_cache import kv_bytes_per_token, num_pages_for_budget  # noqa: E402
from engine.runner import EngineConfig, JaxEngine  # noqa: E402
from engine.sharding import device_bytes  # noqa: E402
from models.loader import load_model  # noqa: E402
from models.registry import DEFAULT_MODEL, resolve_model  # noqa: E402

MiB = 1 << 20


def greedy(engine: JaxEngine, prompt: list[int], n: int) -> list[int]:
    from engine.api import SlotState, StepBatch, StepSeq
    from engine.request import SamplingParams

    pages = list(range(1, 1 + -(-(len(prompt) + n) // engine.page_size)))
    engine.insert(0, SlotState(prompt, [], SamplingParams(temperature=0.0)))
    out: list[int] = []
    row = StepSeq(0, prompt, 0, pages, True)
    for _ in range(n):
        out.append(engine.step(StepBatch([row]))[0].token_id)
        row = StepSeq(0, [out[-1]], len(prompt) + len(out) - 1, pages, True)
    engine.free(0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--tp", default="1,2,4")
    p.add_argument("--quantize", default="none,q8_0-a16")
    p.add_argument("--kv-cache-memory", type=int, default=768 * MiB, help="bytes of f32 KV at TP=1")
    p.add_argument("--check", type=int, default=0, help="greedy tokens to compare with TP=1 (0: none)")
    args = p.parse_args()
    print(f"CPU: {cpu_model()}; {len(jax.devices())} virtual devices; jax {jax.__version__}")
    path = resolve_model(args.model)
    prompt = [int(t) for t in np.random.default_rng(0).integers(100, 1000, 24)]
    for mode in args.quantize.split(","):
        cfg, model = load_model(path, quantize=mode)
        num_pages = num_pages_for_budget(args.kv_cache_memory, page_size=16, bytes_per_token=kv_bytes_per_token(
            num_layers=cfg.num_layers, n_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype_bytes=4))
        print(f"\n{os.path.basename(path)}: {cfg.num_heads} heads over {cfg.num_kv_heads} KV heads, "
              f"MLP {cfg.intermediate_size}, vocab {cfg.vocab_size}; weights {mode}; {num_pages} KV pages of 16")
        print(f"{'TP':>3} {'KV layout':>10} {'weights MiB/device':>19} {'KV MiB/device':>14} {'total MiB/device':>17}"
              + ("  greedy == TP=1" if args.check else ""))
        first = None
        for tp in map(int, args.tp.split(",")):
            engine = JaxEngine(cfg, model, EngineConfig(quantize=mode, tensor_parallel=tp, num_pages=num_pages,
                                                        max_slots=1, max_num_batched_tokens=32, max_seq_len=256),
                               precompile=False)
            dev = str(jax.devices()[0])
            weights, kv = device_bytes(engine.params)[dev], device_bytes(engine.cache)[dev]
            layout = engine.tp.kv_layout if engine.tp else "-"
            line = f"{tp:>3} {layout:>10} {weights / MiB:>19.1f} {kv / MiB:>14.1f} {(weights + kv) / MiB:>17.1f}"
            if args.check:
                tokens = greedy(engine, prompt, args.check)
                first = first or tokens
                line += f"  {tokens == first}"
            print(line, flush=True)
            del engine


if __name__ == "__main__":
    main()
