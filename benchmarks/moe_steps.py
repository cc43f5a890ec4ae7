"""A sparse MoE's engine steps against a dense model of the same active size, in one process, the two interleaved:
decode at 1 and 8 sequences and a 256-token prefill (8 x 32), medians. Both are Qwen3-shaped with random weights in
the CPU's default quantization; the MoE has E experts of width W, top-k, and the dense MLP width k * W.

    python -m benchmarks.moe_steps [--experts 32 --top-k 4 --width 512 --layers 8 --hidden 1024]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import numpy as np

from benchmarks.measure import cpu_model
from slipstream.engine.api import SlotState, StepBatch, StepSeq
from slipstream.engine.device.runner import EngineConfig, JaxEngine
from slipstream.engine.request import SamplingParams
from slipstream.models.config import ModelConfig
from slipstream.models.dummy import dummy_model

SLOTS, CHUNK = 8, 32


def _engine(args, **moe) -> JaxEngine:
    width = args.top_k * args.width
    cfg = ModelConfig(architecture="qwen3_moe" if moe else "qwen3", num_layers=args.layers, hidden_size=args.hidden,
                      num_heads=args.hidden // 128, num_kv_heads=args.hidden // 128, head_dim=128, vocab_size=32000,
                      intermediate_size=width, qk_norm=True, **moe)
    return JaxEngine(cfg, dummy_model(cfg, quantize=args.quantize),
                     EngineConfig(max_slots=SLOTS, max_seq_len=512, num_pages=300, max_num_batched_tokens=256),
                     precompile=False)


class Steps:
    def __init__(self, engine: JaxEngine) -> None:
        self.engine, self.rng = engine, np.random.default_rng(0)
        self.pages = [[1 + CHUNK * s + i for i in range(CHUNK)] for s in range(SLOTS)]

    def _open(self, slots: int) -> list[StepSeq]:
        for s in range(slots):
            self.engine.insert(s, SlotState([5] * CHUNK, [], SamplingParams(temperature=0.0, max_tokens=1 << 20)))
        return [StepSeq(s, [int(t) for t in self.rng.integers(3, 1000, CHUNK)], 0, self.pages[s], True)
                for s in range(slots)]

    def _close(self, slots: int) -> None:
        for s in range(slots):
            self.engine.free(s)

    def prefill(self) -> float:
        chunks = self._open(SLOTS)
        t = time.perf_counter()
        self.engine.step(StepBatch(chunks))
        dt = time.perf_counter() - t
        self._close(SLOTS)
        return dt

    def decode(self, slots: int, steps: int) -> list[float]:
        self.engine.step(StepBatch(self._open(slots)))
        times = []
        for i in range(steps):
            t = time.perf_counter()
            self.engine.step(StepBatch([StepSeq(s, [7], CHUNK + i, self.pages[s], True) for s in range(slots)]))
            times.append(time.perf_counter() - t)
        self._close(slots)
        return times[2:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--width", type=int, default=512, help="each expert's MLP width")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--quantize", default="q8_0-a16")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores, jax {jax.__version__}; load {os.getloadavg()}", flush=True)
    models = {"moe": Steps(_engine(args, num_experts=args.experts, num_experts_per_tok=args.top_k,
                                   moe_intermediate_size=args.width, norm_topk_prob=True)),
              "dense": Steps(_engine(args))}
    for m in models.values():  # compile every program first
        m.prefill(), m.decode(1, 3), m.decode(SLOTS, 3)
    times = {name: {"decode_1": [], f"decode_{SLOTS}": [], "prefill_256": []} for name in models}
    for _ in range(args.rounds):
        for name, m in models.items():
            times[name]["decode_1"] += m.decode(1, 12)
            times[name][f"decode_{SLOTS}"] += m.decode(SLOTS, 8)
            times[name]["prefill_256"] += [m.prefill() for _ in range(2)]
    out = {}
    for key in times["moe"]:
        moe, dense = (statistics.median(times[n][key]) * 1e3 for n in ("moe", "dense"))
        out[key] = {"moe_ms": moe, "dense_ms": dense, "ratio": moe / dense}
        print(f"{key:12s} MoE {moe:8.1f} ms  dense {dense:8.1f} ms  MoE/dense {moe / dense:.2f}")
    print(json.dumps({"args": vars(args), "results": out}))


if __name__ == "__main__":
    main()
