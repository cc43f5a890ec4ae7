"""The engine tool's step breakdowns (`python -m benchmarks.engine step --breakdown` / `--prefill-breakdown`):
one decode step or one prefill chunk part by part, timed round-robin in one process."""
from __future__ import annotations

import dataclasses
import importlib
import statistics
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.engine import Setup, attention_only, decodes
from benchmarks.measure import interleaved, median_ms, profile_ops, weight_bytes_read_per_token
from slipstream.engine.api import StepBatch, StepSeq
from slipstream.engine.device.sampling import DraftRows, SamplingArrays
from slipstream.engine.device.step_inputs import sample_packing
from slipstream.kernels import native


def sampling_program(engine, logits: jax.Array, slot_ids: np.ndarray, active: np.ndarray,
                     rows: list[int]) -> Callable[[], object]:
    """The engine's compiled sampling program for these logits and slots, as a call (it keeps the engine's
    penalty state and latest samples as a step does)."""
    b = len(slot_ids)
    packed, x = sample_packing(b).host()  # its one host array (engine/device/packed.py)
    x["slot_ids"][:], x["active"][:] = slot_ids, active
    for f in dataclasses.fields(SamplingArrays):
        x[f.name][:] = getattr(engine._slot_sampling, f.name)[slot_ids]
    x["step"][:] = 0
    for f in dataclasses.fields(DraftRows):
        x[f.name][:] = getattr(DraftRows.none(b), f.name)
    bitmask = engine._fill_mask(rows, b, x["step"])
    sampler = engine._sample_exe.get(b) or engine._sample_jit.lower(*engine._sample_args(b)).compile()

    def sample():
        result, engine.sampling_state, engine._previous.last = sampler(
            logits, engine.sampling_state, engine._previous.last, packed, bitmask)
        return result

    return sample


def measure_breakdown(setup: Setup, roofline: Callable, args) -> dict:
    """A decode step of the first --slots count (one slot by default), part by part, timed
    round-robin (ms, medians): the whole step; its model program (with the host's input arrays);
    the host's input arrays alone; the sampling program alone; the matmuls alone (roofline); the
    attention op alone (all layers); and `stream`, one read of the step's weight bytes (an XLA
    max-reduction), the floor of the matmuls. With
    --breakdown-ops, the model and sampling programs' XLA ops by time (profiler)."""
    engine, cfg = setup.engine, setup.engine.model_cfg
    slots = args.slots[0]
    setup.rewind()

    def batch():
        return StepBatch(decodes(setup, slots))

    def step():
        engine.step(batch())
        setup.step += 1

    def model():
        return engine._run_model(batch())[1]

    t = engine.buckets.tokens(slots)
    b = engine.buckets.sample_rows(t)
    sample = sampling_program(engine, model(), np.arange(b, dtype=np.int32) % engine.max_slots, np.ones(b, bool),
                              list(range(slots)))

    x = jnp.ones((t, cfg.hidden_size), engine.dtype)
    fns = {"step": step, "model": model, "host_inputs": lambda: engine.step_inputs(batch()) and None,
           "sample": sample, "roofline": lambda: roofline(x), "attention": attention_only(setup, slots)}
    weight_bytes = weight_bytes_read_per_token(engine.params)
    if engine.weight_mode != "none":
        data = jax.device_put(np.ones(weight_bytes, np.uint8))
        probe = jax.jit(jnp.max)
        fns["stream"] = lambda: probe(data)
    times = interleaved(fns, args.steps, args.warmup)
    out = {"slots": slots, "weight_mb": weight_bytes / 1e6, **{f"{k}_ms": median_ms(v) for k, v in times.items()}}
    if args.breakdown_ops:
        out["model_ops"] = [{"op": name, "ms": ms, "calls": calls}
                            for name, ms, calls in profile_ops(model, max(5, args.steps // 2), 40)]
        out["sample_ops"] = [{"op": name, "ms": ms, "calls": calls}
                             for name, ms, calls in profile_ops(sample, max(5, args.steps // 2), 15)]
    return out


def breakdown_markdown(d: dict) -> str:
    lines = [f"A decode step of {d['slots']} slot(s), context {d.get('context', '?')}, weights read per token "
             f"{d['weight_mb']:.1f} MB (ms, medians, timed round-robin):", "", "| part | ms |", "|---|---:|"]
    lines += [f"| {k[:-3]} | {v:.3f} |" for k, v in d.items() if k.endswith("_ms")]
    for program in ("model", "sample"):
        for op in d.get(f"{program}_ops", []):
            lines.append(f"| {program} op {op['op'][:60]} (x{op['calls']}) | {op['ms']:.3f} |")
    return "\n".join(lines)


PROJECTIONS = ("qkv", "o", "gate_up", "down")  # a layer's q8 calls in program order (engine/layer_stack.py)


def measure_prefill_breakdown(setup: Setup, n: int, args) -> dict:
    """A fresh sequence's first chunk of `n` tokens, sampled at its end, part by part, timed round-robin
    (ms, medians): the whole step (engine.step: host inputs, model program, sampling); the model program
    alone; the host's input arrays alone; the sampling program alone. Then, over --steps model programs
    with the q8 kernel's own clock: the time inside its calls by projection (a layer's four calls in program
    order, then the LM head) with their rows; and the model program's XLA ops by time (profiler)."""
    engine, rng = setup.engine, np.random.default_rng(1)
    slot = engine.max_slots - 1
    prompt = [int(t) for t in rng.integers(3, engine.vocab_size, n)]

    def batch():
        return StepBatch([StepSeq(slot, prompt, 0, setup.pages[slot], True)])

    def model():
        return engine._run_model(batch())[1]

    t = engine.buckets.tokens(n)
    b = engine.buckets.sample_rows(t)
    logits = model()
    sample = sampling_program(engine, logits, np.full(b, slot, np.int32), np.arange(b) < 1, [slot])

    fns = {"step": lambda: engine.step(batch()), "model": model,
           "host_inputs": lambda: engine.step_inputs(batch()) and None, "sample": sample}
    times = interleaved(fns, args.steps, args.warmup)
    out = {"tokens": n, "token_bucket": t, "logit_rows": int(logits.shape[0]),
           **{f"{k}_ms": median_ms(v) for k, v in times.items()}}
    if native.kernel_paths().get("q8_matmul") == "native":
        ext = importlib.import_module("slipstream.kernels._q8_matmul")
        per: dict[str, list[float]] = {}
        rows: dict[str, int] = {}
        for _ in range(args.steps):
            ext.profile(True)
            jax.block_until_ready(model())
            calls = ext.profile(False)
            sums: dict[str, float] = {}
            for i, (begin, end, m, _) in enumerate(calls):
                name = PROJECTIONS[i % 4] if i < len(calls) - 1 or len(calls) % 4 == 0 else "lm_head"
                sums[name] = sums.get(name, 0.0) + (end - begin) / 1e6
                rows[name] = int(m)
            for name, ms in sums.items():
                per.setdefault(name, []).append(ms)
            per.setdefault("all q8", []).append(sum(sums.values()))
        out["q8"] = {name: {"ms": statistics.median(v), "rows": rows.get(name)} for name, v in per.items()}
        out["q8_isa"] = ext.isa()
    out["model_ops"] = [{"op": name, "ms": ms, "calls": calls}
                        for name, ms, calls in profile_ops(model, max(5, args.steps // 2), 40)]
    return out


def prefill_breakdown_markdown(d: dict) -> str:
    lines = [f"A {d['tokens']}-token prefill chunk (token bucket {d['token_bucket']}, {d['logit_rows']} logit rows; ms, "
             "medians, timed round-robin):", "", "| part | ms |", "|---|---:|"]
    lines += [f"| {k[:-3]} | {v:.3f} |" for k, v in d.items() if k.endswith("_ms")]
    for name, q in d.get("q8", {}).items():
        lines.append(f"| q8 {name} ({q['rows']} rows, {d['q8_isa']}) | {q['ms']:.3f} |")
    for op in d.get("model_ops", []):
        lines.append(f"| model op {op['op'][:60]} (x{op['calls']}) | {op['ms']:.3f} |")
    return "\n".join(lines)
