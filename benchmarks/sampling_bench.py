"""The engine's sampling program alone (JaxEngine._sample_step, its [slots, V] state donated as in
the engine), with the native sampling kernel and with its JAX reference, compiled in one process and
timed in alternation, per sampling setting and row count. Rows are N(0, --scale) logits over the
default model's vocab (49152); flatter rows (smaller scale) put the top-p nucleus past more tokens.
Run from the repo root:
    .venv/bin/python -m benchmarks.sampling_bench [--rows 1,32] [--scale 3] [--reps 30]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.startup_bench import cpu_model
from engine.request import SamplingParams
from engine.runner import JaxEngine
from engine.sampling import SamplingArrays
from engine.structured import mask_words
from kernels import sampling as ks

SETTINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 1": SamplingParams(temperature=1.0),
    "top_k 50": SamplingParams(temperature=1.0, top_k=50),
    "top_p 0.9": SamplingParams(temperature=1.0, top_p=0.9),
    "top_k 40 + top_p 0.95": SamplingParams(temperature=0.7, top_k=40, top_p=0.95),
    "min_p 0.05": SamplingParams(temperature=1.0, min_p=0.05),
    "greedy + logprobs 5": SamplingParams(temperature=0.0, logprobs=5),
    "repetition_penalty 1.2": SamplingParams(temperature=0.0, repetition_penalty=1.2),
}


def compiled(args, native: bool):
    """The sampling program lowered with the kernel seam's choice pinned (it is read while tracing)."""
    saved = ks.native_available
    ks.native_available = (lambda: saved()) if native else (lambda: False)
    try:
        # a fresh function: JAX reuses a traced function's program, whatever the seam answers now
        return jax.jit(lambda *a: JaxEngine._sample_step(*a), donate_argnums=(1,)).lower(*args).compile()
    finally:
        ks.native_available = saved


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,32")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--scale", type=float, default=3.0)
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args(argv)
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; load average {os.getloadavg()}; "
          f"sampling kernel native: {ks.native_available()}", flush=True)
    v, slots = args.vocab, 33
    rng = np.random.default_rng(0)
    print("| setting | rows | native ms | reference ms | ratio |\n|---|---:|---:|---:|---:|")
    for b in (int(r) for r in args.rows.split(",")):
        logits = jnp.asarray((rng.normal(size=(b, v)) * args.scale).astype(np.float32))
        slot_ids, active = jnp.arange(b, dtype=jnp.int32), jnp.ones(b, bool)
        no_mask = jnp.full((b, mask_words(v)), 0xFFFFFFFF, jnp.uint32)
        for name, params in SETTINGS.items():
            sarrays = jax.tree.map(jnp.asarray, SamplingArrays.from_params([params] * b, list(range(b)), [0] * b, b))
            state = (jnp.zeros((slots, v), jnp.int32), jnp.zeros((slots, v), bool))
            shapes = (logits, state, slot_ids, active, sarrays, no_mask)
            programs = {"native": compiled(shapes, True), "reference": compiled(shapes, False)}
            times: dict[str, list[float]] = {k: [] for k in programs}
            for rep in range(args.reps + 2):
                for path, exe in programs.items():
                    start = time.perf_counter()
                    result, state = exe(logits, state, slot_ids, active, sarrays, no_mask)
                    jax.block_until_ready(result.token)
                    if rep >= 2:  # warm-up
                        times[path].append((time.perf_counter() - start) * 1e3)
            nat, ref = statistics.median(times["native"]), statistics.median(times["reference"])
            print(f"| {name} | {b} | {nat:.3f} | {ref:.3f} | {nat / ref:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
