"""Device probe: the K/V write's cost on the chip per cache layout, to choose the next TPU page layout.

On the v5e XLA's scatter costs 70-95 ns per index whatever the row size, and layout.write_kv's rows are
one per (token, KV head, K or V): 16 indices per token at 8 KV heads, 35 us per layer for 32 decodes and
562 us for a 512-token prefill chunk (tests/kernels/tpu_attention_check.py --profile). This times the write
alone (8 layers under one lax.scan, the cache donated) for layouts with fewer, longer rows per token:

  rows16  [L, pages, KV, 2, ps, hd]    a row per token, head and K|V (layout.py's split form, today)
  rows8   [L, pages, KV, ps, 2 * hd]   a row per token and head: [K | V] (layout.py's lanes form, at any hd)
  rows1   [L, pages, ps, KV * 2 * hd]  a row per token: all heads' [K | V]
  window  rows16's array, one scatter index per token with a [KV * 2, hd] window (strided)

Per layout: device us per layer of the scatter (profiler) and the count of cache-sized copies in the
program (a layout XLA would copy every layer is no candidate).

--int8-write: layout.write_kv on the int8 cache (split form; lanes with --head-dim 64), XLA's scatter against
kernels/tpu/kv_write.py's Pallas kernel, in one run: per --tokens case (N: N decodes, one token per sequence at
scattered offsets; N@P: one chunk of N tokens from position P, its edge tiles partly filled) the two caches after
one layer's write are compared bit for bit (exit status 1 if they differ), then each program (8 layers under one
lax.scan, the cache donated) reports its cache-sized copies, its wall time and, on the TPU, its device time per
layer from the profiler (loop: the scan's body; write: the scatter ops or the kernel). Within whole attention
layers (and the property cases written by the kernel): python -m tests.kernels.tpu_attention_check --profile
--cases int8_64x2048 --variants '[{}, {"int8_write": "kernel"}]' --mixed-variants '[]' --case-kw
'[{"int8_write": "kernel"}]'.

--float-write: the same for the float "tokens" form (bf16, or each of --dtypes), XLA's scatter against
kernels/tpu/kv_write_float.py at each --prefetch depth (kernel_pN), per FLOAT_CASES: 64 decodes of 8B heads
(8 KV heads of 128) and a 1024-token prefill of Llama-3.2-1B's (8 KV heads of 64), 8 layers of 128-token pages;
a line per case gives us per layer of the scan's body (loop_us, on the TPU: the write and the XLA ops that
build its rows) and whether the caches are bit-identical (exit status 1 if not, or if a program copies the cache);
the results also go to $OUT/tpu_kv_write_probe_float.json.

On the TPU:  python -m tests.kernels.tpu_kv_write_probe          (under a minute)
             python -m tests.kernels.tpu_kv_write_probe --int8-write
             python -m tests.kernels.tpu_kv_write_probe --float-write      (both: --int8-write --float-write)
On CPU:      JAX_PLATFORMS=cpu python -m tests.kernels.tpu_kv_write_probe --smoke [--int8-write | --float-write]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from slipstream.kernels.ragged_tokens import quantize_kv
from slipstream.kernels.tpu import kv_write, kv_write_float, layout
from tests.kernels.tpu_attention_check import copy_lines, device_ops

LAYOUTS = ("rows16", "rows8", "rows1", "window")


def cache_shape(name: str, layers: int, pages: int, kvh: int, ps: int, hd: int) -> tuple[int, ...]:
    return {"rows16": (layers, pages, kvh, 2, ps, hd), "rows8": (layers, pages, kvh, ps, 2 * hd),
            "rows1": (layers, pages, ps, kvh * 2 * hd), "window": (layers, pages, kvh, 2, ps, hd)}[name]


def write(name: str, cache, layer, k, v, page, off):
    """Scatter k, v [T, KV, hd] at (layer, page [T], offset [T]) into `cache` of layout `name`."""
    layers, pages = cache.shape[:2]
    t_len, kvh, hd = k.shape
    lp = layer * pages + page                                                          # [T]
    if name == "window":
        view = cache.reshape(layers * pages, kvh * 2, cache.shape[4], hd)
        new = jnp.stack([k, v], axis=2).reshape(t_len, kvh * 2, hd)
        return view.at[lp, :, off, :].set(new).reshape(cache.shape)
    if name == "rows16":
        ps = cache.shape[4]
        rows = ((lp[:, None, None] * kvh + jnp.arange(kvh)[None, :, None]) * 2
                + jnp.arange(2)[None, None, :]) * ps + off[:, None, None]             # [T, KV, 2]
        new = jnp.stack([k, v], axis=2)                                                # [T, KV, 2, hd]
    elif name == "rows8":
        ps = cache.shape[3]
        rows = (lp[:, None] * kvh + jnp.arange(kvh)[None, :]) * ps + off[:, None]      # [T, KV]
        new = jnp.concatenate([k, v], axis=-1)                                         # [T, KV, 2hd]
    else:
        ps = cache.shape[2]
        rows = lp * ps + off                                                           # [T]
        new = jnp.stack([k, v], axis=2)                                                # [T, KV, 2, hd]
    width = cache.shape[-1]
    flat = cache.reshape(-1, width).at[rows.reshape(-1)].set(new.reshape(-1, width).astype(cache.dtype))
    return flat.reshape(cache.shape)


def read(name: str, cache, layer, page, off, kvh: int, hd: int):
    """The rows `write` wrote at (layer, page [T], offset [T]): [T, KV, 2, hd]."""
    if name in ("rows16", "window"):
        return cache[layer, page, :, :, off, :]
    if name == "rows8":
        return cache[layer, page, :, off, :].reshape(-1, kvh, 2, hd)
    return cache[layer, page, off, :].reshape(-1, kvh, 2, hd)


def timed(fn, cache, cache_tree, *, layers: int, reps: int) -> tuple[dict, Callable]:
    """The compiled write's cache-sized copies and its best wall time per layer over reps runs; and the
    function that runs it once more (on the donated cache), for the profiler."""
    copies = copy_lines(fn, cache_tree)
    out = {"cache_copies": len(copies)}
    if copies:
        out["copies"] = [c[:700] for c in copies[:3]]
    state = {"c": cache}

    def once():
        state["c"] = fn(state["c"])
        return state["c"]

    jax.block_until_ready(once())
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(once())
        best = min(best, time.perf_counter() - t)
    out["wall_us_per_layer"] = best / layers * 1e6
    return out, once


def probe(name: str, t_len: int, *, layers: int, kvh: int, hd: int, ps: int, reps: int, profile: bool,
          dtype=jnp.bfloat16) -> dict:
    rng = np.random.default_rng(0)
    pages = max(8, -(-t_len // ps) * 2, t_len + 1 if t_len <= 64 else 0)   # decodes: a page each
    cache = jnp.zeros(cache_shape(name, layers, pages, kvh, ps, hd), dtype)
    k = jnp.asarray(rng.integers(-100, 100, (t_len, kvh, hd)), dtype)
    # tokens at distinct (page, offset): a prefill chunk's run of offsets, or one token per decode page
    pos = np.arange(t_len)
    page = jnp.asarray(pos // ps if t_len > 64 else pos % pages, jnp.int32)
    off = jnp.asarray(pos % ps if t_len > 64 else (pos * 37) % ps, jnp.int32)

    def run(c):
        def body(c, layer):
            return write(name, c, layer, k, k, page, off), None
        return jax.lax.scan(body, c, jnp.arange(layers, dtype=jnp.int32))[0]

    # the write lands where the kernel would read it (one layer, on a fresh cache)
    got = read(name, write(name, cache, 1 % layers, k, -k, page, off), 1 % layers, page, off, kvh, hd)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(jnp.stack([k, -k], axis=2), np.float32))
    fn = jax.jit(run, donate_argnums=(0,)).lower(cache).compile()
    out, once = timed(fn, cache, {"kv": cache}, layers=layers, reps=reps)
    if profile:
        _, ops, _ = device_ops(once, layers=layers)
        out["scatter_us_per_layer"] = sum(us for n, us, _ in ops if "scatter" in n.split("=")[0])
    return out


def _write_case(spec: str, ps: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """"N" (N decodes) or "N@P" (a chunk of N tokens from position P): (page [T], offset [T], sequences,
    pages the cache needs)."""
    n, _, at = spec.partition("@")
    t_len = int(n)
    if not at:   # a page per sequence, offsets spread over the page's tiles
        pos = np.arange(t_len)
        return pos.astype(np.int32), ((pos * 37) % ps).astype(np.int32), t_len, t_len + 1
    pos = int(at) + np.arange(t_len)
    return (pos // ps).astype(np.int32), (pos % ps).astype(np.int32), 1, int(pos[-1]) // ps + 2


def _bits(x: jax.Array) -> jax.Array:
    """x's bit patterns (bit equality: -0.0 differs from 0.0, a NaN's payload counts)."""
    return jax.lax.bitcast_convert_type(x, {1: jnp.int8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize])


def probe_write(spec: str, *, dtype, layers: int, kvh: int, hd: int, ps: int, reps: int, profile: bool,
                kernels: dict[str, dict] | None = None) -> dict:
    """layout.write_kv on an int8 or float cache, the scatter against the Pallas kernel (see the module's
    docstring). kernels: name -> kv_write_float constants set while that kernel variant compiles (float; default
    one variant "kernel" at the module's values)."""
    page, off, seqs, n_pages = _write_case(spec, ps)
    t_len = page.shape[0]
    int8 = jnp.dtype(dtype) == jnp.int8
    interpret = jax.default_backend() != "tpu"
    key = jax.random.PRNGKey(0)
    shapes = layout.shapes(layers, kvh, n_pages, ps, hd, dtype)

    def fresh():
        if int8:
            return {"kv": jax.random.randint(key, shapes["kv"].shape, -127, 128, jnp.int8),
                    "kv_scale": jax.random.uniform(key, shapes["kv_scale"].shape, jnp.float32)}
        return {"kv": jax.random.normal(key, shapes["kv"].shape, jnp.float32).astype(dtype)}
    k = jax.random.normal(jax.random.PRNGKey(1), (t_len, kvh, hd), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(jax.random.PRNGKey(2), (t_len, kvh, hd), jnp.float32).astype(jnp.bfloat16)
    if not int8:   # bit patterns a conversion on the way would change: -0.0, infinities, a subnormal
        k = k.at[0, 0, :4].set(jnp.asarray([-0.0, jnp.inf, -jnp.inf, 1e-40], jnp.bfloat16))
    page, off = jnp.asarray(page), jnp.asarray(off)
    bound = min(t_len, t_len // ps + 2 * seqs)
    knob = "int8_write" if int8 else "float_write"
    variants = {"scatter": {}, **(kernels if kernels and not int8 else {"kernel": {}})}

    def write(c, layer, name):
        how = "scatter" if name == "scatter" else "kernel"
        return layout.write_kv(c, layer, k, v, page, off, quantize_kv, max_items=bound, interpret=interpret,
                               **{knob: how})

    def compiled(name, fn, *args):
        saved = {c: getattr(kv_write_float, c) for c in variants[name]}
        try:
            for c, value in variants[name].items():
                setattr(kv_write_float, c, value)
            return jax.jit(fn, donate_argnums=(0,)).lower(*args).compile()
        finally:
            for c, value in saved.items():
                setattr(kv_write_float, c, value)

    out = {"form": layout.form(fresh()), "dtype": jnp.dtype(dtype).name, "kv_heads": kvh, "head_dim": hd,
           "tokens": t_len}
    one = {name: compiled(name, lambda c, name=name: write(c, jnp.int32(layers - 1), name), fresh())(fresh())
           for name in variants}
    out["bit_identical"] = all(bool(jnp.array_equal(_bits(one["scatter"][n]), _bits(one[name][n])))
                               for name in variants for n in one["scatter"])
    del one
    for name in variants:
        def run(c, name=name):
            def body(c, layer):
                return write(c, layer, name), None
            return jax.lax.scan(body, c, jnp.arange(layers, dtype=jnp.int32))[0]
        cache = fresh()
        fn = compiled(name, run, cache)
        r, once = timed(fn, cache, cache, layers=layers, reps=reps)
        r["wall_us_per_layer"] = round(r["wall_us_per_layer"], 1)
        if profile:
            _, ops, summary = device_ops(once, top=6, layers=layers)
            r["loop_us_per_layer"] = summary["loop_us"]
            r["write_us_per_layer"] = summary["write_us"]
            r["top_ops"] = [[n[:120], round(us, 2), c] for n, us, c in ops]
        out[name] = r
        del once, cache
    a = out["scatter"]
    for name in variants:
        b = out[name]
        key_t = "loop_us_per_layer" if profile and a.get("loop_us_per_layer") and b.get("loop_us_per_layer") \
            else "wall_us_per_layer"
        if name != "scatter":
            out[f"{name}_over_scatter"] = round(b[key_t] / a[key_t], 3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU")
    ap.add_argument("--tokens", default="32,512", help="comma-separated token counts per write")
    ap.add_argument("--dtypes", default="bfloat16", help="comma-separated cache dtypes (bfloat16, int8)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, of " + ",".join(LAYOUTS))
    ap.add_argument("--int8-write", action="store_true",
                    help="the int8 write: XLA's scatter against kernels/tpu/kv_write.py (--tokens default "
                         "32,64,512@0,2048@0,512@45)")
    ap.add_argument("--float-write", action="store_true",
                    help="the float write: XLA's scatter against kernels/tpu/kv_write_float.py, per FLOAT_CASES, "
                         "per cache dtype of --dtypes")
    ap.add_argument("--prefetch", default="2,4,8",
                    help="--float-write: the kernel variants' kv_write_float.PREFETCH (items whose reads run ahead)")
    ap.add_argument("--head-dim", type=int, default=128, help="--int8-write: 128 (split form) or 64 (lanes)")
    ap.add_argument("--dot-dtype", default="int8", help="--int8-write: the kernel's one-hot matmul operands "
                                                        "(int8 or bfloat16)")
    ap.add_argument("--window-rows", type=int, default=None,
                    help="--int8-write: the kernel's one-hot window (kv_write.WINDOW: 64, or 128 for a 128-deep dot)")
    args = ap.parse_args(argv)
    on_tpu = jax.default_backend() == "tpu"
    if not on_tpu and not args.smoke:
        print("not on a TPU: run with --smoke", file=sys.stderr)
        return 2
    dims = dict(layers=8, kvh=8, hd=128, ps=128, reps=5) if not args.smoke else dict(layers=2, kvh=2, hd=128, ps=16,
                                                                                   reps=1)
    results = {}
    if args.int8_write or args.float_write:
        failed = [main_(args, dims, on_tpu) for flag, main_ in ((args.int8_write, _main_int8_write),
                                                                (args.float_write, _main_float_write)) if flag]
        return max(failed)
    print(f"device: {jax.devices()[0]}; KV heads {dims['kvh']}, hd {dims['hd']}, pages of {dims['ps']}", flush=True)
    for dtype in args.dtypes.split(","):
        for t_len in map(int, args.tokens.split(",")):
            for name in args.layouts.split(","):
                try:
                    r = probe(name, t_len, profile=on_tpu, dtype=jnp.dtype(dtype), **dims)
                except Exception as exc:  # noqa: BLE001 - one layout failing must not hide the others
                    r = {"error": f"{type(exc).__name__}: {str(exc)[:1500]}"}
                results[f"{name}/{t_len}/{dtype}"] = r
                print(f"  {dtype:8s} {t_len:5d} tokens {name:7s} {json.dumps(r)}", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "tpu_kv_write_probe.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


def _main_int8_write(args, dims: dict, on_tpu: bool) -> int:
    kv_write.DOT_DTYPE = jnp.dtype(args.dot_dtype)
    kv_write.WINDOW = args.window_rows or kv_write.WINDOW
    dims = dict(dims, hd=args.head_dim, **(dict(ps=64) if args.smoke else {}))
    tokens = "32,64,512@0,2048@0,512@45" if args.tokens == "32,512" else args.tokens
    if args.smoke:
        tokens = "4,70@45"
    print(f"device: {jax.devices()[0]}; int8 write, KV heads {dims['kvh']}, hd {dims['hd']}, pages of {dims['ps']}, "
          f"{dims['layers']} layers, one-hot matmul in {args.dot_dtype} over {kv_write.WINDOW} rows", flush=True)
    results, ok = {}, True
    for spec in tokens.split(","):
        try:
            r = probe_write(spec, dtype=jnp.int8, profile=on_tpu, **dims)
            ok &= r["bit_identical"] and r["kernel"]["cache_copies"] == 0
        except Exception as exc:  # noqa: BLE001 - one case failing must not hide the others
            r = {"error": f"{type(exc).__name__}: {str(exc)[:3000]}"}
            ok = False
        results[spec] = r
        print(f"  {spec:>8s} {json.dumps(r)}", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "tpu_kv_write_probe.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0 if ok else 1


# --float-write cases (name: --tokens spec, KV heads, head_dim): 64 decodes of Llama-3.1-8B's heads; a 1024-token
# prefill of Llama-3.2-1B's (8 KV heads of 64, paired: a 1024-lane row per token)
FLOAT_CASES = {"8b_64_decodes": ("64", 8, 128), "1b_1024_prefill": ("1024@0", 8, 64)}
SMOKE_FLOAT_CASES = {"decodes": ("4", 2, 128), "chunk_mid_tile": ("70@45", 2, 64)}


def _main_float_write(args, dims: dict, on_tpu: bool) -> int:
    gap = kv_write_float.SLOTS - kv_write_float.PREFETCH
    kernels = {f"kernel_p{n}": {"PREFETCH": n, "SLOTS": n + gap} for n in map(int, args.prefetch.split(","))}
    cases = SMOKE_FLOAT_CASES if args.smoke else FLOAT_CASES
    dims = dict(dims, **(dict(ps=32) if args.smoke else {}))
    print(f"device: {jax.devices()[0]}; float write, pages of {dims['ps']}, {dims['layers']} layers; kernel variants "
          f"{sorted(kernels)} (the module's PREFETCH: {kv_write_float.PREFETCH})", flush=True)
    results, ok = {}, True
    for dtype in args.dtypes.split(","):
        for name, (spec, kvh, hd) in cases.items():
            try:
                r = probe_write(spec, dtype=jnp.dtype(dtype), kernels=kernels, profile=on_tpu,
                                **dict(dims, kvh=kvh, hd=hd))
                ok &= r["bit_identical"] and all(r[k]["cache_copies"] == 0 for k in kernels)
            except Exception as exc:  # noqa: BLE001 - one case failing must not hide the others
                r = {"error": f"{type(exc).__name__}: {str(exc)[:3000]}"}
                ok = False
            results[f"{name}/{dtype}"] = r
            print(f"  {name:>16s} {dtype:8s} {json.dumps(r)}", flush=True)
            us = "loop_us_per_layer" if on_tpu else "wall_us_per_layer"
            if "error" not in r:
                print(f"  {name:>16s} {dtype:8s} us/layer ({us}): "
                      + ", ".join(f"{k} {r[k].get(us)}" for k in ("scatter", *kernels))
                      + f"; bit-identical: {r['bit_identical']}", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "tpu_kv_write_probe_float.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
