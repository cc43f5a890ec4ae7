"""A lower bound on TTFT p90 for the serving benchmark's first wave, from this machine's prefill speed.

When `concurrency` prompts of `input_len` tokens arrive at once, the k-th prompt to get its first
token cannot do so before k * input_len / X seconds, X being the best prefill throughput (tok/s):
each prompt's tokens must all be computed first, whatever the schedule. The other requests of the
run only add values, so the run's p90 (numpy's linear percentile over `num_prompts` TTFTs, as the
bench client computes it) is at least the interpolation of the first wave's matching order
statistics. X is taken twice: measured (one pure prefill step of the engine) and an upper limit
(the model's matmul FLOPs per token at XLA's measured dot throughput for the model's shapes).
Each is timed by the wall clock and by the process's CPU time spread over every core: on a shared
host the second is what a quiet machine would at best reach (perfect scaling, no other load), so
the bound uses it.

    .venv/bin/python -m benchmarks.ttft_bound [--quantize none] [--input-len 256] [--concurrency 32]
        [--num-prompts 128] [--old-p90-ms 11601] [--xla-f32-dots]

f32 weights run on the native f32 matmul (engine/layer_stack.StackedF32) where it is built;
--xla-f32-dots keeps them as per-layer buffers for XLA's dots (the engine before that kernel).

Measured (AMD EPYC, 2 cores, f32, load ~2; --old-p90-ms 11601, old main's quiet p90): pure 256-token
prefill step CPU/cores 352 ms (728 tok/s); layer matmuls alone 294 ms = 185 GFLOP/s, 79% of the
cores' f32 FMA peak (235 GFLOP/s, benchmarks/fma_peak.c). p90 >= 19.3 x 352 = 6790 ms > 5800 ms
(0.5x old); with nothing but XLA's matmuls 5676 ms, and at the FMA peak 4470 ms.
2026-11-30 18:30 UTC, the same machine, one after the other (CPU/cores): with --xla-f32-dots the
step is 310 ms (p90 >= 5976 ms, out of reach); with the native f32 matmul's stacks 284 ms = 902
tok/s (p90 >= 5481 ms: not excluded). A second pair at 18:50 UTC: 309 -> 291 ms (p90 bound 5956 ->
5611 ms). The layer matmuls alone: XLA 268-281 ms (82-86% of the peak), the native kernel 256-261
ms (89-90%).
"""
from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.startup_bench import cpu_model
from engine.api import SlotState, StepBatch, StepSeq
from engine import layer_stack, runner
from engine.request import SamplingParams
from engine.runner import EngineConfig, JaxEngine
from kernels import f32_matmul as f32
from models.layers import linear
from models.loader import load_model
from models.registry import DEFAULT_MODEL, resolve_model

def first_wave_p90_bound(seconds_per_prompt: float, concurrency: int, num_prompts: int,
                         q: float = 90.0) -> float:
    """Least p90 of num_prompts TTFTs when the first wave's k-th prompt cannot finish before
    k * seconds_per_prompt: the j-th largest of all is at least the j-th largest of the wave."""
    pos = q / 100 * (num_prompts - 1)              # numpy's linear interpolation, 0-based ascending
    lo, frac = math.floor(pos), pos - math.floor(pos)

    def at_least(i: int) -> float:                 # 0-based ascending index -> bound
        rank_from_top = num_prompts - i            # 1 = the largest
        k = concurrency - rank_from_top + 1        # that rank within the wave
        return max(0, k) * seconds_per_prompt

    return at_least(lo) + frac * (at_least(min(lo + 1, num_prompts - 1)) - at_least(lo))


def fma_peak_gflops(threads: int) -> float | None:
    """This machine's f32 FMA peak over `threads` cores (benchmarks/fma_peak.c, per CPU-second); None
    without a C compiler."""
    import shutil
    import subprocess
    import tempfile

    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "fma_peak")
        src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fma_peak.c")
        subprocess.run([cc, "-O2", "-march=native", "-pthread", src, "-o", exe], check=True)
        return float(subprocess.run([exe, str(threads)], check=True, capture_output=True, text=True).stdout)


def timed(fn, reps: int) -> tuple[float, float]:
    """(median wall seconds, CPU seconds per call / cores): the second ignores other processes."""
    jax.block_until_ready(fn())
    times = []
    cpu = time.process_time()
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times), (time.process_time() - cpu) / reps / (os.cpu_count() or 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--quantize", default="none", help="weights (the matmul peak needs float ones)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--old-p90-ms", type=float, default=None, help="the baseline's TTFT p90, for the 0.5x target")
    p.add_argument("--xla-f32-dots", action="store_true",
                   help="f32 weights as per-layer buffers for XLA's dots, not the native f32 matmul's stacks")
    args = p.parse_args(argv)
    n = args.input_len
    if args.xla_f32_dots:
        runner.split_linears = lambda model, **kw: layer_stack.split_linears(model, **kw, stack_f32=False)
    cfg, params = load_model(resolve_model(args.model))
    engine = JaxEngine(cfg, params, EngineConfig(max_slots=1, max_seq_len=max(2 * n, 512), num_pages=64,
                                                 max_num_batched_tokens=n, quantize=args.quantize))
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(3, engine.vocab_size, n)]
    engine.insert(0, SlotState(prompt, [], SamplingParams(temperature=0.0)))
    pages = list(range(1, 1 + -(-n // engine.page_size)))
    step = lambda: engine.step(StepBatch([StepSeq(0, prompt, 0, pages, True)]))  # noqa: E731
    step_s, step_cpu_s = timed(step, args.reps)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults  # first touches of fresh memory

    # XLA's dot throughput on the model's own shapes: every layer's matmuls at n rows (random weights of
    # the declared shapes: a dot's speed does not depend on the values)
    d, q, kv, mlp = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    shapes = [(d, q), (d, kv), (d, kv), (q, d), (d, mlp), (d, mlp), (mlp, d)] * cfg.num_layers
    weights = [jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02) for shape in shapes]
    flops_per_token = sum(2 * k * m for k, m in shapes)

    @jax.jit
    def matmuls(weights, inputs):
        # independent dots, each reduced to a scalar: little but the matmuls is timed
        return jnp.stack([linear(inputs[w.shape[0]], w).sum() for w in weights])

    inputs = {k: jnp.asarray(rng.standard_normal((n, k), np.float32)) for k in {k for k, _ in shapes}}
    dot_s, dot_cpu_s = timed(lambda: matmuls(weights, inputs), args.reps)
    wq = engine.params["blocks"]["attn"]["wq"]["w"].get_value()
    f32_path = "native f32 matmul (StackedF32)" if isinstance(wq, layer_stack.StackedF32) else type(wq).__name__
    native_line = None
    if f32.native_available():
        # the native kernel on the engine's fused shapes (q/k/v, o, gate/up, down), stacks read at the
        # layer index, one layer after another: each output is written whole and dies before the next
        fused = [(d, q + 2 * kv), (q, d), (d, 2 * mlp), (mlp, d)]
        stacks = [jnp.asarray(f32.pack(rng.standard_normal((cfg.num_layers, k, m), np.float32) * 0.02))
                  for k, m in fused]

        @jax.jit
        def native(stacks, inputs):
            total = jnp.zeros((), jnp.float32)
            for layer in range(cfg.num_layers):
                for (k, m), packed in zip(fused, stacks):
                    y = f32.f32_matmul(inputs[k] + total * 0.0, packed, n=m, layer=layer)
                    total = total + jax.lax.optimization_barrier(y).sum()
            return total

        inputs.update({k: jnp.asarray(rng.standard_normal((n, k), np.float32)) for k, _ in fused if k not in inputs})
        native_line = timed(lambda: native(stacks, inputs), args.reps)
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; weights {engine.weight_mode}, f32 linears: {f32_path}; "
          f"jax {jax.__version__}; load {os.getloadavg()}")
    print(f"pure {n}-token prefill step: wall {step_s * 1e3:.0f} ms = {n / step_s:.0f} tok/s; CPU/cores "
          f"{step_cpu_s * 1e3:.0f} ms = {n / step_cpu_s:.0f} tok/s "
          f"({flops_per_token * n / step_cpu_s / 1e9:.0f} GFLOP/s of layer matmuls); {faults} page faults per step")
    print(f"layer matmuls alone at {n} rows ({flops_per_token / 1e6:.0f} MFLOP/token): wall {dot_s * 1e3:.0f} ms "
          f"= {flops_per_token * n / dot_s / 1e9:.0f} GFLOP/s; CPU/cores {dot_cpu_s * 1e3:.0f} ms = "
          f"{flops_per_token * n / dot_cpu_s / 1e9:.0f} GFLOP/s = {n / dot_cpu_s:.0f} tok/s")
    if native_line:
        nat_s, nat_cpu_s = native_line
        print(f"the same matmuls on the native f32 kernel (fused, stacked): wall {nat_s * 1e3:.0f} ms = "
              f"{flops_per_token * n / nat_s / 1e9:.0f} GFLOP/s; CPU/cores {nat_cpu_s * 1e3:.0f} ms = "
              f"{flops_per_token * n / nat_cpu_s / 1e9:.0f} GFLOP/s = {n / nat_cpu_s:.0f} tok/s")
    peak = fma_peak_gflops(os.cpu_count() or 1)
    bounds = [("prefill step", step_cpu_s), ("XLA's matmuls", dot_cpu_s)]
    if native_line:
        bounds.append(("native f32 matmuls", native_line[1]))
    if peak:
        print(f"f32 FMA peak of {os.cpu_count()} cores (benchmarks/fma_peak.c): {peak:.0f} GFLOP/s; XLA's dots reach "
              f"{flops_per_token * n / dot_cpu_s / 1e9 / peak:.0%} of it"
              + (f", the native kernel's {flops_per_token * n / native_line[1] / 1e9 / peak:.0%}" if native_line else "")
              + f", the whole prefill step {flops_per_token * n / step_cpu_s / 1e9 / peak:.0%}")
        bounds.append(("matmuls at the FMA peak", flops_per_token * n / (peak * 1e9)))
    # seconds per prompt at best: CPU time over all cores (a quiet machine, perfect scaling)
    for label, per_prompt in bounds:
        bound = first_wave_p90_bound(per_prompt, args.concurrency, args.num_prompts)
        line = (f"{label}: {per_prompt * 1e3:.0f} ms per prompt -> TTFT p90 over {args.num_prompts} requests "
                f">= {bound * 1e3:.0f} ms")
        if args.old_p90_ms:
            target = 0.5 * args.old_p90_ms
            line += (f"; target 0.5 x {args.old_p90_ms:.0f} = {target:.0f} ms is "
                     f"{'out of reach' if bound * 1e3 > target else 'not excluded'}")
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
