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

On the TPU:  python -m tests.kernels.tpu_kv_write_probe          (under a minute)
             python -m tests.kernels.tpu_kv_write_probe --int8-write
On CPU:      JAX_PLATFORMS=cpu python -m tests.kernels.tpu_kv_write_probe --smoke [--int8-write]
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
from slipstream.kernels.tpu import kv_write, layout
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


def probe_int8_write(spec: str, *, layers: int, kvh: int, hd: int, ps: int, reps: int, profile: bool) -> dict:
    """layout.write_kv on an int8 cache, the scatter against the Pallas kernel (see the module's docstring)."""
    page, off, seqs, n_pages = _write_case(spec, ps)
    t_len = page.shape[0]
    interpret = jax.default_backend() != "tpu"
    key = jax.random.PRNGKey(0)
    shapes = layout.shapes(layers, kvh, n_pages, ps, hd, jnp.int8)

    def fresh():
        return {"kv": jax.random.randint(key, shapes["kv"].shape, -127, 128, jnp.int8),
                "kv_scale": jax.random.uniform(key, shapes["kv_scale"].shape, jnp.float32)}
    k = jax.random.normal(jax.random.PRNGKey(1), (t_len, kvh, hd), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(jax.random.PRNGKey(2), (t_len, kvh, hd), jnp.float32).astype(jnp.bfloat16)
    page, off = jnp.asarray(page), jnp.asarray(off)
    bound = min(t_len, t_len // ps + 2 * seqs)

    def write_fn(how):
        def run(c):
            def body(c, layer):
                return layout.write_kv(c, layer, k, v, page, off, quantize_kv, int8_write=how, max_items=bound,
                                       interpret=interpret), None
            return jax.lax.scan(body, c, jnp.arange(layers, dtype=jnp.int32))[0]
        return run

    out = {"form": layout.form(fresh()), "tokens": t_len}
    one = {how: jax.jit(lambda c, how=how: layout.write_kv(c, jnp.int32(layers - 1), k, v, page, off, quantize_kv,
                                                           int8_write=how, max_items=bound,
                                                           interpret=interpret))(fresh())
           for how in layout.WRITES}
    out["bit_identical"] = all(bool(jnp.array_equal(one["scatter"][n], one["kernel"][n])) for n in ("kv", "kv_scale"))
    del one
    for how in layout.WRITES:
        cache = fresh()
        fn = jax.jit(write_fn(how), donate_argnums=(0,)).lower(cache).compile()
        r, once = timed(fn, cache, cache, layers=layers, reps=reps)
        r["wall_us_per_layer"] = round(r["wall_us_per_layer"], 1)
        if profile:
            _, ops, summary = device_ops(once, top=6, layers=layers)
            r["loop_us_per_layer"] = summary["loop_us"]
            r["write_us_per_layer"] = summary["write_us"]
            r["top_ops"] = [[n[:120], round(us, 2), c] for n, us, c in ops]
        out[how] = r
        del once, cache
    a, b = out["scatter"], out["kernel"]
    key_t = "loop_us_per_layer" if profile and a.get("loop_us_per_layer") and b.get("loop_us_per_layer") \
        else "wall_us_per_layer"
    out["kernel_over_scatter"] = round(b[key_t] / a[key_t], 3)
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
    if args.int8_write:
        return _main_int8_write(args, dims, on_tpu)
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
            r = probe_int8_write(spec, profile=on_tpu, **dims)
            ok &= r["bit_identical"] and r["kernel"]["cache_copies"] == 0
        except Exception as exc:  # noqa: BLE001 - one case failing must not hide the others
            r = {"error": f"{type(exc).__name__}: {str(exc)[:3000]}"}
            ok = False
        results[spec] = r
        print(f"  {spec:>8s} {json.dumps(r)}", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "tpu_kv_write_probe.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
