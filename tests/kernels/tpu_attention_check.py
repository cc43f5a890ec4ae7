"""Device check of the Pallas TPU ragged paged attention (kernels/tpu): speed and correctness on the chip.

On the TPU:   python -m tests.kernels.tpu_attention_check --profile  (about 4-5 minutes with compiles)
On CPU:       JAX_PLATFORMS=cpu python -m tests.kernels.tpu_attention_check --smoke   (interpret mode, tiny)

Order (each step is skipped once --budget-s seconds have passed; partial results print and save as they come):
(b) Decode speed, Llama-3-8B heads (32 q heads, 8 KV heads, hd 128), 128-token pages, bf16 activations,
    per layer, timed over a lax.scan of 8 layers (each layer writes its K/V and attends): bf16 KV at
    32 seqs x 384 and 64 x 2048, int8 KV at 64 x 2048, with the first keyword set of --variants. GB/s = KV
    bytes read (K, V and int8 scales of every sequence's context) / time, and its fraction of the HBM read
    rate measured in the same run (jnp.sum over 2 GiB of f32, best of 5). Targets: 64 x 2048 >= 70%,
    32 x 384 >= 50%, int8 >= 60%. The wall time per layer carries 1/8 of the call's launch cost (about
    0.9 ms per call on the v5e); with --profile each program also reports its device time per layer
    from the profiler (the layer loop, which holds the K/V write and the kernels, and the kernels alone).
    Each program's count of cache-sized copies shows whether the K/V write is in place.
(a) The property cases of tests/kernels/tpu_cases.py at 128-token pages, compiled for the chip, against the
    pure-JAX reference (its f32 matmuls at highest precision): PASS/FAIL per case with the max error, once
    per keyword set of --case-kw.
Then the other --variants (default: a block-size sweep: pages_per_block, decode_rows, merge_pages), and
(c) the mixed step per --mixed-variants: 32 decodes (1024 context) + one 512-token prefill chunk (after 512
    cached tokens) in one call, against the decode-only and prefill-only calls. Target: mixed <= 1.2 x
    (decode + prefill).
JSON: $OUT/tpu_attention_check.json (or ./ without OUT). Exit status 1 when a case fails or a decode
program copies the cache (the K/V write must update the donated cache in place).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.device_profile import device_ops as profiled_ops
from slipstream.kernels.tpu import layout
from slipstream.kernels.tpu.ragged_paged_attention import ragged_paged_attention
from tests.kernels.tpu_cases import SPECS, check, tolerance

LAYERS = 8
_layers = LAYERS   # --smoke: 2


def _best_time(fn, *args, reps: int = 5) -> tuple[float, object]:
    """Best wall time of fn(*args) over reps calls (after a warm-up); fn returns (result, carry to feed)."""
    out = jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best, out


def hbm_read_gbs(n_bytes: int) -> float:
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    f = jax.jit(jnp.sum)
    t, _ = _best_time(f, x)
    del x
    return n_bytes / t / 1e9


@dataclasses.dataclass(frozen=True)
class Step:
    """A batch: `decodes` sequences of one token at context `ctx`, plus `prefills` chunks of `chunk`
    tokens after `cached` tokens."""
    decodes: int
    ctx: int
    prefills: int = 0
    chunk: int = 0
    cached: int = 0


def make_step(step: Step, *, kv_heads: int, group: int, hd: int, page_size: int, dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    q_lens = [1] * step.decodes + [step.chunk] * step.prefills
    kv_lens = [step.ctx] * step.decodes + [step.cached + step.chunk] * step.prefills
    need = [-(-k // page_size) for k in kv_lens]
    p = max(need)
    pages = rng.permutation(np.arange(1, sum(need) + 1)).astype(np.int32)
    table = np.zeros((len(q_lens), p), np.int32)
    at = 0
    for i, k in enumerate(need):
        table[i, :k] = pages[at:at + k]
        at += k
    t = sum(q_lens)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    shapes = layout.shapes(_layers, kv_heads, sum(need) + 1, page_size, hd, dtype)
    key = jax.random.PRNGKey(seed)
    cache = {}
    for name, s in shapes.items():
        if s.dtype == jnp.int8:
            cache[name] = jax.random.randint(key, s.shape, -127, 128, jnp.int8)
        elif name == "kv_scale":
            cache[name] = jnp.full(s.shape, 0.01, jnp.float32)
        else:
            cache[name] = jax.random.normal(key, s.shape, s.dtype)   # no f32 temporary of the cache's size
    h = kv_heads * group
    act = jnp.bfloat16
    q = jax.random.normal(key, (t, h, hd), jnp.float32).astype(act)
    kn = jax.random.normal(key, (t, kv_heads, hd), jnp.float32).astype(act)
    idx = (jnp.asarray(kv_lens, jnp.int32), jnp.asarray(table), jnp.asarray(cu), jnp.asarray([len(q_lens)], jnp.int32))
    kv_bytes = sum(kv_lens) * kv_heads * 2 * hd * jnp.dtype(dtype).itemsize
    if jnp.dtype(dtype) == jnp.int8:
        kv_bytes += sum(kv_lens) * kv_heads * 2 * 4
    return (q, kn, kn, cache) + idx, kv_bytes


def layers_fn(sm_scale: float, interpret: bool, **block_kw):
    """(q, k, v, cache, kv_lens, page_indices, cu_q_lens, num_seqs) -> (sum of outputs, cache): the kernel
    once per layer under one lax.scan, the cache carried (donated)."""
    def run(q, k, v, cache, kv_lens, pages, cu, ns):
        def body(c, layer):
            out, c = ragged_paged_attention(q, k, v, c, layer, kv_lens, pages, cu, ns, sm_scale=sm_scale,
                                            interpret=interpret, **block_kw)
            return c, out[0, 0, 0].astype(jnp.float32)
        cache, outs = jax.lax.scan(body, cache, jnp.arange(_layers, dtype=jnp.int32))
        return outs.sum(), cache
    return jax.jit(run, donate_argnums=(3,))


def copy_lines(compiled, cache: dict) -> list[str]:
    """The compiled program's copy instructions of a whole layer-stacked cache array (none: the K/V write
    updates the donated cache in place); each line shows the layouts it converts between."""
    hlo_types = {"bfloat16": "bf16", "float32": "f32", "int8": "s8"}
    shapes = [f"{hlo_types[jnp.dtype(a.dtype).name]}[{','.join(map(str, a.shape))}]" for a in cache.values()]
    return [line.strip() for line in compiled.as_text().splitlines()
            if any(f"= {s}" in line for s in shapes) and (" copy(" in line or "copy-start(" in line)]


def device_ops(call, top: int = 14, layers: int | None = None) -> tuple[list[str], list, dict]:
    """One call of `call` under the profiler: (the device planes' line names, the `top` device ops by time:
    (name, us per layer, count), summarize's totals); a layer is 1/layers of the call (default: the scan's)."""
    lines, ops = profiled_ops(call, top=10 ** 6, per=layers or _layers)
    return lines, ops[:top], summarize(ops)


def summarize(ops) -> dict:
    """us per layer on the device: the layer loop (the while op spans its body: no per-call launch cost),
    the attention kernels (rpa_*), the K/V write (the scatter, or kernels/tpu/kv_write.py's kv_write_int8)."""
    loops = [us for n, us, _ in ops if n.startswith("%while")]
    return {"loop_us": max(loops) if loops else None,
            "kernel_us": sum(us for n, us, _ in ops if "rpa_" in n.split("=")[0]),
            "write_us": sum(us for n, us, _ in ops if any(w in n.split("=")[0] for w in ("scatter", "kv_write")))}


def time_step(args, sm_scale, interpret, reps, copies: dict | None = None, profile: list | None = None,
              **block_kw) -> float:
    """Seconds per layer (one compile); `copies`, when given, gets {"cache_copies": n, "compile_s": s};
    `profile`, when given, gets the top device ops of one more call."""
    q, k, v, cache, *idx = args
    t0 = time.perf_counter()
    fn = layers_fn(sm_scale, interpret, **block_kw).lower(q, k, v, cache, *idx).compile()
    if copies is not None:
        copies["compile_s"] = time.perf_counter() - t0
        lines = copy_lines(fn, cache)
        copies["cache_copies"] = len(lines)
        if lines:
            copies["copy_lines"] = [line[:700] for line in lines[:3]]
            print(f"  cache-sized copy: {lines[0][:700]}", flush=True)
    state = {"cache": cache}

    def once():
        s, state["cache"] = fn(q, k, v, state["cache"], *idx)
        return s

    t, _ = _best_time(lambda: once(), reps=reps)
    if profile is not None:
        try:
            profile.append(device_ops(once))
        except Exception as exc:  # noqa: BLE001 - a profiler failure must not lose the timing
            profile.append(([f"profile failed: {type(exc).__name__}: {exc}"], [], {}))
    return t / _layers


def say_profile(rep, profile: list, label: str, top: int = 4, kv_bytes: float | None = None,
                hbm: float | None = None) -> dict:
    """Print the device summary and the top ops; returns both for the JSON."""
    for lines, ops, summary in profile:
        if not ops:
            rep.say(f"    profile {label}: no 'XLA Ops' events; device lines: {lines[:12]}")
            return {}
        line = ", ".join(f"{k[:-3]} {v:.1f} us" for k, v in summary.items() if v is not None)
        if kv_bytes and summary.get("loop_us"):
            gbs_loop = kv_bytes / summary["loop_us"] / 1e3
            gbs_kernel = kv_bytes / summary["kernel_us"] / 1e3 if summary["kernel_us"] else 0.0
            summary.update(loop_gbs=gbs_loop, loop_of_hbm=gbs_loop / hbm, kernel_gbs=gbs_kernel,
                           kernel_of_hbm=gbs_kernel / hbm)
            line += (f"; per layer on the device: {gbs_loop:.0f} GB/s ({gbs_loop / hbm:.0%} of HBM read), "
                     f"kernel alone {gbs_kernel:.0f} GB/s ({gbs_kernel / hbm:.0%})")
        rep.say(f"    device {label}: {line}")
        for name, us, n in ops[:top]:
            rep.say(f"    profile {label}: {us:9.2f} us/layer  x{n:<4d} {name[:80]}")
        return {"summary": summary, "ops": [[name[:300], round(us, 2), n] for name, us, n in ops]}
    return {}


class Report:
    def __init__(self, path: str, budget_s: float):
        self.path, self.t0, self.budget = path, time.perf_counter(), budget_s
        self.data: dict = {"device": str(jax.devices()[0]), "cases": {}, "decode": {}, "mixed": {}}

    def save(self) -> None:
        with open(self.path, "w") as f:
            json.dump(self.data, f, indent=1)

    def out_of_time(self) -> bool:
        return time.perf_counter() - self.t0 > self.budget

    def say(self, line: str) -> None:
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {line}", flush=True)


def correctness(rep: Report, interpret: bool, case_kw: list[dict]) -> None:
    """On the chip: every case at 128-token pages (200 more cached tokens, so several pages) with each
    keyword set of case_kw; in --smoke: two cases at their 16-token pages."""
    rep.say("(a) property cases vs the reference (f32 matmuls at highest precision)")
    if interpret:
        variants = [(s, "ps16", {"pages_per_block": 2, "prefill_rows": 8}) for s in SPECS[:2]]
    else:
        variants = [(dataclasses.replace(s, page_size=128, cached=tuple(c + 200 for c in s.cached)),
                     "ps128" + (f"/{_tag(kw)}" if kw else ""), kw) for kw in case_kw for s in SPECS]
    for spec, tag, block_kw in variants:
        name = f"{spec.name}/{tag}"
        if rep.out_of_time():
            rep.say(f"  time budget spent: {name} skipped")
            continue
        try:
            err, _ = check(spec, interpret=interpret, atol=tolerance(spec), **block_kw)
            rep.data["cases"][name] = {"pass": True, "max_abs_err": err}
            rep.say(f"  PASS {name:32s} max |out - ref| {err:.2e} (tolerance {tolerance(spec):.0e})")
        except Exception as exc:  # noqa: BLE001 - every failure is reported, the next case still runs
            rep.data["cases"][name] = {"pass": False, "error": f"{type(exc).__name__}: {str(exc)[:2000]}"}
            rep.say(f"  FAIL {name:32s} {type(exc).__name__}: {str(exc)[:1500]}")
        rep.save()


def _tag(kw: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(kw.items())) or "default"


# (pages_per_block, decode_rows, merge_pages) sweep of the default run; decode_rows 8 pads each decode item
# to 32 query rows (GQA 4); merge_pages False: one softmax update per page
SWEEP = [{}, {"merge_pages": False}, {"pages_per_block": 2}, {"pages_per_block": 8}, {"decode_rows": 8}]


def speed_jobs(rep: Report, smoke: bool, interpret: bool, variants: list[dict], cases: list[str] | None,
               mixed_variants: list[dict], profile: bool) -> tuple[list, list]:
    """(first jobs: each decode case at the first variant; the rest: the other variants, then the mixed step)."""
    if smoke:
        kvh, group, hd, ps, reps = 2, 2, 128, 16, 1
        decode_cases = [("bf16_4x40", Step(4, 40), jnp.bfloat16), ("int8_4x40", Step(4, 40), jnp.int8)]
        mixed = (Step(3, 40), Step(0, 0, 1, 24, 16))
        variants = variants or [{"pages_per_block": 1}, {"pages_per_block": 2, "decode_rows": 8}]
        mixed_variants = [{"prefill_rows": 8}] if mixed_variants is None else mixed_variants
    else:
        kvh, group, hd, ps, reps = 8, 4, 128, 128, 5
        decode_cases = [("bf16_32x384", Step(32, 384), jnp.bfloat16), ("bf16_64x2048", Step(64, 2048), jnp.bfloat16),
                        ("int8_64x2048", Step(64, 2048), jnp.int8),
                        # the 8B engine's 64-slot step (issue 48's 1.25x target; its contexts are 1025+): opt in with --cases
                        ("int8_64x1024", Step(64, 1024), jnp.int8),
                        ("int8_64x1025", Step(64, 1025), jnp.int8)]   # 9 pages: a last block of one
        mixed = (Step(32, 1024), Step(0, 0, 1, 512, 512))
        variants = variants or SWEEP
        mixed_variants = [{"prefill_rows": 128}, {"prefill_rows": 256}] if mixed_variants is None else mixed_variants
    if cases:
        decode_cases = [c for c in decode_cases if c[0] in cases]
    else:
        decode_cases = [c for c in decode_cases if c[0] not in ("int8_64x1024", "int8_64x1025")]
    hbm = hbm_read_gbs(2 ** 20 * (4 if smoke else 2048))
    rep.data["hbm_read_gbs"] = hbm
    rep.say(f"HBM read (jnp.sum over {'4 MiB' if smoke else '2 GiB'} f32, best of 5): {hbm:.0f} GB/s")
    sm = hd ** -0.5
    rep.say(f"(b) decode, {kvh * group} q heads / {kvh} KV heads / hd {hd}, pages of {ps}, per layer "
            f"({_layers} layers under one scan)")
    dec, pre = mixed
    both = Step(dec.decodes, dec.ctx, pre.prefills, pre.chunk, pre.cached)

    def decode(name, step, dtype, kw):
        kw = dict(kw)
        if kw.pop("only", name) not in name:     # {"only": "int8", ...}: a variant of the cases so named
            return
        tag = _tag(kw)
        entry = rep.data["decode"].setdefault(name, {"sweep": {}, "best": None})
        args, kv_bytes = make_step(step, kv_heads=kvh, group=group, hd=hd, page_size=ps, dtype=dtype)
        entry["kv_mb_per_layer"] = kv_bytes / 1e6
        prof = [] if profile else None
        try:
            copies = {}
            t = time_step(args, sm, interpret, reps, copies=copies, profile=prof, **kw)
            gbs = kv_bytes / t / 1e9
            entry["sweep"][tag] = {"ms": t * 1e3, "gbs": gbs, "of_hbm": gbs / hbm, **(copies or {})}
            note = (f"   (compiled in {copies['compile_s']:.0f} s; cache-sized copies: {copies['cache_copies']})"
                    if copies else "")
            rep.say(f"  {name:14s} {tag:>34s} {t * 1e3:8.3f} {gbs:7.1f} {gbs / hbm:7.0%}{note}")
            if prof:
                entry["sweep"][tag]["profile"] = say_profile(rep, prof, name, kv_bytes=kv_bytes, hbm=hbm)
        except Exception as exc:  # noqa: BLE001 - a variant that fails to compile is reported, not fatal
            entry["sweep"][tag] = {"error": f"{type(exc).__name__}: {str(exc)[:2000]}"}
            rep.say(f"  {name:14s} {tag:>34s} FAILED {type(exc).__name__}: {str(exc)[:1500]}")
        ok = [v for v in entry["sweep"].values() if "ms" in v]
        entry["best"] = min(ok, key=lambda v: v["ms"]) if ok else None

    def mixed_run(kw):
        tag = _tag(kw)
        try:
            ts, profs, loops = [], {}, []
            for label, step in (("decode-only", dec), ("prefill-only", pre), ("mixed", both)):
                args, _ = make_step(step, kv_heads=kvh, group=group, hd=hd, page_size=ps, dtype=jnp.bfloat16)
                prof = [] if profile else None
                ts.append(time_step(args, sm, interpret, reps, profile=prof, **kw))
                if prof:
                    profs[label] = say_profile(rep, prof, label)
                    if profs[label].get("summary", {}).get("loop_us"):
                        loops.append(profs[label]["summary"]["loop_us"])
                del args
            rep.data["mixed"][tag] = {"decode_ms": ts[0] * 1e3, "prefill_ms": ts[1] * 1e3, "mixed_ms": ts[2] * 1e3,
                                      "ratio": ts[2] / (ts[0] + ts[1]), "profile": profs}
            if len(loops) == 3:
                rep.data["mixed"][tag]["device_ratio"] = loops[2] / (loops[0] + loops[1])
                rep.say(f"    device per layer: decode {loops[0]:.1f} us, prefill {loops[1]:.1f} us, "
                        f"mixed {loops[2]:.1f} us = {loops[2] / (loops[0] + loops[1]):.2f} x (decode + prefill)")
            rep.say(f"(c) mixed ({dec.decodes} decodes x {dec.ctx} + a {pre.chunk}-token chunk after {pre.cached} "
                    f"cached, bf16 KV), {tag}: decode alone {ts[0] * 1e3:.3f} ms, prefill alone "
                    f"{ts[1] * 1e3:.3f} ms, mixed {ts[2] * 1e3:.3f} ms = {ts[2] / (ts[0] + ts[1]):.2f} x "
                    "(decode + prefill)")
        except Exception as exc:  # noqa: BLE001
            rep.data["mixed"][tag] = {"error": f"{type(exc).__name__}: {str(exc)[:2000]}"}
            rep.say(f"(c) mixed, {tag}: FAILED {type(exc).__name__}: {str(exc)[:1500]}")

    # most important first, so a spent budget leaves every case with its first variant measured
    first = [functools.partial(decode, *c, variants[0]) for c in decode_cases]
    rest = [functools.partial(decode, *c, kw) for kw in variants[1:] for c in decode_cases]
    rest += [functools.partial(mixed_run, kw) for kw in mixed_variants]
    rep.say(f"  {'case':14s} {'variant':>34s} {'ms':>8s} {'GB/s':>7s} {'of HBM':>7s}")
    return first, rest


def run_jobs(rep: Report, jobs: list) -> None:
    for n, job in enumerate(jobs):
        if rep.out_of_time():
            rep.say(f"time budget spent: {len(jobs) - n} measurements skipped")
            return
        job()
        rep.save()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes in Pallas' TPU interpret mode (CPU)")
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="start no new measurement or case after this many seconds")
    ap.add_argument("--skip-cases", action="store_true", help="speed only")
    ap.add_argument("--skip-speed", action="store_true", help="property cases only")
    ap.add_argument("--variants", type=json.loads, default=None,
                    help="JSON list of kernel keyword sets for the decode cases (default: a block-size sweep; "
                         "the first is measured first; "
                         "\"only\": \"int8\" limits a set to the cases whose name contains int8)")
    ap.add_argument("--mixed-variants", type=json.loads, default=None,
                    help="JSON list of kernel keyword sets for the mixed step (default: prefill_rows 128, 256)")
    ap.add_argument("--cases", type=lambda v: v.split(","), default=None,
                    help="decode cases to time (comma-separated names; default all)")
    ap.add_argument("--profile", action="store_true", help="print each program's top device ops")
    ap.add_argument("--case-kw", type=json.loads, default=[{}],
                    help="JSON list of kernel keyword sets the property cases run with (each: all cases)")
    args = ap.parse_args(argv)
    interpret = args.smoke or jax.default_backend() != "tpu"
    global _layers
    _layers = 2 if args.smoke else LAYERS
    if interpret and not args.smoke:
        print("not on a TPU: run with --smoke (interpret mode, tiny sizes)", file=sys.stderr)
        return 2
    rep = Report(os.path.join(os.environ.get("OUT", "."), "tpu_attention_check.json"), args.budget_s)
    rep.say(f"device: {rep.data['device']}, interpret={interpret}")
    # order: decode and mixed at default blocks, the property cases, then the block-size sweep
    first, rest = (speed_jobs(rep, args.smoke, interpret, args.variants, args.cases, args.mixed_variants,
                              args.profile) if not args.skip_speed else ([], []))
    run_jobs(rep, first)
    if not args.skip_cases:
        correctness(rep, interpret, args.case_kw)
    run_jobs(rep, rest)
    n_fail = sum(not c["pass"] for c in rep.data["cases"].values())
    copied = sorted(name for name, e in rep.data["decode"].items()
                    if any(v.get("cache_copies", 0) for v in e["sweep"].values()))
    rep.say(f"done: {len(rep.data['cases']) - n_fail} cases passed, {n_fail} failed; programs with a "
            f"cache-sized copy: {copied or 'none'}; JSON: {rep.path}")
    rep.save()
    return 1 if n_fail or copied else 0


if __name__ == "__main__":
    sys.exit(main())
