"""The hybrid CPU weights' A/B in one process (EngineConfig.prompt_weights): two engines over the same q8_0-a16
model, one with every row on q8_0-a16 (`same`), one with prompt rows on int8-channel-w16 (`w16`), their decode
steps and prefill chunks timed round-robin (the same background load for both).

    python -m benchmarks.engine prompt-weights [--slots 1,32] [--prefill-lengths 256] [--steps 20]
"""
from __future__ import annotations

import argparse
import json
import os

import jax

from benchmarks.engine import build, decodes, fill, positions_per_phase
from benchmarks.measure import cpu_model, interleaved, median_ms
from slipstream.engine.api import StepBatch, StepSeq
from slipstream.models.loader import load_model
from slipstream.models.registry import DEFAULT_MODEL, resolve_model

FORMS = ("same", "w16")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine prompt-weights")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--slots", default="1,32", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--prefill-lengths", default="256", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--context", type=int, default=384)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores, jax {jax.__version__}; load {os.getloadavg()}", flush=True)
    cfg, params = load_model(resolve_model(args.model), quantize="q8_0-a16")
    setups = {}
    for form in FORMS:
        setups[form] = build(cfg, params, slots=max(args.slots), longest=args.context
                             + positions_per_phase(args.steps, args.warmup) + 1,
                             scratch=max(max(args.prefill_lengths), args.max_num_batched_tokens), page_size=None,
                             max_seq_len=2048, dtype="auto", kv_cache_dtype="auto", quantize="q8_0-a16",
                             max_num_batched_tokens=args.max_num_batched_tokens, context=args.context,
                             prompt_weights=form)
        assert setups[form].engine.prompt_w16 == (form == "w16")
        fill(setups[form], seed=0)
    report = {"cpu": cpu_model(), "decode": [], "prefill": []}
    for batch in args.slots:
        for s in setups.values():
            s.rewind()

        def step(s, batch=batch):
            s.engine.step(StepBatch(decodes(s, batch)))
            s.step += 1

        times = interleaved({form: (lambda s=s: step(s)) for form, s in setups.items()}, args.steps, args.warmup)
        row = {"slots": batch, **{f"{form}_ms": median_ms(t) for form, t in times.items()}}
        row["w16_over_same"] = row["w16_ms"] / row["same_ms"]
        report["decode"].append(row)
        print(json.dumps(row), flush=True)
    for n in args.prefill_lengths:
        prompt = list(range(3, 3 + n))
        steps = {}
        for form, s in setups.items():
            slot = s.engine.max_slots - 1
            steps[form] = (lambda s=s, b=StepBatch([StepSeq(slot, prompt, 0, s.pages[slot], True)]): s.engine.step(b))
        times = interleaved(steps, max(3, args.steps // 2), warmup=1)
        row = {"tokens": n, **{f"{form}_ms": median_ms(t) for form, t in times.items()}}
        row["w16_over_same"] = row["w16_ms"] / row["same_ms"]
        report["prefill"].append(row)
        print(json.dumps(row), flush=True)
    report["load_after"] = os.getloadavg()
    print(f"\nCPU: {report['cpu']}; default model, q8_0-a16, bf16 K/V; medians, round-robin; load after "
          f"{report['load_after'][0]:.2f}\n")
    print("| step | every row q8_0-a16 ms | prompt rows on w16 ms | ratio |\n|---|---:|---:|---:|")
    for r in report["decode"]:
        print(f"| decode, {r['slots']} rows | {r['same_ms']:.2f} | {r['w16_ms']:.2f} | {r['w16_over_same']:.2f} |")
    for r in report["prefill"]:
        print(f"| {r['tokens']}-token prefill chunk | {r['same_ms']:.1f} | {r['w16_ms']:.1f} | "
              f"{r['w16_over_same']:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
