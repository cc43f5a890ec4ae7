"""The phases of benchmarks/device.py that hold the device, in one process: HBM read rate, matmul
rates at the model's [hidden, intermediate] shape, the engine's decode step against (weights + KV)
over that HBM rate, a prefill chunk against that matmul rate, and speculative decoding's verification
steps and greedy identity (benchmarks/device_spec.py). Run by benchmarks/device.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.device import parse_args, record
from benchmarks.engine import build, decodes, fill, kv_read_bytes, positions_per_phase
from benchmarks.measure import (cpu_model, expert_share, interleaved, linear_forms, median_ms,
                                weight_bytes_read_per_token)
from slipstream.engine.api import PREVIOUS_SAMPLE, StepBatch, StepSeq
from slipstream.engine.device.runner import EngineConfig
from slipstream.models.config import ModelConfig


def machine(args: argparse.Namespace, mode: str) -> dict:
    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}
    return {"platform": dev.platform, "device_kind": dev.device_kind, "device_count": jax.device_count(),
            "device_memory": stats.get("bytes_limit"), "cpu": cpu_model(), "cores": os.cpu_count(),
            "jax": jax.__version__, "model": args.model, "load_format": args.load_format, "mode": mode}


def hbm(args: argparse.Namespace) -> dict:
    """Read rate of device memory: a jitted sum over one large f32 array (one read, a scalar out)."""
    dev = jax.devices()[0]
    if args.hbm_bytes:
        nbytes = args.hbm_bytes
    elif dev.platform == "cpu":
        nbytes = 256 << 20
    else:
        nbytes = min(2 << 30, (dev.memory_stats() or {}).get("bytes_limit", 8 << 30) // 4)
    x = jnp.ones((nbytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    seconds = statistics.median(interleaved({"sum": lambda: total(x)}, reps=10, warmup=2)["sum"])
    del x
    return {"bytes": nbytes, "ms": seconds * 1e3, "read_gbs": nbytes / seconds / 1e9}


def _scan_of(op):
    """op(a, w, scale) over a stack of layer weights under one lax.scan: one dispatch for them all.
    Each layer's product is an output of the scan, so none can be dropped."""
    def run(a, ws, scale):
        return jax.lax.scan(lambda carry, w: (carry, op(a, w, scale)), 0, ws)[1]

    return jax.jit(run)


MATMULS = {
    # float weights and activations
    "bf16": lambda a, w, s: jnp.dot(a, w, preferred_element_type=jnp.float32).astype(a.dtype),
    # int8 weights converted in the dot, the per-channel scale after
    "w8a16": lambda a, w, s: jnp.dot(a, w.astype(a.dtype), preferred_element_type=jnp.float32).astype(a.dtype) * s,
    # int8 x int8 -> int32, then the scale
    "w8a8": lambda a, w, s: jax.lax.dot_general(a, w, (((1,), (0,)), ((), ())),
                                                preferred_element_type=jnp.int32).astype(s.dtype) * s,
}


def matmul(args: argparse.Namespace, cfg: ModelConfig, float_dtype) -> dict:
    """Time [m, hidden] x [hidden, intermediate] per layer for each kind (bf16; w8a16; w8a8; and f32
    when the engine runs f32), over --matmul-layers random weights drawn on the device."""
    k, n, layers = cfg.hidden_size, cfg.intermediate_size, args.matmul_layers
    key = jax.random.PRNGKey(0)
    dtypes = {"bf16": jnp.bfloat16, "w8a16": jnp.bfloat16, "w8a8": jnp.bfloat16}
    if jnp.dtype(float_dtype) == jnp.float32:
        dtypes = {"f32": jnp.float32, **dtypes}
    rows = []
    for m in args.matmul_m:
        kinds = {}
        for kind, act in dtypes.items():
            if kind in ("bf16", "f32"):
                w = jax.random.normal(key, (layers, k, n), act)
                a = jax.random.normal(key, (m, k), act)
                op = MATMULS["bf16"]
            else:
                w = jax.random.randint(key, (layers, k, n), -127, 128, jnp.int8)
                a = jax.random.normal(key, (m, k), act)
                if kind == "w8a8":
                    a = (a * 30).astype(jnp.int8)
                op = MATMULS[kind]
            scale = jnp.full((n,), 0.01, act)
            run = _scan_of(op)
            seconds = statistics.median(
                interleaved({kind: lambda: run(a, w, scale)}, reps=max(3, args.steps), warmup=2)[kind]) / layers
            kinds[kind] = {"ms": seconds * 1e3, "tflops": 2 * m * k * n / seconds / 1e12,
                           "weight_gbs": w.nbytes / layers / seconds / 1e9}
            del w, a
        rows.append({"m": m, "kinds": kinds})
        print(f"  matmul m={m}: " + ", ".join(f"{kk} {v['ms']:.3f} ms {v['tflops']:.1f} TFLOP/s"
                                             for kk, v in kinds.items()), flush=True)
    return {"k": k, "n": n, "layers": layers, "rows": rows}


# weight modes whose prefill multiplies int8 activations (int8-channel: per-token scales in prefill chunks)
INT8_ACTIVATIONS = ("q8_0", "int8-channel")


def matmul_kind(weight_mode: str, float_dtype) -> str:
    """Which matmul of the matmul phase the engine's linear layers run in a prefill chunk."""
    if weight_mode == "none":
        return "f32" if jnp.dtype(float_dtype) == jnp.float32 else "bf16"
    return "w8a8" if weight_mode in INT8_ACTIVATIONS else "w8a16"


def linear_flops_per_token(cfg: ModelConfig) -> int:
    """Multiply-adds x 2 of one token through every layer's linear weights (q/k/v/o, gate/up/down; of a sparse
    MoE, its num_experts_per_tok experts')."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    mlp = cfg.num_experts_per_tok * cfg.moe_intermediate_size if cfg.num_experts else cfg.intermediate_size
    per_layer = cfg.hidden_size * (2 * q + 2 * kv) + 3 * cfg.hidden_size * mlp
    return 2 * cfg.num_layers * per_layer


def load(args: argparse.Namespace, config: EngineConfig):
    """(model config, weights) as `slipstream serve` loads them for these flags (server/cli.py)."""
    from slipstream.models.loader import load_model
    from slipstream.models.registry import load_dummy, resolve_model
    from slipstream.quantization.weights import QUANTIZED_MODES

    path = resolve_model(args.model, args.load_format)
    mode = config.weight_mode()
    quantize = mode if mode in QUANTIZED_MODES else "none"
    if args.load_format == "dummy":  # random weights (models/dummy.py), int8 ones drawn directly (any mode)
        return load_dummy(path, dtype=config.activation_dtype(), quantize=mode)
    return load_model(path, quantize=quantize)


def device_memory() -> dict | None:
    """Bytes of device memory: the limit, in use now and the peak so far (None on a CPU)."""
    stats = jax.devices()[0].memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    return {"limit": stats["bytes_limit"], "in_use": stats.get("bytes_in_use"), "peak": stats.get("peak_bytes_in_use")}


def _out_of_memory(e: Exception) -> bool:
    return isinstance(e, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(e)


def engine_phases(args: argparse.Namespace, cfg: ModelConfig, params, hbm_gbs: float | None) -> None:
    """The decode batches of --slots and the prefill chunk. Where the KV cache for the largest batch
    (or its step) does not fit in device memory, the largest batch halves until it does, and the
    report says so ("fit"): an 8B model's weights leave a few GB of a 16 GB chip."""
    slots = sorted(set(args.slots))
    while True:
        try:
            setup = _decode_batches(args, cfg, params, hbm_gbs, slots)
            break
        except jax.errors.JaxRuntimeError as e:
            if not _out_of_memory(e) or slots[-1] <= 1:
                raise
            error = str(e).splitlines()[0][:300]
        gc.collect()  # the failed engine's buffers, held by the traceback until here
        fewer = slots[-1] // 2
        record(args, "fit", {"asked_slots": max(args.slots), "slots": fewer, "memory": device_memory(),
                             "error": error})
        slots = sorted({s for s in slots if s < fewer} | {fewer})
    prefill(args, setup, cfg)


def _decode_batches(args: argparse.Namespace, cfg: ModelConfig, params, hbm_gbs: float | None, slots: list[int]):
    budget = max(args.prefill_tokens, max(slots) + 1)
    longest = args.context + positions_per_phase(args.steps, args.warmup) + 1
    start = time.perf_counter()
    # decode slots hold their context; only the scratch slot holds a whole prefill chunk
    setup = build(cfg, params, slots=max(slots), longest=longest, scratch=budget, page_size=args.page_size,
                  max_seq_len=longest, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                  quantize=args.quantize, max_num_batched_tokens=budget, context=args.context)
    engine = setup.engine
    ready = time.perf_counter() - start
    weights = weight_bytes_read_per_token(engine.params)
    record(args, "engine", {"weight_mb": weights / 1e6, "weight_mode": engine.weight_mode,
                            "kv_dtype": engine.kv_dtype.name, "kv_bytes_per_token": engine.bytes_per_token,
                            "kv_cache_mb": engine.num_pages * engine.page_size * engine.bytes_per_token / 1e6,
                            "page_size": engine.page_size, "context": args.context, "ready_s": ready,
                            "programs": engine.num_programs, "token_budget": budget, "memory": device_memory(),
                            "linear_forms": linear_forms(engine.params)})
    fill(setup, seed=0)
    # the scoring and pooling programs compile on a thread after start-up: steps are timed once they are done
    record(args, "extended_compile", {"waited_s": engine.wait_extended()})
    results = []
    for batch in slots:
        setup.rewind()

        def step():
            engine.step(StepBatch(decodes(setup, batch)))
            setup.step += 1

        ms = median_ms(interleaved({"step": step}, args.steps, args.warmup)["step"])
        row = {"slots": batch, "step_ms": ms, "tok_s": batch / ms * 1e3,
               "kv_read_mb": kv_read_bytes(setup, batch) / 1e6}
        setup.rewind()
        row["pipelined_ms"] = pipelined_ms(setup, batch, args.steps + args.warmup)
        if args.profile:
            row.update(step_profile(step))
        if hbm_gbs:  # a sparse MoE's step reads the experts its tokens choose
            read = weight_bytes_read_per_token(engine.params, expert_share(cfg, batch))
            row["floor_ms"] = (read + kv_read_bytes(setup, batch)) / (hbm_gbs * 1e9) * 1e3
            row["step_over_floor"] = ms / row["floor_ms"]
            row["pipelined_over_floor"] = row["pipelined_ms"] / row["floor_ms"]
        results.append(row)
        record(args, "decode", results, shown=row)
    return setup


def pipelined_ms(setup, batch: int, n: int) -> float:
    """ms per decode step as the server runs them: each step launched before the previous one's samples
    are read, its tokens PREVIOUS_SAMPLE (the device's latest samples), so one step's host work overlaps
    the step in flight; the mean over n steps after a first one."""
    engine = setup.engine

    def launch(first: bool):
        seqs = [dataclasses.replace(seq, token_ids=[PREVIOUS_SAMPLE]) if not first else seq
                for seq in decodes(setup, batch)]
        setup.step += 1
        return engine.launch(StepBatch(seqs))

    flight = launch(True)
    flight.result()
    flight = launch(False)
    start = time.perf_counter()
    for _ in range(n):
        nxt = launch(False)
        flight.result()
        flight = nxt
    flight.result()
    return (time.perf_counter() - start) / (n + 1) * 1e3


def step_profile(step, top: int = 12) -> dict:
    """The device's top ops of one engine step: {"device_ops": by op kind (name up to its first '.', '='
    or ':'), "device_top_ops": the ops themselves (HLO text, cut)}, each [name, us in the step, count]."""
    from benchmarks.device_profile import device_ops

    try:
        _, ops = device_ops(lambda: (step(), jnp.zeros(()))[1], top=10 ** 6)
    except Exception as exc:  # noqa: BLE001 - a profiler failure must not lose the timing
        return {"device_ops": [[f"profile failed: {type(exc).__name__}: {exc}"[:300], 0.0, 0]]}
    kinds: dict[str, list] = {}
    for name, us, n in ops:
        kind = name.split("=")[0].strip().lstrip("%").split(".")[0].split(":")[0]
        k = kinds.setdefault(kind, [kind, 0.0, 0])
        k[1] += us
        k[2] += n
    return {"device_ops": [[k, round(us, 1), n] for k, us, n in sorted(kinds.values(), key=lambda x: -x[1])[:top]],
            "device_top_ops": [[name[:240], round(us, 1), n] for name, us, n in ops[:top]]}


def prefill(args: argparse.Namespace, setup, cfg: ModelConfig) -> None:
    """One chunk of --prefill-tokens (at most the token budget) as a fresh sequence's first step."""
    from benchmarks.device import read_results, results_path

    engine, rng = setup.engine, np.random.default_rng(1)
    n = min(args.prefill_tokens, engine.max_num_batched_tokens)
    slot = engine.max_slots - 1
    prompt = [int(t) for t in rng.integers(3, engine.vocab_size, n)]
    batch = StepBatch([StepSeq(slot, prompt, 0, setup.pages[slot], True)])
    seconds = statistics.median(interleaved({"prefill": lambda: engine.step(batch)}, max(3, args.steps // 2),
                                            warmup=1)["prefill"])
    profile = step_profile(lambda: engine.step(batch)) if args.profile else {}
    flops = n * linear_flops_per_token(cfg) + 2 * cfg.hidden_size * cfg.vocab_size  # + the sampled row's head
    row = {"tokens": n, "ms": seconds * 1e3, "tok_s": n / seconds, "matmul_flops": flops,
           "matmul_tflops": flops / seconds / 1e12,
           "matmul_kind": matmul_kind(engine.weight_mode, engine.dtype)}
    mm = read_results(results_path(args)).get("matmul")
    if mm:
        # the measured rate at the row count nearest the chunk's (log scale)
        nearest = min(mm["rows"], key=lambda r: abs(math.log(r["m"]) - math.log(n)))
        rate = nearest["kinds"][row["matmul_kind"]]["tflops"] if row["matmul_kind"] in nearest["kinds"] else None
        if rate:
            row.update(rate_m=nearest["m"], rate_tflops=rate, floor_ms=flops / (rate * 1e12) * 1e3)
            row["over_floor"] = row["ms"] / row["floor_ms"]
    row.update(profile)
    record(args, "prefill", row)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = EngineConfig(dtype=args.dtype, quantize=args.quantize, kv_cache_dtype=args.kv_cache_dtype)
    mode = f"dtype={config.activation_dtype().name} weights={config.weight_mode()} kv={args.kv_cache_dtype}"
    record(args, "machine", machine(args, mode))
    hbm_gbs = None
    if "hbm" in args.phases:
        result = hbm(args)
        hbm_gbs = result["read_gbs"]
        record(args, "hbm", result)
    if not {"matmul", "engine", "spec"} & set(args.phases):
        return 0
    start = time.perf_counter()
    cfg, params = load(args, config)
    seconds = time.perf_counter() - start
    print(f"loaded {args.model} in {seconds:.1f} s", flush=True)
    record(args, "load", {"seconds": seconds, "memory": device_memory()})
    if "matmul" in args.phases:
        record(args, "matmul", matmul(args, cfg, config.activation_dtype()))
    if "engine" in args.phases:
        engine_phases(args, cfg, params, hbm_gbs)
        gc.collect()  # that engine's KV cache, before the spec phase's
    if "spec" in args.phases:
        from benchmarks.device_spec import spec_phase

        spec_phase(args, cfg, params)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
