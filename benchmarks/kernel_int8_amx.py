"""Sections [4], [5] and [8] of `python -m benchmarks.kernel int8` (benchmarks/kernel_int8.py's docstring): the q8
kernel's AMX tile paths against its AVX-512 VNNI path at --rows, the default model's engine steps on each path, and
the default dispatch against VNNI alone on the decode-step chain."""
from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernel_int8 import LAYER_SHAPES, LM_HEAD, N_LAYERS, PREFILL_SHAPES, random_q4, random_q8
from benchmarks.measure import amx_peak
from slipstream.kernels import q8_matmul as q8
from slipstream.kernels import settings


def amx_rows(ext, rng: np.random.Generator, rows: list[int], reps: int) -> None:
    """[4]: the tile unit's dense peak, then the q8 kernel's AMX paths against its VNNI path, timed alternately in
    one process: the exact int8 tile path (tdpbsud, bit for bit VNNI's) for q8_0, q8_0-a16 and q4-a16, and for
    q8_0-a16 the bf16 hi + lo path (pack_tiles)."""
    cores = len(os.sched_getaffinity(0))
    try:
        ext.set_isa("amx")
    except ValueError:
        raise SystemExit(f"this CPU or OS gives no AMX (kernel isa {ext.isa()}): nothing to measure") from None
    peaks = {kind: amx_peak(cores, kind) for kind in ("int8", "bf16")}
    if None in peaks.values():
        raise SystemExit("benchmarks/amx_peak.c could not be built or run here (a C compiler with -mamx-*)")
    print(f"\n[4] AMX: dense tile products on {cores} cores (benchmarks/amx_peak.c, random data): int8 "
          f"{peaks['int8']:.0f} GOP/s, bf16 {peaks['bf16']:.0f} GFLOP/s. The kernel's paths timed alternately: vnni, "
          "int8 (the exact tile path), bf16 (q8_0-a16 with pack_tiles); ms = median; GOP/s = 2*M*K*N / median; "
          "int8 pk = int8's share of the int8 peak; ratios = medians of the per-rep ratios")
    default_rows = ext.amx_rows(1, 1 << 30, 1, 1)  # the tile unit at every row count, to find where it wins
    print(f"    {'form':8} {'shape':20} {'M':>4} | {'vnni ms':>8} | {'int8 ms':>8} {'GOP/s':>6} {'int8 pk':>7} | "
          f"{'bf16 ms':>8} | {'int8/vnni':>9} {'bf16/vnni':>9} {'int8/bf16':>9}")
    try:
        for m in rows:
            for name, (k, n) in PREFILL_SHAPES.items():
                packed, scales, offsets = random_q8(rng, k, n, offsets=True)
                nibbles = random_q4(rng, k, n)
                x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
                for form, parts in (("q8_0", 1), ("q8_0-a16", 2), ("q4-a16", 2)):
                    if form == "q4-a16" and name.startswith("lm_head"):
                        continue  # the GGUF's LM head is Q8_0
                    if form == "q4-a16":  # 4-bit packing, as the default model's Q4_1 layers load
                        packed, scales, offsets = nibbles
                    off = offsets if parts == 2 else None
                    plain = jax.jit(lambda x, p=packed, s=scales, o=off, n=n, parts=parts:
                                    q8.q8_matmul(x, p, s, o, n=n, parts=parts))
                    paths = {"vnni": ("avx512_vnni", plain), "int8": ("amx", plain)}
                    if form == "q8_0-a16":
                        tiles = jnp.asarray(q8.pack_tiles(packed, scales, offsets))
                        paths["bf16"] = ("amx", jax.jit(lambda x, p=packed, s=scales, o=offsets, t=tiles, n=n:
                                                        q8.q8_matmul(x, p, s, o, n=n, parts=2, tiles=t)))
                    times: dict[str, list[float]] = {path: [] for path in paths}
                    for isa, fn in paths.values():  # warm-up: compile once, touch every path
                        ext.set_isa(isa)
                        fn(x).block_until_ready()
                    for _ in range(reps):
                        for path, (isa, fn) in paths.items():
                            ext.set_isa(isa)
                            t0 = time.perf_counter()
                            fn(x).block_until_ready()
                            times[path].append(time.perf_counter() - t0)
                    t = {path: np.array(v) for path, v in times.items()}
                    med = {path: np.median(v) for path, v in t.items()}
                    ops = 2.0 * m * k * n
                    ratio = lambda a, b: f"{np.median(t[a] / t[b]):8.2f}x" if a in t and b in t else f"{'-':>9}"  # noqa: E731
                    bf16 = f"{med['bf16'] * 1e3:8.3f}" if "bf16" in med else f"{'-':>8}"
                    print(f"    {form:8} {name:20} {m:>4} | {med['vnni'] * 1e3:8.3f} | {med['int8'] * 1e3:8.3f} "
                          f"{ops / med['int8'] / 1e9:6.0f} {ops / med['int8'] / 1e9 / peaks['int8']:7.1%} | {bf16} | "
                          f"{ratio('int8', 'vnni')} {ratio('bf16', 'vnni')} {ratio('int8', 'bf16')}", flush=True)
    finally:
        ext.set_isa("amx")
        ext.amx_rows(*default_rows)


def amx_engine(ext, reps: int) -> None:
    """[5]: decode and prefill steps of the default model with the q8 kernel's paths alternated per rep."""
    import statistics

    from benchmarks.engine import attention_only, build_from_args, decodes, fill, parse_args
    from slipstream.engine.api import StepBatch, StepSeq
    from slipstream.models.loader import load_model
    from slipstream.models.registry import resolve_model

    args = parse_args(["--slots", "32", "--context", "384", "--prefill-lengths", "256", "--quantize", "q8_0-a16",
                       "--kv-cache-dtype", "bfloat16"])
    cfg, params = load_model(resolve_model(args.model), quantize="q8_0-a16")
    setup = build_from_args(cfg, params, args)
    engine = setup.engine
    fill(setup, 0)
    slot = engine.max_slots - 1
    prompt = [int(t) for t in np.random.default_rng(1).integers(3, engine.vocab_size, 256)]
    chunk = StepBatch([StepSeq(slot, prompt, 0, setup.pages[slot], True)])
    attention = attention_only(setup, 32)
    default_rows = ext.amx_rows()
    bf16 = f"bf16 from {default_rows[3]}" if settings.AMX_BF16.get() else "no bf16 tiles"
    paths = {"vnni": ("avx512_vnni", default_rows),
             f"amx (int8 {default_rows[0]}-{default_rows[1]} rows, {bf16})": ("amx", default_rows)}
    times = {name: {part: [] for part in ("decode", "decode q8", "prefill", "prefill q8")} for name in paths}
    attention_ms = []

    def timed(run):
        ext.profile(True)
        start = time.perf_counter()
        run()
        jax.block_until_ready(engine.cache)
        took = time.perf_counter() - start
        return took, sum(end - begin for begin, end, _, _ in ext.profile(False)) / 1e9

    try:
        for rep in range(reps + 2):  # two warm-up rounds
            for name, (isa, rows) in paths.items():
                ext.set_isa(isa)
                ext.amx_rows(*rows)
                setup.rewind()  # every decode step writes the same position
                for part, run in (("decode", lambda: engine.step(StepBatch(decodes(setup, 32)))),
                                  ("prefill", lambda: engine.step(chunk))):
                    took, q8_s = timed(run)
                    if rep >= 2:
                        times[name][part].append(took)
                        times[name][part + " q8"].append(q8_s)
            start = time.perf_counter()
            jax.block_until_ready(attention())
            if rep >= 2:
                attention_ms.append((time.perf_counter() - start) * 1e3)
    finally:
        ext.set_isa("amx")
        ext.amx_rows(*default_rows)
    med = lambda v: statistics.median(v) * 1e3  # noqa: E731
    print(f"\n[5] engine steps, default model q8_0-a16, bf16 K/V (medians of {reps}, paths alternated): a 32-slot "
          f"decode step at 384 context (its attention alone: {statistics.median(attention_ms):.1f} ms) and a 256-token "
          "prefill chunk; q8: the time inside the q8 matmul calls")
    for name, t in times.items():
        print(f"    {name:40} decode {med(t['decode']):6.1f} ms (q8 {med(t['decode q8']):5.1f})   prefill "
              f"{med(t['prefill']):6.1f} ms (q8 {med(t['prefill q8']):5.1f})", flush=True)


def dispatch_rows(ext, rng: np.random.Generator, rows: list[int], reps: int) -> None:
    """[8]: the decode-step chain at each row count on the default dispatch and on VNNI alone, alternated per rep."""
    best = ext.isa()
    layers = [(random_q4(rng, k, n), n, name == "w_down")
              for _ in range(N_LAYERS) for name, (k, n) in LAYER_SHAPES.items()]
    head = random_q8(rng, *LM_HEAD)[:2]
    width = max(max(2 * k, n) for k, n in LAYER_SHAPES.values())  # the widest input (gated: 2K) or output

    def step(x, weights, head):
        h = x
        for (packed, scales, offsets), (_, n, gated) in zip(weights, layers):
            k = packed.shape[1] * 2 // q8.TILE  # 4 bits: Kp * 8 bytes per tile
            y = q8.q8_matmul(h[:, : 2 * k if gated else k], packed, scales, offsets, n=n, parts=2, gated=gated)
            h = h * 0.5 + jnp.pad(y, ((0, 0), (0, width - n))) * 0.5  # the next call's input depends on this one
        return q8.q8_matmul(h[:, : LM_HEAD[0]], *head, n=LM_HEAD[1], parts=2)

    fn = jax.jit(step)
    weights = [w for w, _, _ in layers]
    paths = [best] + (["avx512_vnni"] if best != "avx512_vnni" else [])
    print(f"\n[8] the decode-step chain (30 layers of 4-bit weights + the LM head, two parts) at each row count: the "
          f"default dispatch ({best}) against {paths[-1]}, alternated per rep; ms = medians; ratios = medians of the "
          "per-rep ratios")
    try:
        for m in rows:
            x = jnp.asarray(rng.standard_normal((m, width)).astype(np.float32))
            times = {isa: ([], []) for isa in paths}
            for isa in paths:  # compile, warm
                ext.set_isa(isa)
                fn(x, weights, head).block_until_ready()
            for rep in range(reps):
                for isa in (paths if rep % 2 == 0 else paths[::-1]):
                    ext.set_isa(isa)
                    ext.profile(True)
                    start = time.perf_counter()
                    fn(x, weights, head).block_until_ready()
                    times[isa][0].append(time.perf_counter() - start)
                    times[isa][1].append(sum(end - begin for begin, end, _, _ in ext.profile(False)) / 1e9)
            ext.set_isa(best)
            route = ext.route(m, 2)
            (a, qa), (v, qv) = (tuple(np.asarray(t) for t in times[isa]) for isa in (paths[0], paths[-1]))
            print(f"    rows {m:3d} ({route:22s}) chain {np.median(a) * 1e3:7.2f} / {np.median(v) * 1e3:7.2f} ms = "
                  f"{np.median(a / v):5.3f}; q8 calls {np.median(qa) * 1e3:7.2f} / {np.median(qv) * 1e3:7.2f} ms = "
                  f"{np.median(qa / qv):5.3f}", flush=True)
    finally:
        ext.set_isa(best)
