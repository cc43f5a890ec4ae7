"""Engine speed on the default model: decode step vs a matmul-only roofline, prefill, compile time.

Drives JaxEngine through its Engine protocol. Every ratio compares numbers measured in the same run,
interleaved, because the host is shared. Run from the repo root:
    .venv/bin/python -m benchmarks.engine_bench [--slots 1,8,32,64] [--skip-compile] [--out bench.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.profiling import profile_ops
from engine.api import DecodeRow, PrefillChunk, SlotState
from engine.kv_cache import pages_needed
from engine.request import SamplingParams
from engine.compile_count import enable_compilation_cache
from engine.runner import EngineConfig, JaxEngine
from engine.sampling import SamplingArrays
from models.config import ModelConfig
from models.layers import linear
from models.llama import forward_paged
from models.loader import load_model
from models.registry import DEFAULT_MODEL, resolve_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20)


def _ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1e3


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def _interleaved(fns: dict[str, Callable[[], object]], reps: int, warmup: int) -> dict[str, list[float]]:
    """Round-robin timing: every function sees the same background load, so ratios are fair."""
    for _ in range(warmup):
        for fn in fns.values():
            jax.block_until_ready(fn())
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(_timed(fn))
    return times


# ---- references measured in the same run --------------------------------------------------------

def copy_seconds(nbytes: int, reps: int) -> tuple[float, float]:
    """Median seconds to copy nbytes between two existing buffers (memcpy) and to read them once
    (an XLA sum). A jitted jnp.copy is no use here: its fresh 256 MB output is page-faulted in on
    every call, which measured ~1 GB/s on this host instead of the ~10 GB/s memcpy gets."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.zeros_like(src)
    x = jnp.asarray(src)
    times = _interleaved({"copy": lambda: np.copyto(dst, src), "read": lambda: _read(x)}, reps, warmup=2)
    return statistics.median(times["copy"]), statistics.median(times["read"])


@jax.jit
def _read(x: jax.Array) -> jax.Array:
    return jnp.sum(x)


def _leaf_bytes(tree) -> int:
    return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(tree))


def weight_bytes_read_per_token(params: dict) -> int:
    """Bytes a decode step must read: every layer weight and the LM head (the tied embedding
    table is read whole by the LM head; untied, only a few rows of it are looked up)."""
    head = params["lm_head"] if "lm_head" in params else params["embed"]
    norms = params["final_norm"].nbytes
    return _leaf_bytes(params["layers"]) + _leaf_bytes(head) + norms


def matmul_roofline(params: dict, cfg: ModelConfig) -> Callable[[jax.Array], jax.Array]:
    """A jitted function doing only the decode step's matmuls (q, k, v, o, gate, up, down for every
    layer, then the LM head) on the engine's own weights, each layer's weights a separate input so
    no slicing is counted. The few adds between them only keep XLA from dropping a matmul."""
    layers = params["layers"]
    if not isinstance(layers, (list, tuple)):  # stacked: one buffer per layer, sliced once here
        layers = jax.block_until_ready([jax.tree.map(lambda w, i=i: w[i], layers) for i in range(cfg.num_layers)])
    head_tied = "lm_head" not in params
    head = params["embed"] if head_tied else params["lm_head"]
    reps = cfg.num_heads // cfg.num_kv_heads

    @jax.jit
    def run(layers, head, x):
        for lp in layers:
            q, k, v = linear(x, lp["wq"]), linear(x, lp["wk"]), linear(x, lp["wv"])
            o = linear(q + jnp.tile(k + v, (1, reps)), lp["wo"])
            x = x + linear(linear(o, lp["w_gate"]) * linear(o, lp["w_up"]), lp["w_down"])
        if head_tied:
            return jnp.einsum("bd,vd->bv", x, head.astype(x.dtype), preferred_element_type=jnp.float32)
        return linear(x, head)

    return functools.partial(run, layers, head)


# ---- decode -------------------------------------------------------------------------------------

@dataclasses.dataclass
class DecodeSetup:
    engine: JaxEngine
    pages: list[list[int]]
    context: int


def build_engine(cfg: ModelConfig, params: dict, args: argparse.Namespace) -> DecodeSetup:
    max_slots = max(args.slots)
    longest = args.context + args.warmup + args.steps + 1
    pages_per_seq = pages_needed(longest, args.page_size)
    config = EngineConfig(max_slots=max_slots, page_size=args.page_size, max_seq_len=args.max_seq_len,
                          num_pages=max_slots * pages_per_seq + 1, dtype=args.dtype,
                          kv_cache_dtype=args.kv_cache_dtype, quantize=args.quantize)
    calibration = None
    if args.quantize != "none":  # as `slipstream serve` does: smoothed on the shipped calibration text
        from models.calibration import calibration_text
        from models.registry import load_tokenizer

        calibration = load_tokenizer(resolve_model(args.model)).encode(calibration_text())
    engine = JaxEngine(cfg, params, config, precompile=False, calibration_tokens=calibration)
    pages = [list(range(1 + s * pages_per_seq, 1 + (s + 1) * pages_per_seq)) for s in range(max_slots)]
    return DecodeSetup(engine, pages, args.context)


def prefill_prompts(setup: DecodeSetup, seed: int) -> None:
    """A distinct random prompt of `context` tokens per slot, prefilled as the scheduler would
    (all but the last token; the decode step feeds that one)."""
    engine, rng = setup.engine, np.random.default_rng(seed)
    chunk = engine.max_prefill_chunk
    for slot, pages in enumerate(setup.pages):
        prompt = [int(t) for t in rng.integers(3, engine.vocab_size, setup.context)]
        for start in range(0, setup.context - 1, chunk):
            engine.prefill(PrefillChunk(prompt[start:min(start + chunk, setup.context - 1)], start, pages))
        engine.insert(slot, SlotState(prompt, [], GREEDY))
    jax.block_until_ready(engine.cache)


def decode_rows(setup: DecodeSetup, batch: int, step: int) -> list[DecodeRow]:
    position = setup.context - 1 + step
    return [DecodeRow(s, 100 + s, position, setup.pages[s]) for s in range(batch)]


def decode_bucket(setup: DecodeSetup, batch: int, args: argparse.Namespace) -> tuple[int, int]:
    """(batch, pages) bucket of every timed step: the longest row ends at context + warmup + steps."""
    engine = setup.engine
    return (engine.buckets.decode_batch(batch),
            engine.buckets.pages(pages_needed(setup.context + args.warmup + args.steps, engine.page_size)))


def model_step(setup: DecodeSetup, batch: int, args: argparse.Namespace) -> Callable[[], jax.Array]:
    """The model program alone, doing what generate() does: forward_paged at the same bucket
    shapes, block tables and advancing positions, on the engine's params and cache (donated and
    put back, as the engine does)."""
    engine, cfg = setup.engine, setup.engine.model_cfg
    ps = engine.page_size
    b, p = decode_bucket(setup, batch, args)
    tokens = np.zeros((b, 1), np.int32)
    tokens[:batch, 0] = 100 + np.arange(batch)
    table = np.zeros((b, p), np.int32)
    for i in range(batch):
        n = min(p, len(setup.pages[i]))
        table[i, :n] = setup.pages[i][:n]
    model_fn = jax.jit(functools.partial(forward_paged, cfg=cfg, page_size=ps, dtype=engine.dtype),
                       donate_argnames=("cache",))
    step = [0]

    def model():
        positions, write = np.zeros((b, 1), np.int32), np.zeros((b, 1), np.int32)
        for i, row in enumerate(decode_rows(setup, batch, step[0])):
            positions[i, 0] = row.position
            write[i, 0] = row.page_ids[row.position // ps] * ps + row.position % ps
        step[0] += 1
        logits, engine.cache = model_fn(engine.params, cache=engine.cache, tokens=tokens, positions=positions,
                                        write_slots=write, block_tables=table, last_index=np.zeros(b, np.int32))
        return logits

    return model


def measure_decode(setup: DecodeSetup, roofline: Callable, batch: int, args: argparse.Namespace) -> dict:
    """Per batch: the engine's full step (generate: host prep, decode, sampling, host fetch), the
    model program alone, the sampling program alone and the matmul-only roofline, interleaved."""
    engine, cfg = setup.engine, setup.engine.model_cfg
    b, p = decode_bucket(setup, batch, args)
    step = [0]

    def generate():
        engine.generate(decode_rows(setup, batch, step[0]))
        step[0] += 1

    # the sampling program alone, as the runner compiles it (its private step body), greedy
    sample_fn = jax.jit(JaxEngine._sample_step, donate_argnums=(1,))
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((b, engine.vocab_size), np.float32))
    state = [(jnp.zeros((b + 1, engine.vocab_size), jnp.int32), jnp.zeros((b + 1, engine.vocab_size), bool))]
    sarrays = SamplingArrays.from_params([GREEDY] * batch, [0] * batch, [0] * batch, b)
    slot_ids, active = np.arange(b, dtype=np.int32), np.arange(b) < batch

    def sample():
        result, state[0] = sample_fn(logits, state[0], slot_ids, active, sarrays)
        return jax.device_get(result)

    x = jnp.ones((b, cfg.hidden_size), engine.dtype)
    times = _interleaved({"step": generate, "model": model_step(setup, batch, args), "sample": sample,
                          "roofline": lambda: roofline(x)}, args.steps, args.warmup)
    ms = {name: _ms(t) for name, t in times.items()}
    return {"slots": batch, "bucket": [b, p], **{f"{k}_ms": v for k, v in ms.items()},
            "step_min_ms": min(times["step"]) * 1e3, "tok_s": batch / ms["step"] * 1e3,
            "host_ms": ms["step"] - ms["model"] - ms["sample"],
            "step_over_roofline": ms["step"] / ms["roofline"],
            "model_over_roofline": ms["model"] / ms["roofline"]}


def measure_prefill(setup: DecodeSetup, lengths: list[int], reps: int) -> list[dict]:
    """A fresh sequence's first chunk of each bucket length (pages from slot 0; KV overwritten)."""
    engine, rng = setup.engine, np.random.default_rng(1)
    pages = [page for slot_pages in setup.pages for page in slot_pages]
    out = []
    for n in lengths:
        if pages_needed(n, engine.page_size) > len(pages):
            continue
        prompt = [int(t) for t in rng.integers(3, engine.vocab_size, n)]

        def run():
            engine.prefill(PrefillChunk(prompt, 0, pages))
            return engine.cache

        times = _interleaved({"prefill": run}, reps, warmup=1)["prefill"]
        out.append({"tokens": n, "ms": _ms(times), "tok_s": n / statistics.median(times)})
    return out


# ---- compile time (in child processes, so the warm run starts with nothing in memory) ----------

def compile_worker(args: argparse.Namespace) -> None:
    enable_compilation_cache(args.compile_worker)
    cfg, params = load_model(resolve_model(args.model))
    config = EngineConfig(max_slots=args.compile_slots, max_seq_len=args.compile_max_seq_len,
                          page_size=args.page_size, dtype=args.dtype, num_pages=256)
    engine = JaxEngine(cfg, params, config, precompile=True)
    buckets = (len(engine.buckets.decode_shapes()) + len(engine.buckets.prefill_shapes())
               + len(engine.buckets.decode_batches))
    print(json.dumps({"seconds": engine.compile_seconds, "programs": buckets}))


def measure_compile(args: argparse.Namespace) -> dict:
    result = {}
    with tempfile.TemporaryDirectory(prefix="slipstream-jax-cache-") as cache_dir:
        for label in ("cold", "warm"):
            cmd = [sys.executable, "-m", "benchmarks.engine_bench", "--compile-worker", cache_dir,
                   "--model", args.model, "--dtype", args.dtype, "--page-size", str(args.page_size),
                   "--compile-slots", str(args.compile_slots),
                   "--compile-max-seq-len", str(args.compile_max_seq_len)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"compile worker failed ({label}):\n{done.stderr[-4000:]}")
            result[label] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# ---- report -------------------------------------------------------------------------------------

def markdown(report: dict) -> str:
    ref = report["reference"]
    lines = [f"{report['model']} {report['dtype']} (weights {report.get('quantize', 'none')}, KV "
             f"{report.get('kv_cache_dtype', 'auto')}), context {report['context']}, page {report['page_size']}, "
             f"{report['steps']} steps (median ms); load avg {report['loadavg_start']} -> {report['loadavg_end']}",
             "", "| slots | bucket (B,P) | step ms | tok/s | model ms | sample ms | host ms | "
                 "matmul roofline ms | step/roofline | model/roofline | KV read MB | KV read ms | "
                 "(roofline + KV read)/roofline |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for d in report["decode"]:
        lines.append(f"| {d['slots']} | {tuple(d['bucket'])} | {d['step_ms']:.1f} | {d['tok_s']:.0f} | "
                     f"{d['model_ms']:.1f} | {d['sample_ms']:.1f} | {d['host_ms']:.1f} | {d['roofline_ms']:.1f} | "
                     f"{d['step_over_roofline']:.2f} | {d['model_over_roofline']:.2f} | {d['kv_read_mb']:.0f} | "
                     f"{d['kv_read_ms']:.1f} | {d['floor_over_roofline']:.2f} |")
    lines += ["", f"weights read per token: {ref['weight_mb']:.0f} MB; copy {ref['copy_gb_s']:.1f} GB/s "
                  f"({ref['copy_mb']} MB array) -> reading the weights once takes {ref['weight_read_copy_ms']:.1f} ms "
                  f"(read-only sum: {ref['read_gb_s']:.1f} GB/s, {ref['weight_read_sum_ms']:.1f} ms); "
                  f"batch-1 step / weight read = {ref['batch1_over_weight_read']:.2f}"]
    if report["prefill"]:
        lines += ["", "| prefill chunk | ms | tok/s |", "|---:|---:|---:|"]
        lines += [f"| {p['tokens']} | {p['ms']:.1f} | {p['tok_s']:.0f} |" for p in report["prefill"]]
    if report.get("profile"):
        lines += ["", f"decode program at {report['profile_slots']} slots, slowest XLA ops (ms per step, "
                      "overlapping on the host threads):", "", "| op | calls | ms |", "|---|---:|---:|"]
        lines += [f"| {p['op']} | {p['calls']} | {p['ms']:.1f} |" for p in report["profile"]]
    if report.get("compile"):
        c = report["compile"]
        lines += ["", f"compile all buckets (max_slots {report['compile_config']['max_slots']}, max_seq_len "
                      f"{report['compile_config']['max_seq_len']}, {c['cold']['programs']} programs): "
                      f"cold {c['cold']['seconds']:.1f} s, warm (persistent cache, new process) "
                      f"{c['warm']['seconds']:.1f} s"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"])
    ap.add_argument("--quantize", default="none", choices=["none", "w8a16", "w8a8"])
    ap.add_argument("--slots", type=ints, default=[1, 8, 32, 64])
    ap.add_argument("--context", type=int, default=384, help="prompt tokens per slot before decoding")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per batch (>= 20)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--prefill-lengths", type=ints, default=[16, 32, 64, 128, 256, 512])
    ap.add_argument("--prefill-reps", type=int, default=5)
    ap.add_argument("--copy-mb", type=int, default=256)
    ap.add_argument("--skip-compile", action="store_true", help="skip the cold/warm compile measurement")
    ap.add_argument("--compile-slots", type=int, default=32)
    ap.add_argument("--compile-max-seq-len", type=int, default=2048)
    ap.add_argument("--profile-slots", type=int, default=0,
                    help="also list the decode program's slowest XLA ops at this many slots")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--compile-worker", metavar="CACHE_DIR", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.steps < 20:
        ap.error("--steps must be >= 20 (medians of fewer steps are noise on a shared host)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.compile_worker:
        compile_worker(args)
        return
    loadavg_start = round(os.getloadavg()[0], 1)
    cfg, params = load_model(resolve_model(args.model))
    setup = build_engine(cfg, params, args)
    engine = setup.engine
    start = time.perf_counter()
    prefill_prompts(setup, seed=0)
    print(f"prefilled {len(setup.pages)} x {args.context} tokens in {time.perf_counter() - start:.1f} s "
          "(incl. compiles)", file=sys.stderr)
    roofline = matmul_roofline(engine.params, cfg)
    decode = []
    for batch in args.slots:
        decode.append(measure_decode(setup, roofline, batch, args))
        print(f"decode {batch}: {decode[-1]['step_ms']:.1f} ms/step", file=sys.stderr)
    profile = None
    if args.profile_slots:
        profile = [{"op": name, "ms": ms, "calls": calls}
                   for name, ms, calls in profile_ops(model_step(setup, args.profile_slots, args), 5, 25)]
    copy_s, read_s = copy_seconds(args.copy_mb << 20, reps=10)
    wbytes = weight_bytes_read_per_token(engine.params)
    batch1 = next((d["step_ms"] for d in decode if d["slots"] == 1), float("nan"))
    reference = {"weight_mb": wbytes / 1e6, "copy_mb": args.copy_mb,
                 "copy_gb_s": (args.copy_mb << 20) / copy_s / 1e9, "read_gb_s": (args.copy_mb << 20) / read_s / 1e9,
                 "weight_read_copy_ms": wbytes / ((args.copy_mb << 20) / copy_s) * 1e3,
                 "weight_read_sum_ms": wbytes / ((args.copy_mb << 20) / read_s) * 1e3}
    reference["batch1_over_weight_read"] = batch1 / reference["weight_read_copy_ms"]
    for d in decode:
        # The KV a step must read at least once (mean context over the timed steps), at the read-only
        # bandwidth: a floor no attention formulation can beat, next to the matmul-only roofline.
        kv_bytes = d["slots"] * (args.context + args.warmup + args.steps / 2) * engine.bytes_per_token
        d["kv_read_mb"] = kv_bytes / 1e6
        d["kv_read_ms"] = kv_bytes / ((args.copy_mb << 20) / read_s) * 1e3
        d["floor_over_roofline"] = (d["roofline_ms"] + d["kv_read_ms"]) / d["roofline_ms"]
    prefill = measure_prefill(setup, args.prefill_lengths, args.prefill_reps)
    del setup, engine
    compile_result = None if args.skip_compile else measure_compile(args)
    report = {"model": args.model, "dtype": args.dtype, "quantize": args.quantize,
              "kv_cache_dtype": args.kv_cache_dtype, "context": args.context, "page_size": args.page_size,
              "steps": args.steps, "decode": decode, "reference": reference, "prefill": prefill,
              "profile": profile, "profile_slots": args.profile_slots,
              "compile": compile_result,
              "compile_config": {"max_slots": args.compile_slots, "max_seq_len": args.compile_max_seq_len},
              "loadavg_start": loadavg_start, "loadavg_end": round(os.getloadavg()[0], 1),
              "env": {"jax": jax.__version__, "backend": jax.default_backend(), "cpus": os.cpu_count(),
                      "machine": platform.processor() or platform.machine(),
                      "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")},
              "command": " ".join([os.path.basename(sys.executable), "-m", "benchmarks.engine_bench",
                                   *(sys.argv[1:] if argv is None else argv)])}
    print(markdown(report))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
