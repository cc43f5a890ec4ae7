"""The TPU/GPU int8 weight forms (quantization/int8.py) against bf16 ("float"): one linear per layer under a scan
of layers (dispatch amortized, as the model runs them), at decode and prefill row counts. Weights are
drawn in bf16 on the device and quantized there (that time is reported too). Run on the accelerator:
    python -m benchmarks.int8_mxu_bench [--shapes 2048x5632,5632x2048,4096x14336] [--rows 1,32,256,2048] [--out r.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from slipstream.quantization import ops, quantize_weight

LAYERS = 8


def timeit(f, *args, n: int = 20) -> float:
    """Median seconds of f(*args) after two warm-up calls."""
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(n):
        start = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def by_groups(x: jax.Array, w) -> jax.Array:
    """The int8 mode's product another way (an alternative to its dequantization inside the dot): one
    dot per group of 32 inputs with q converted only, its scale on the [M, G, N] partial sums, plus
    each group's sum of x times the offsets."""
    m, k = x.shape
    g = w.scale.shape[0]
    xg = x.reshape(m, g, w.block)                                                    # [M, G, 32]
    parts = jnp.einsum("mgb,gbn->mgn", xg, w.q.reshape(g, w.block, -1).astype(x.dtype),
                       preferred_element_type=jnp.float32)
    y = jnp.einsum("mgn,gn->mn", parts, w.scale)
    return (y + jnp.einsum("mg,gn->mn", xg.astype(jnp.float32).sum(-1), w.offset)).astype(x.dtype)


def chain(linear):
    @jax.jit
    def run(x: jax.Array, stacked) -> jax.Array:
        """x [M, K] times each layer's weight [K, N] (stacked [L, K, N]): outputs [L, M, N]."""
        return jax.lax.scan(lambda c, w: (c, linear(x, w)), 0, stacked)[1]
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="2048x5632,5632x2048,4096x14336", help="KxN weights (TinyLlama MLP, Llama-3-8B MLP)")
    p.add_argument("--rows", default="1,32,256,2048")
    p.add_argument("--dtype", default="bfloat16", help="weights and activations (float32: a CPU smoke run)")
    p.add_argument("--out")
    args = p.parse_args()
    key = jax.random.PRNGKey(0)
    report = {"devices": str(jax.devices()), "layers": LAYERS, "cases": []}
    for shape in args.shapes.split(","):
        k, n = map(int, shape.split("x"))
        w = (jax.random.normal(key, (LAYERS, k, n), jnp.float32) / np.sqrt(k)).astype(args.dtype)
        forms = {"float": w}
        for mode in ("int8", "int8-channel"):
            start = time.perf_counter()
            forms[mode] = jax.block_until_ready(quantize_weight(w, mode))
            report["cases"].append({"k": k, "n": n, "quantize_s": time.perf_counter() - start, "mode": mode})
        forms["int8-channel-w8a8"] = dataclasses.replace(forms["int8-channel"], a8_rows=1)
        forms["int8-channel"] = dataclasses.replace(forms["int8-channel"], a8_rows=None)  # w8a16 at all rows
        for m in map(int, args.rows.split(",")):
            x = jax.random.normal(key, (m, k), args.dtype)
            row = {"k": k, "n": n, "m": m}
            for name, weight in [*forms.items(), ("int8-groups", forms["int8"])]:
                t = timeit(chain(by_groups if name == "int8-groups" else ops.linear), x, weight) / LAYERS
                nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(weight)) / LAYERS
                row[f"{name}_ms"] = t * 1e3
                row[f"{name}_weight_gbs"] = nbytes / t / 1e9
            report["cases"].append(row)
            print(json.dumps(row), flush=True)
        del w, forms
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
