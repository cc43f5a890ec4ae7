"""Profile of n-gram speculation's steps at concurrency 1, against the same engine without it.

Per engine step of a closed loop (one engine, speculation and none taking turns request by request, as
benchmarks.spec_acceptance --time runs them): the host's time around the step (launch, then collecting,
accepting, drafting, planning) and the wait for the device, by kind of step (verification by token bucket,
plain decode), with the drafts and what verification accepted; then the model and sampling programs
alone, timed synchronously per token bucket on each q8 instruction set, with the time inside the q8
matmul calls:

    python -m benchmarks.spec_profile [--dataset repeat] [--prompts 8] [--output-len 64] [--rounds 2] [--reps 20]

With --isa-ab, instead: plain decode (no speculation) with the q8 kernel's instruction set alternated request by
request in the one process (the default, AMX where there is one, against AVX-512 VNNI; the order flipped each turn),
after one speculative request so that the tile unit has run: TPOT p50 per ISA over all rounds, and the ratio.
"""
from __future__ import annotations

import argparse
import collections
import importlib
import statistics
import sys
import time
import types

import jax

from benchmarks.spec_acceptance import engine_for, run_closed_loop
from slipstream.engine.api import SlotState, StepBatch, StepSeq
from slipstream.engine.device.runner import EngineConfig
from slipstream.engine.request import Request, SamplingParams
from slipstream.engine.schedule import StepPlanner
from slipstream.engine.speculative import SpeculativeConfig, Speculator
from slipstream.models.registry import DEFAULT_MODEL, load_tokenizer, resolve_model
from slipstream.server.bench.datasets import random_dataset, repeat_dataset


class Probe:
    """Timers around the engine thread's calls (the engine's launch; the planner's and the Speculator's
    methods, patched on their classes: one Probe per process); one record per launched step."""

    def __init__(self, engine) -> None:
        self.steps: list[dict] = []
        self.host = collections.Counter()  # seconds per host part
        self.accepts: list[tuple[int, int]] = []  # (drafts, accepted) per verified chunk
        self._engine = engine
        self._patch()

    def _timed(self, owner, name: str, label: str) -> None:
        fn = getattr(owner, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.host[label] += time.perf_counter() - start
        setattr(owner, name, wrapper)

    def _patch(self) -> None:
        probe, engine = self, self._engine
        launch = engine.launch

        def timed_launch(batch: StepBatch):
            start = time.perf_counter()
            launched = launch(batch)
            end = time.perf_counter()
            rows = sum(s.num_samples for s in batch.seqs if s.sample)
            record = dict(start=start, dispatch=end - start, tokens=batch.num_tokens,
                          bucket=engine.buckets.tokens(batch.num_tokens), rows=rows,
                          drafts=rows - sum(1 for s in batch.seqs if s.sample),
                          prefill=any(len(s.token_ids) > s.num_samples for s in batch.seqs))
            probe.steps.append(record)
            result = launched.result

            def timed_result():
                t0 = time.perf_counter()
                out = result()
                record.setdefault("wait", time.perf_counter() - t0)
                return out
            launched.result = timed_result
            return launched
        engine.launch = timed_launch
        for name, label in (("propose", "propose (drafting)"), ("plan", "plan"), ("advance", "advance"),
                            ("complete", "complete (accept, append)")):
            self._timed(StepPlanner, name, label)
        accept = Speculator.accept

        def timed_accept(spec, chunk, samples):
            kept = accept(spec, chunk, samples)
            probe.accepts.append((len(chunk.draft), len(kept) - 1))
            return kept
        Speculator.accept = timed_accept


def kind(step: dict) -> str:
    """A step's row in the tables."""
    if step["prefill"]:
        return "prefill"
    if step["drafts"]:
        return f"verify, {step['bucket']}-token bucket"
    return "decode, 1 token"


def program_times(engine, context: int, reps: int) -> None:
    """The model program alone and model + sampling (engine.step), one sequence at `context`, per token
    bucket up to 16, on the default ISA (AMX where there is one) and on AVX-512 VNNI: medians of `reps`,
    taken round-robin; and the time inside the q8 matmul calls (the kernel's own clock)."""
    ext = importlib.import_module("slipstream.kernels._q8_matmul")
    isas = [ext.isa()] + (["avx512_vnni"] if ext.isa() == "amx" else [])
    buckets = [t for t in engine.buckets.token_counts if t <= 16]
    pages = tuple(range(context // engine.page_size + 2))
    engine.insert(0, SlotState(prompt_ids=tuple(range(100, 100 + context)), output_ids=(),
                               params=SamplingParams(temperature=0.0)))
    times = collections.defaultdict(list)
    try:
        for _ in range(reps):
            for isa in isas:
                ext.set_isa(isa)
                for t in buckets:
                    batch = StepBatch((StepSeq(0, tuple(range(200, 200 + t)), context, pages, True, num_samples=t),))
                    ext.profile(True)
                    start = time.perf_counter()
                    _, logits, _ = engine._run_model(batch)
                    jax.block_until_ready(logits)
                    times[(isa, "model", t)].append(time.perf_counter() - start)
                    times[(isa, "q8", t)].append(sum(e - b for b, e, _, _ in ext.profile(False)) / 1e9)
                    start = time.perf_counter()
                    engine.step(batch)
                    times[(isa, "step", t)].append(time.perf_counter() - start)
    finally:
        ext.set_isa(isas[0])
    base = statistics.median(times[(isas[0], "model", 1)])
    print(f"\nprograms alone, one sequence at context {context}, medians of {reps} (ms; x the 1-token model "
          f"program on {isas[0]}); q8: inside the q8 matmul calls")
    for isa in isas:
        for t in buckets:
            m, q, s = (statistics.median(times[(isa, k, t)]) for k in ("model", "q8", "step"))
            print(f"  {isa:12s} {t:3d} tokens: model {m * 1e3:6.2f} ({m / base:4.2f}x), q8 {q * 1e3:6.2f}, rest "
                  f"{(m - q) * 1e3:5.2f}; model + sampling (engine.step) {s * 1e3:6.2f} ({s / base:4.2f}x)")


def isa_ab(engine, tokenizer, requests: list[Request], spec: SpeculativeConfig, rounds: int) -> None:
    """Plain decode TPOT with the q8 kernel on its default ISA and on AVX-512 VNNI, alternated request by request."""
    ext = importlib.import_module("slipstream.kernels._q8_matmul")
    isas = [ext.isa(), "avx512_vnni"]
    run_closed_loop(engine, tokenizer, requests[:1], spec, None, 1)  # the tile unit runs (where it is chosen)
    tpots = collections.defaultdict(list)
    try:
        for rnd in range(rounds + 1):
            for i, r in enumerate(requests):
                for isa in (isas if (i + rnd) % 2 == 0 else isas[::-1]):
                    ext.set_isa(isa)
                    got, _, _ = run_closed_loop(engine, tokenizer, [r], None, None, 1)
                    if rnd:
                        tpots[isa] += got
    finally:
        ext.set_isa(isas[0])
    med = {isa: statistics.median(tpots[isa]) * 1e3 for isa in isas}
    print(f"plain decode, q8 ISA alternated request by request, {rounds} rounds x {len(requests)} requests: TPOT p50 "
          + ", ".join(f"{isa} {med[isa]:.2f} ms" for isa in isas) + f"; ratio {med[isas[0]] / med[isas[1]]:.3f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dataset", default="repeat", choices=("repeat", "random"))
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="rounds after a warm-up round")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--reps", type=int, default=20, help="program timings: repetitions per bucket")
    p.add_argument("--isa-ab", action="store_true", help="only plain decode on the default ISA against AVX-512 VNNI")
    args = p.parse_args(argv)
    engine = engine_for(args.model, EngineConfig())
    tokenizer = load_tokenizer(resolve_model(args.model))
    samples = (repeat_dataset(tokenizer, num_prompts=args.prompts, passage_len=200, seed=0) if args.dataset == "repeat"
               else random_dataset(tokenizer, num_prompts=args.prompts, input_len=256, output_len=args.output_len,
                                   seed=0))
    requests = [Request(tokenizer.encode(s.prompt, add_special_tokens=False),
                        SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)) for s in samples]
    spec = SpeculativeConfig(num_speculative_tokens=args.k)
    if args.isa_ab:
        isa_ab(engine, tokenizer, requests, spec, args.rounds)
        return 0
    probe = Probe(engine)  # one set of wrappers; its records are split by side below
    got = {"on": ([], 0, 0), "off": ([], 0, 0)}
    records = {"on": [], "off": []}
    for rnd in range(args.rounds + 1):
        for i, r in enumerate(requests):
            for side in (("off", "on") if i % 2 else ("on", "off")):
                before, host_before, acc_before = len(probe.steps), probe.host.copy(), len(probe.accepts)
                tpots, tokens, _ = run_closed_loop(engine, tokenizer, [r], spec if side == "on" else None, None, 1)
                if rnd == 0:
                    continue
                records[side].append((probe.steps[before:], probe.host - host_before, probe.accepts[acc_before:]))
                t, n, _ = got[side]
                got[side] = (t + tpots, n + tokens, 0)
    print(f"{args.dataset}, {args.prompts} prompts x {args.output_len} greedy tokens, {args.rounds} rounds, k {args.k}")
    for side in ("off", "on"):
        view = types.SimpleNamespace(steps=[s for steps, _, _ in records[side] for s in steps],
                                     host=sum((h for _, h, _ in records[side]), collections.Counter()),
                                     accepts=[a for _, _, accepts in records[side] for a in accepts])
        # cycles only within a request: its last step has none
        for steps, _, _ in records[side]:
            for a, b in zip(steps, steps[1:]):
                a["cycle"] = b["start"] - a["start"]
        tpot = statistics.median(got[side][0]) * 1e3
        report_side(view, f"speculation {side}", got[side][1], tpot)
    program_times(engine, 300, args.reps)
    return 0


def report_side(view, label: str, tokens: int, tpot_ms: float) -> None:
    # a request's first step (its prompt) is outside TPOT, and a step planned ahead of it has no cycle
    steps = [s for s in view.steps if "cycle" in s and not s["prefill"]]
    by = collections.defaultdict(list)
    for s in steps:
        by[kind(s)].append(s)
    total = sum(s["cycle"] for s in steps)
    print(f"\n{label}: TPOT p50 {tpot_ms:.2f} ms; {len(steps)} steps after the prompts', {tokens} output tokens, "
          f"engine-thread time in them {total * 1e3:.0f} ms ({total / max(1, tokens) * 1e3:.2f} ms a token)")
    print(f"  {'step kind':28s} {'steps':>6s} {'cycle ms':>9s} {'launch':>7s} {'wait':>7s} {'host':>7s} {'drafts':>7s} {'share':>6s}")
    for k, group in sorted(by.items()):
        med = lambda f: statistics.median(f(s) for s in group) * 1e3  # noqa: E731
        drafts = statistics.mean(s["drafts"] for s in group)
        share = sum(s["cycle"] for s in group) / total
        print(f"  {k:28s} {len(group):6d} {med(lambda s: s['cycle']):9.2f} {med(lambda s: s['dispatch']):7.2f} "
              f"{med(lambda s: s.get('wait', 0.0)):7.2f} {med(lambda s: s['cycle'] - s.get('wait', 0.0) - s['dispatch']):7.2f} "
              f"{drafts:7.2f} {share:6.2f}")
    print("  host parts (ms per step): " + ", ".join(f"{k} {v / max(1, len(view.steps)) * 1e3:.3f}"
                                                    for k, v in sorted(view.host.items())))
    if view.accepts:
        drafted = sum(d for d, _ in view.accepts)
        accepted = sum(a for _, a in view.accepts)
        n = len(view.accepts)
        print(f"  verified chunks {n}: drafts {drafted / n:.2f} each, accepted {accepted / n:.2f} each "
              f"({accepted / max(1, drafted):.2f}), tokens per verification {1 + accepted / n:.2f}")
        print("  accepted-length histogram: " + " ".join(f"{a}:{c}" for a, c in
                                                         sorted(collections.Counter(a for _, a in view.accepts).items())))
    print("  cycle: launch to the next launch on the engine thread; launch: engine.launch; wait: in result() for "
          "the samples; host: the rest (collect, accept, draft, plan)")


if __name__ == "__main__":
    sys.exit(main())
