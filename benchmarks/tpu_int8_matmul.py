"""The group-wise int8 matmul on TPU: the Pallas kernel (kernels/tpu/int8_matmul.py) against XLA's
dequantize-then-dot (the path it replaces) and bf16 weights, at Llama-3-8B's linear shapes. One device call:

    python -m benchmarks.tpu_int8_matmul                          (on the TPU; about 4-6 minutes with compiles)
    JAX_PLATFORMS=cpu python -m benchmarks.tpu_int8_matmul --interpret   (CPU, Pallas' interpreter, tiny shapes)

Each product is timed per layer over a lax.scan of --layers weights (a stack [L, K, N], as the engine's layer
scan holds them), so dispatch is amortized; medians of --reps calls, the kinds of one (shape, m) interleaved.
Kinds: bf16 (bf16 weights); xla_int8 (int8 + group-32 scales/offsets, dequantized by XLA then one dot: the old path);
kernel_slice (the kernel on the scan's slice of the stack, as the engine ran it before its int8 stacks became
StackedInt8: XLA may copy the slice out first); kernel_index (the kernel reading the stack in place at the layer
index, as the engine's layer scan runs it now); kernel_reshape (kernel_index, dequantizing by a [bk/32, 32, bn]
reshape); then a sweep of block sizes (kernel_index). Each kind's outputs are bf16 [L, M, N], as the engine's linears
give. Reported per kind: ms per layer, GB/s of int8 weights read (K * N bytes / time) and of all weight bytes (q +
scales + offsets), the fraction of the HBM read rate measured in this run; and max |kernel - XLA| (f32 outputs, layer
1). A kind that fails to compile records its error and the run goes on. Results print as they come and go to
$OUT/tpu_int8_matmul.json (or --out).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.measure import cpu_model, interleaved
from slipstream.kernels.tpu import int8_matmul as kmod
from slipstream.quantization import int8

DEVICE_SHAPES = "4096x14336,14336x4096,4096x6144"
DEVICE_SWEEP = "512x512,1024x512,1024x1024,2048x512,2048x2048"
TINY_SHAPES = "512x256,256x384"
TINY_SWEEP = "256x128,512x128"


def _pairs(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in p.split("x")) for p in text.split(",") if p]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--interpret", action="store_true", help="Pallas' TPU interpreter (CPU) and tiny defaults")
    p.add_argument("--m", type=_ints, default=None, help="activation rows (default 1,64,2048; interpret: 1,17)")
    p.add_argument("--shapes", type=_pairs, default=None, help=f"KxN weights (default {DEVICE_SHAPES})")
    p.add_argument("--sweep", type=_pairs, default=None, help=f"bk x bn blocks to sweep (default {DEVICE_SWEEP})")
    p.add_argument("--layers", type=int, default=None, help="weights in the scan (default 8; interpret: 2)")
    p.add_argument("--reps", type=int, default=None, help="timed calls per kind (default 10; interpret: 2)")
    p.add_argument("--budget-s", type=float, default=420, help="skip what is left after this many seconds")
    p.add_argument("--out", default=None, help="JSON path (default $OUT/tpu_int8_matmul.json, else ./)")
    a = p.parse_args(argv)
    a.m = a.m or ([1, 17] if a.interpret else [1, 64, 2048])
    a.shapes = a.shapes or _pairs(TINY_SHAPES if a.interpret else DEVICE_SHAPES)
    a.sweep = a.sweep if a.sweep is not None else _pairs(TINY_SWEEP if a.interpret else DEVICE_SWEEP)
    a.layers = a.layers or (2 if a.interpret else 8)
    a.reps = a.reps or (2 if a.interpret else 10)
    a.out = a.out or os.path.join(os.environ.get("OUT") or ".", "tpu_int8_matmul.json")
    if min(a.m) < 1 or a.layers < 2 or a.reps < 1:
        raise SystemExit("--m, --layers (>= 2: the check reads layer 1) and --reps must be positive")
    return a


def machine() -> dict:
    dev = jax.devices()[0]
    return {"platform": dev.platform, "device_kind": dev.device_kind, "device_count": jax.device_count(),
            "device_memory": (dev.memory_stats() or {}).get("bytes_limit"), "jax": jax.__version__,
            "cpu": cpu_model(), "cores": os.cpu_count()}


def hbm_read_gbs(interpret: bool) -> float:
    """jnp.sum over one large f32 array (2 GiB on the device, 64 MiB on CPU): the HBM read rate."""
    n = (64 << 20 if interpret else 2 << 30) // 4
    x = jnp.ones((n,), jnp.float32)
    total = jax.jit(jnp.sum)
    s = min(interleaved({"sum": lambda: total(x)}, reps=5, warmup=2)["sum"])
    del x
    return n * 4 / s / 1e9


def _stack(k: int, n: int, layers: int, seed: int = 0):
    """Random int8 weights [L, K, N] with group-32 scales and offsets, drawn on the device."""
    kq, ks, ko = jax.random.split(jax.random.PRNGKey(seed), 3)
    g = k // int8.GROUP
    q = jax.random.randint(kq, (layers, k, n), -128, 128, jnp.int8)
    scale = jax.random.uniform(ks, (layers, g, n), jnp.float32, 0.5, 1.5) / (64.0 * k ** 0.5)
    offset = jax.random.normal(ko, (layers, g, n), jnp.float32) * scale
    return q, scale, offset


def _scan_xs(op):
    """op(x, *layer_weights) for each layer of stacked weights under one lax.scan (the weights as xs)."""
    def run(x, *stacks):
        return jax.lax.scan(lambda c, ws: (c, op(x, *ws).astype(x.dtype)), 0, stacks)[1]
    return jax.jit(run)


def _scan_index(op, layers: int):
    """op(x, stacks..., layer) under a lax.scan over layer indices (the kernel reads the stack in place)."""
    def run(x, *stacks):
        return jax.lax.scan(lambda c, i: (c, op(x, *stacks, i).astype(x.dtype)), 0,
                            jnp.arange(layers, dtype=jnp.int32))[1]
    return jax.jit(run)


def _xla_int8(x, q, scale, offset):
    """XLA's dequantize-then-dot of one layer's weight (quantization/int8's branch off the kernel)."""
    return int8._xla_matmul(x, jnp.int32(0), q, scale, offset)


def kinds_for(args, k: int, n: int, m: int) -> dict:
    """name -> (jitted fn of (x, *operands), which operands: 'bf16' or 'int8')."""
    interp = args.interpret

    def kernel(**kw):
        return functools.partial(kmod.int8_matmul, interpret=interp, **kw)

    out = {
        "bf16": (_scan_xs(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)), "bf16"),
        "xla_int8": (_scan_xs(_xla_int8), "int8"),
        "kernel_slice": (_scan_xs(kernel()), "int8"),
        "kernel_index": (_scan_index(kernel(), args.layers), "int8"),
        "kernel_reshape": (_scan_index(kernel(dequant="reshape"), args.layers), "int8"),
    }
    if m == args.m[0]:  # int8 widened to int32 before the float conversion (in case Mosaic wants it)
        out["kernel_via_int32"] = (_scan_index(kernel(via_int32=True), args.layers), "int8")
    return out


def sweep_for(args, k: int, n: int, m: int) -> dict:
    default = kmod.blocks(m, k, n)
    out = {}
    for bk, bn in args.sweep:
        if k % bk or n % bn or (bk, bn) == default:
            continue
        if kmod.vmem_estimate(m, k, bk, bn, 2, True) > kmod.VMEM_CAP:
            continue
        fn = functools.partial(kmod.int8_matmul, block_k=bk, block_n=bn, interpret=args.interpret)
        out[f"kernel_{bk}x{bn}"] = (_scan_index(fn, args.layers), "int8")
    return out


def check(args, x, q, scale, offset) -> dict:
    """max |kernel - XLA| over layer 1's f32 product, and the product's largest magnitude."""
    ref = jax.jit(_xla_int8)(x, q[1], scale[1], offset[1])
    res = {}
    forms = (("kernel", {}), ("kernel_reshape", {"dequant": "reshape"}), ("kernel_via_int32", {"via_int32": True}))
    for name, kw in forms:
        try:
            y = jax.jit(functools.partial(kmod.int8_matmul, interpret=args.interpret, **kw))(
                x, q, scale, offset, jnp.int32(1))
            res[name] = float(jnp.max(jnp.abs(y - ref)))
        except Exception as exc:  # noqa: BLE001 (a lowering failure is a result)
            res[name] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
    res["max_abs_ref"] = float(jnp.max(jnp.abs(ref)))
    return res


def time_kinds(args, kinds: dict, x, operands: dict, k: int, n: int, hbm: float) -> dict:
    """Each kind alone compiled (an error recorded), then the ones that work timed interleaved."""
    ready, res = {}, {}
    for name, (fn, which) in kinds.items():
        try:
            t = time.perf_counter()
            jax.block_until_ready(fn(x, *operands[which]))
            res[name] = {"first_call_s": round(time.perf_counter() - t, 2)}
            ready[name] = functools.partial(fn, x, *operands[which])
        except Exception as exc:  # noqa: BLE001
            res[name] = {"error": f"{type(exc).__name__}: {str(exc)[:600]}"}
            print(f"    {name}: FAILED {res[name]['error'][:300]}", flush=True)
            traceback.print_exc(limit=2)
    if ready:
        times = interleaved(ready, reps=args.reps, warmup=1)
        g = k // int8.GROUP
        for name, ts in times.items():
            s = statistics.median(ts) / args.layers
            q_bytes = k * n
            w_bytes = 2 * k * n if kinds[name][1] == "bf16" else k * n + 2 * g * n * 4
            res[name].update(ms=s * 1e3, int8_gbs=q_bytes / s / 1e9 if kinds[name][1] == "int8" else None,
                             weight_gbs=w_bytes / s / 1e9, hbm_fraction=w_bytes / s / 1e9 / hbm)
    return res


def main(argv=None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    report = {"machine": machine(), "args": {k: v for k, v in vars(args).items()}, "rows": []}
    print(f"machine: {report['machine']}", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def save():
        with open(args.out + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(args.out + ".tmp", args.out)

    report["hbm_read_gbs"] = hbm = hbm_read_gbs(args.interpret)
    print(f"HBM read: {hbm:.0f} GB/s", flush=True)
    save()
    pending = []  # (k, n, m): the block sweep, after every shape's main kinds
    for phase in ("main", "sweep"):
        for k, n in args.shapes:
            if time.perf_counter() - start > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent: skipping the rest", flush=True)
                break
            q, scale, offset = _stack(k, n, args.layers)
            operands = {"int8": (q, scale, offset)}
            if phase == "main":
                operands["bf16"] = (jax.random.normal(jax.random.PRNGKey(1), (args.layers, k, n), jnp.bfloat16),)
            for m in args.m:
                if time.perf_counter() - start > args.budget_s:
                    break
                x = jax.random.normal(jax.random.PRNGKey(2), (m, k), jnp.bfloat16)
                blk = kmod.blocks(m, k, n)
                if phase == "main":
                    kinds = kinds_for(args, k, n, m)
                else:
                    if (k, n, m) not in pending:
                        continue
                    kinds = sweep_for(args, k, n, m)
                row = {"phase": phase, "k": k, "n": n, "m": m, "blocks": blk,
                       "kinds": time_kinds(args, kinds, x, operands, k, n, hbm)}
                if phase == "main":
                    row["max_abs_diff"] = check(args, x, q, scale, offset)
                    pending.append((k, n, m))
                report["rows"].append(row)
                save()
                print(f"  [{k} x {n}] m={m} blocks={blk}: " + ", ".join(
                    f"{name} {v['ms']:.3f} ms" + (f" ({v['int8_gbs']:.3g} GB/s int8)" if v.get("int8_gbs") else "")
                    if "ms" in v else f"{name} FAILED" for name, v in row["kinds"].items())
                    + (f"; max|diff| {row['max_abs_diff']}" if "max_abs_diff" in row else ""), flush=True)
                del x
            del q, scale, offset, operands
    report["seconds"] = round(time.perf_counter() - start, 1)
    save()
    print(f"done in {report['seconds']} s: {args.out}", flush=True)


if __name__ == "__main__":
    main()
