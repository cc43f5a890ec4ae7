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
reshape); kernel_bf16_scales (kernel_index with bf16 scales and offsets); kernel_int4, kernel_int4_bf16_scales
(4-bit weights packed two a byte: the top 4 bits of the same int8 values, f32 or bf16 scales); then a sweep of
block sizes (kernel_index). --kinds keeps some of them. Each kind's outputs are bf16 [L, M, N], as the engine's linears
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
from slipstream.kernels.tpu import nibbles
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
    p.add_argument("--kinds", default=None, help="comma-separated kinds to run (default: all)")
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


def operand_sets(q, scale, offset) -> dict:
    """The weight forms timed: int8 with f32 or bf16 scales/offsets, and 4-bit (q's top 4 bits) packed."""
    q4 = nibbles.pack4(jnp.right_shift(q, 4))
    bf = (scale.astype(jnp.bfloat16), offset.astype(jnp.bfloat16))
    return {"int8": (q, scale, offset), "int8_bf16s": (q, *bf), "int4": (q4, scale, offset), "int4_bf16s": (q4, *bf)}


def weight_bytes(which: str, k: int, n: int) -> tuple[int, int]:
    """(bytes of q, bytes of q + scales + offsets) of one layer of an operand set."""
    g = k // int8.GROUP
    if which == "bf16":
        return 2 * k * n, 2 * k * n
    q_bytes = k * n // (2 if which.startswith("int4") else 1)
    return q_bytes, q_bytes + 2 * g * n * (2 if which.endswith("bf16s") else 4)


def kinds_for(args, k: int, n: int, m: int) -> dict:
    """name -> (jitted fn of (x, *operands), which operands: 'bf16', or an operand_sets key)."""
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
    out["kernel_bf16_scales"] = (_scan_index(kernel(), args.layers), "int8_bf16s")
    out["kernel_int4"] = (_scan_index(kernel(bits=4), args.layers), "int4")
    out["kernel_int4_bf16_scales"] = (_scan_index(kernel(bits=4), args.layers), "int4_bf16s")
    if args.kinds:
        keep = set(args.kinds.split(","))
        out = {name: v for name, v in out.items() if name in keep}
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


def check(args, x, operands: dict) -> dict:
    """max |kernel - XLA| over layer 1's f32 product (each weight form against XLA's dequantize-then-dot of the
    same values), and the int8 product's largest magnitude."""
    q, scale, offset = operands["int8"]
    ref = jax.jit(_xla_int8)(x, q[1], scale[1], offset[1])
    res = {}
    forms = (("kernel", "int8", {}), ("kernel_reshape", "int8", {"dequant": "reshape"}),
             ("kernel_via_int32", "int8", {"via_int32": True}), ("kernel_bf16_scales", "int8_bf16s", {}),
             ("kernel_int4", "int4", {"bits": 4}), ("kernel_int4_bf16_scales", "int4_bf16s", {"bits": 4}))
    keep = set(args.kinds.split(",")) if args.kinds else None
    for name, which, kw in forms:
        if keep is not None and (name if name != "kernel" else "kernel_index") not in keep:
            continue
        wq, ws, wo = operands[which]
        try:
            y = jax.jit(functools.partial(kmod.int8_matmul, interpret=args.interpret, **kw))(
                x, wq, ws, wo, jnp.int32(1))
            if which != "int8":
                layer = nibbles.unpack4(wq[1]) if kw.get("bits") == 4 else wq[1]
                y = y - jax.jit(_xla_int8)(x, layer, ws[1].astype(jnp.float32), wo[1].astype(jnp.float32)) + ref
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
        for name, ts in times.items():
            s = statistics.median(ts) / args.layers
            q_bytes, w_bytes = weight_bytes(kinds[name][1], k, n)
            res[name].update(ms=s * 1e3, int8_gbs=q_bytes / s / 1e9 if kinds[name][1] != "bf16" else None,
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
            operands = operand_sets(q, scale, offset)
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
                    row["max_abs_diff"] = check(args, x, operands)
                    pending.append((k, n, m))
                report["rows"].append(row)
                save()
                print(f"  [{k} x {n}] m={m} blocks={blk}: " + ", ".join(
                    f"{name} {v['ms']:.3f} ms" + (f" ({v['int8_gbs']:.3g} GB/s of q)" if v.get("int8_gbs") else "")
                    if "ms" in v else f"{name} FAILED" for name, v in row["kinds"].items())
                    + (f"; max|diff| {row['max_abs_diff']}" if "max_abs_diff" in row else ""), flush=True)
                del x
            del q, scale, offset, operands
    report["seconds"] = round(time.perf_counter() - start, 1)
    save()
    print(f"done in {report['seconds']} s: {args.out}", flush=True)


if __name__ == "__main__":
    main()
