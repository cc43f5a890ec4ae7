"""In-process A/B of KV cache dtypes on the default model: one engine per dtype, the same weights, and
their steps timed round-robin (so both see the same background load): decode steps at 1 and 32 slots
(context 384), a 256-token prefill, and a mixed step (31 decodes + a 256-token prompt). Prints each
step's median and the median per-rep time ratio of each dtype to the first. Run from the repo root,
serialized with other timing runs:
    .venv/bin/python -m benchmarks.kv_dtype_ab [--quantize q8_0-a16] [--kv-dtypes float32,bfloat16] [--reps 15]

Measured 2026-12-03, AMD EPYC (Zen 4, 2 cores), `--quantize q8_0-a16`, bf16 against f32 K/V: with bf16 K
rows widened into a buffer, decode at 32 slots 0.925x, prefill 0.955x, mixed 0.980x, one slot 1.03x;
with bf16 K word-major (kernels/attention.py's layout), in a slower phase of the VM (f32 decode at 32
slots 104 ms instead of 70): decode at 32 slots 0.880x, prefill 0.995x, mixed 0.968x, one slot 1.028x.
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np

from benchmarks import engine_bench as eb
from benchmarks.engine_roofline import interleaved
from benchmarks.startup_bench import cpu_model
from models.loader import load_model
from models.registry import resolve_model


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quantize", default="q8_0-a16")
    p.add_argument("--kv-dtypes", default="float32,bfloat16", help="comma-separated; the first is the baseline")
    p.add_argument("--reps", type=int, default=15)
    args = p.parse_args(argv)
    kvs = args.kv_dtypes.split(",")
    bench_args = eb.parse_args(["--quantize", args.quantize, "--slots", "32", "--prefill-lengths", "256",
                                "--max-num-batched-tokens", "288"])
    cfg, params = load_model(resolve_model(bench_args.model), quantize=args.quantize)
    print(f"CPU: {cpu_model()}; quantize={args.quantize}; context {bench_args.context}", flush=True)
    prompt = [int(t) for t in np.random.default_rng(1).integers(3, cfg.vocab_size, 256)]
    steps = {}
    for kv in kvs:
        bench_args.kv_cache_dtype = kv
        setup = eb.build(cfg, params, bench_args)
        eb.fill(setup, seed=0)
        chunk = eb.StepSeq(setup.engine.max_slots - 1, prompt, 0, setup.pages[-1], True)

        def decode(setup=setup, n=32):
            setup.engine.step(eb.StepBatch(eb.decodes(setup, n)))

        steps[f"{kv} decode1"] = lambda decode=decode: decode(n=1)
        steps[f"{kv} decode32"] = decode
        steps[f"{kv} prefill256"] = lambda setup=setup, chunk=chunk: setup.engine.step(eb.StepBatch([chunk]))
        steps[f"{kv} mixed31+256"] = lambda setup=setup, chunk=chunk: setup.engine.step(
            eb.StepBatch([*eb.decodes(setup, 31), chunk]))
    times = interleaved(steps, reps=args.reps, warmup=2)
    for name, t in times.items():
        print(f"{name:28} median {statistics.median(t) * 1e3:8.2f} ms (quartiles {np.percentile(t, 25) * 1e3:.2f}"
              f"-{np.percentile(t, 75) * 1e3:.2f})")
    for kind in ("decode1", "decode32", "prefill256", "mixed31+256"):
        for kv in kvs[1:]:
            ratio = np.asarray(times[f"{kv} {kind}"]) / np.asarray(times[f"{kvs[0]} {kind}"])
            print(f"{kind:12} {kv}/{kvs[0]}: median per-rep time ratio {np.median(ratio):.3f}")


if __name__ == "__main__":
    main()
