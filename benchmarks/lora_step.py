"""Where a LoRA step's extra time goes: the model program of one ragged step at benchmarks/lora.py's
shapes (32 decodes at 256 + context; the same plus a 256-token prefill chunk), on an engine without
LoRA and on one with --max-loras 4 --max-lora-rank 16 (rank-16 adapters on all seven linears), timed
interleaved; the LoRA engine both with every token on an adapter (spread over 4) and with every token
on the base model. With --ops, the XLA ops of both steps on both engines (profiler).

    python -m benchmarks.lora_step [--reps 20] [--ops]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import jax
import numpy as np

from benchmarks.measure import cpu_model, interleaved, median_ms, profile_ops
from slipstream.engine.api import SlotState, StepBatch, StepSeq
from slipstream.engine.device.runner import EngineConfig, JaxEngine
from slipstream.engine.request import SamplingParams
from slipstream.models.loader import load_model
from slipstream.models.lora import load_adapter, lora_targets
from slipstream.models.registry import DEFAULT_MODEL, resolve_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--ops", action="store_true", help="also both steps' XLA ops by time")
    args = p.parse_args(argv)

    from benchmarks.lora import write_adapters

    cfg, model = load_model(resolve_model(args.model))
    root = tempfile.mkdtemp(prefix="lora-step-")
    names = write_adapters(args.model, root, args.max_loras, args.rank)
    targets = lora_targets(model)
    adapters = [load_adapter(n, os.path.join(root, n), targets, cfg.num_layers, args.rank) for n in names]

    s = args.slots
    ps = 16
    per_seq = -(-(args.context + 9) // ps)
    per_scratch = -(-args.chunk // ps)
    num_pages = s * per_seq + per_scratch + 1
    pages = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(s)]
    pages.append(list(range(1 + s * per_seq, 1 + s * per_seq + per_scratch)))
    engines = {}
    for label, loras in (("base", 0), ("lora", args.max_loras)):
        config = EngineConfig(max_slots=s + 1, page_size=ps, num_pages=num_pages, max_loras=loras,
                              max_lora_rank=args.rank, max_num_batched_tokens=args.chunk + s)
        engines[label] = JaxEngine(cfg, model, config, precompile=False)  # each shape compiles at first use
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, cfg.vocab_size, args.context)] for _ in range(s)]
    chunk = [int(t) for t in rng.integers(3, cfg.vocab_size, args.chunk)]

    def lora_of(label, slot, on):
        return 1 + slot % args.max_loras if (label != "base" and on) else 0

    for label, engine in engines.items():
        for slot in range(s + 1):
            ls = lora_of(label, slot, True)
            engine.insert(slot, SlotState([1], [], GREEDY, lora_slot=ls, lora=adapters[ls - 1] if ls else None))
        for slot in range(s):
            engine.model_logits(StepBatch([StepSeq(slot, prompts[slot], 0, pages[slot], False,
                                                   lora_slot=lora_of(label, slot, True))]))
        jax.block_until_ready(engine.cache)

    pos = {}

    def step_fn(label, mixed, on):
        engine = engines[label]
        key = (label, mixed, on)
        pos[key] = 0

        def run():
            at = args.context + pos[key] % 8  # the same context every time, within the pages
            pos[key] += 1
            seqs = [StepSeq(i, [100 + i], at, pages[i], False, lora_slot=lora_of(label, i, on)) for i in range(s)]
            if mixed:
                seqs.append(StepSeq(s, chunk, 0, pages[s], False, lora_slot=lora_of(label, s, on)))
            _, logits, _ = engine._run_model(StepBatch(seqs))
            return logits
        return run

    fns = {}
    for kind, mixed in (("decode", False), ("mixed", True)):
        fns[f"{kind} base"] = step_fn("base", mixed, True)
        fns[f"{kind} lora"] = step_fn("lora", mixed, True)
        fns[f"{kind} lora, base tokens"] = step_fn("lora", mixed, False)
    times = interleaved(fns, args.reps, args.warmup)
    ms = {k: median_ms(v) for k, v in times.items()}
    print(f"CPU: {cpu_model()}")
    for k, v in ms.items():
        print(f"{k:28} {v:8.2f} ms")
    for kind in ("decode", "mixed"):
        print(f"{kind}: over base: lora {ms[f'{kind} lora'] / ms[f'{kind} base']:.3f}, "
              f"lora with base tokens {ms[f'{kind} lora, base tokens'] / ms[f'{kind} base']:.3f}")
    if args.ops:
        for kind, mixed in (("decode", False), ("mixed", True)):
            for label in engines:
                print(f"== XLA ops, {kind} step, {label}")
                for name, op_ms, calls in profile_ops(step_fn(label, mixed, True), 5, 25):
                    print(f"{op_ms:8.3f} ms {calls:5d}x  {name}")
    print(json.dumps(ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
