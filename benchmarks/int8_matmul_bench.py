"""Time quantization.linear: f32 weights vs int8 w8a16 vs int8 w8a8 on the default model's shapes.

Run from the repo root:
    .venv/bin/python -m benchmarks.int8_matmul_bench [--reps 30] [--rows 1,8,16,32,64]
Prints median (and min) microseconds per call; each call ends with block_until_ready.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from quantization import ops
from quantization.weights import quantize_weight

# SmolLM2-135M: hidden 576, MLP 1536, vocab 49152 (the LM head).
SHAPES = {"attn/mlp-in 576x1536": (576, 1536), "mlp-down 1536x576": (1536, 576),
          "lm_head 576x49152": (576, 49152)}


def _naive_w8a16(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    # What XLA does without help: one whole float copy of the weight, then the dot.
    y = jnp.dot(x, q.astype(x.dtype), preferred_element_type=jnp.float32)  # [m, out]
    return (y * scale).astype(x.dtype)


def _time(fn, args: tuple, reps: int) -> tuple[float, float]:
    fn(*args).block_until_ready()  # compile + warm
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e6, float(np.min(times)) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--rows", default="1,8,16,32,64", help="comma-separated m values")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)
    linear = jax.jit(ops.linear)
    naive = jax.jit(lambda x, w: _naive_w8a16(x, w.q, w.scale))
    print(f"backend={jax.default_backend()} devices={jax.devices()} x dtype={dtype.name} "
          f"reps={args.reps}; cells are median us (min us)")
    columns = ("f32 weight", "w8a16", "w8a16 naive", "w8a8")
    header = f"{'shape':22} {'m':>3} | " + " | ".join(f"{c:>16}" for c in columns)
    print(header)
    print("-" * len(header))
    for name, (n_in, n_out) in SHAPES.items():
        w = jnp.asarray(rng.standard_normal((n_in, n_out)) / np.sqrt(n_in), dtype)
        w8a16, w8a8 = quantize_weight(w, "w8a16"), quantize_weight(w, "w8a8")
        for m in (int(r) for r in args.rows.split(",")):
            x = jnp.asarray(rng.standard_normal((m, n_in)), dtype)
            cells = [_time(linear, (x, w), args.reps), _time(linear, (x, w8a16), args.reps),
                     _time(naive, (x, w8a16), args.reps), _time(linear, (x, w8a8), args.reps)]
            row = " | ".join(f"{med:8.0f} ({low:5.0f})" for med, low in cells)
            print(f"{name:22} {m:>3} | {row}", flush=True)


if __name__ == "__main__":
    main()
