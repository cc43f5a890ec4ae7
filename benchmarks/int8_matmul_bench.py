"""Group-wise int8 (Q8_0) matmul kernel against the machine's read bandwidth and XLA's f32 matmul.

Three measurements in one run, so their ratios share the machine's state:
  1. read bandwidth: kernels.q8_matmul.read_probe streams a buffer 8x the L3 size with the kernel's
     threads (XLA's intra-op pool) and vector loads;
  2. one row (decode): every weight of a SmolLM2-135M decode step (30 layers x 7 matrices + the
     576x49152 LM head, ~150 MB, far beyond L3) once per call, and the LM head alone (8 copies);
     reported as bytes of packed weights + scales read per second, and as a share of (1);
  3. many rows (prefill): each default-model shape at --rows, Q8_0 kernel vs XLA's f32 matmul on
     the same x, timed alternately; GOP/s = 2*M*K*N / time.
Run from the repo root, serialized with other timing runs:
    flock /tmp/slipstream-bench.lock .venv/bin/python -m benchmarks.int8_matmul_bench [--reps 20]
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels import native
from kernels import q8_matmul as q8

# SmolLM2-135M: hidden 576, MLP 1536, 9 query / 3 KV heads of 64, vocab 49152, 30 layers.
LAYER_SHAPES = {"wq": (576, 576), "wk": (576, 192), "wv": (576, 192), "wo": (576, 576),
                "w_gate": (576, 1536), "w_up": (576, 1536), "w_down": (1536, 576)}
LM_HEAD = (576, 49152)
N_LAYERS = 30
PREFILL_SHAPES = {"q/o 576x576": (576, 576), "k/v 576x192": (576, 192), "gate/up 576x1536": (576, 1536),
                  "down 1536x576": (1536, 576), "lm_head 576x49152": LM_HEAD}


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"


def l3_bytes() -> int:
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            text = f.read().strip()
        return int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]]
    except (OSError, ValueError, KeyError):
        return 32 << 20


def random_q8(rng: np.random.Generator, k: int, n: int) -> tuple[jax.Array, jax.Array]:
    q = rng.integers(-127, 128, (n, k), dtype=np.int8)
    d = (rng.random((n, -(-k // q8.GROUP))) * 1e-2).astype(np.float32)
    packed, scales = q8.pack(q, d)
    return jnp.asarray(packed), jnp.asarray(scales)


def median_seconds(fn, args, reps: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def read_bandwidth(reps: int) -> float:
    data = jnp.asarray(np.random.default_rng(1).integers(0, 255, 8 * l3_bytes(), dtype=np.uint8))
    seconds = median_seconds(jax.jit(q8.read_probe), (data,), reps)
    return data.nbytes / seconds


def one_row(weights: list[tuple[jax.Array, jax.Array, int]], reps: int) -> tuple[float, int]:
    """(seconds, bytes) for one row through every weight in `weights` (packed, scales, n)."""
    def step(x, ws):
        total = jnp.zeros((), jnp.float32)
        for (packed, scales), n in zip(ws, ns):
            y = q8.q8_matmul(x[: packed.shape[1] // q8.TILE], packed, scales, n=n)
            total = total + y[0]  # keeps every call live; x stays the same row
        return total

    ns = [n for _, _, n in weights]
    ws = [(p, s) for p, s, _ in weights]
    x = jnp.asarray(np.random.default_rng(2).standard_normal(1536), jnp.float32)
    seconds = median_seconds(jax.jit(step), (x, ws), reps)
    return seconds, sum(p.nbytes + s.nbytes for p, s in ws)


def many_rows(rng: np.random.Generator, k: int, n: int, m: int, reps: int) -> tuple[float, float]:
    """(f32 seconds, q8 seconds) for x [m, k] @ w [k, n], timed alternately."""
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32)
    packed, scales = random_q8(rng, k, n)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    f32 = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32))
    kern = jax.jit(lambda x, p, s: q8.q8_matmul(x, p, s, n=n))
    jax.block_until_ready((f32(x, w), kern(x, packed, scales)))
    t_f32, t_q8 = [], []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(f32(x, w))
        t_f32.append(time.perf_counter() - start)
        start = time.perf_counter()
        jax.block_until_ready(kern(x, packed, scales))
        t_q8.append(time.perf_counter() - start)
    return float(np.median(t_f32)), float(np.median(t_q8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rows", default="256", help="comma-separated row counts for the f32 comparison")
    args = parser.parse_args()
    if not native.load("q8_matmul", "q8_matmul"):
        raise SystemExit("the native kernel is not available (see the log above); nothing to measure")
    import kernels._q8_matmul as ext

    print(f"cpu: {cpu_model()} ({os.cpu_count()} logical CPUs, L3 {l3_bytes() >> 20} MiB); kernel isa: "
          f"{ext.isa()}; jax {jax.__version__}, backend {jax.default_backend()}; medians of {args.reps}")
    bw = read_bandwidth(args.reps)
    print(f"\n[1] read bandwidth (read_probe, {8 * l3_bytes() >> 20} MiB): {bw / 1e9:.1f} GB/s")

    rng = np.random.default_rng(0)
    step_weights = [(*random_q8(rng, k, n), n) for _ in range(N_LAYERS) for k, n in LAYER_SHAPES.values()]
    head = random_q8(rng, *LM_HEAD)
    step_weights.append((*head, LM_HEAD[1]))
    heads = [(*random_q8(rng, *LM_HEAD), LM_HEAD[1]) for _ in range(8)]
    print("\n[2] one row: packed weights + scales read per second")
    for name, ws in (("decode step: 30 layers + LM head", step_weights), ("LM head 576x49152, 8 copies", heads)):
        seconds, nbytes = one_row(ws, args.reps)
        print(f"    {name:34} {nbytes / 2**20:6.1f} MiB in {seconds * 1e3:6.2f} ms = "
              f"{nbytes / seconds / 1e9:5.1f} GB/s = {nbytes / seconds / bw:4.0%} of read bandwidth")
    del step_weights, heads

    print("\n[3] many rows: XLA f32 matmul vs Q8_0 kernel (GOP/s = 2*M*K*N / time)")
    print(f"    {'shape':20} {'M':>4} | {'f32 ms':>8} {'GFLOP/s':>8} | {'q8_0 ms':>8} {'GOP/s':>8} | {'speed-up':>8}")
    for m in (int(r) for r in args.rows.split(",")):
        for name, (k, n) in PREFILL_SHAPES.items():
            t_f32, t_q8 = many_rows(rng, k, n, m, args.reps)
            ops = 2.0 * m * k * n
            print(f"    {name:20} {m:>4} | {t_f32 * 1e3:8.3f} {ops / t_f32 / 1e9:8.1f} | "
                  f"{t_q8 * 1e3:8.3f} {ops / t_q8 / 1e9:8.1f} | {t_f32 / t_q8:7.2f}x", flush=True)


if __name__ == "__main__":
    main()
