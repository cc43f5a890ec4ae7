"""The engine tool: its speed one ragged step at a time, through JaxEngine's Engine protocol.

    python -m benchmarks.engine [step] [--slots 1,8,32] [--context 384] [--quantize q8_0]
        [--kv-cache-dtype int8] [--out bench.json]      decode steps against a matmul-only roofline and
                                                        the KV read floor, the attention op alone, prefill
                                                        chunks, and a mixed step (decodes + a chunk in one
                                                        program) against the same work as two steps
    python -m benchmarks.engine step --slots 1 --breakdown [--breakdown-ops]
                                                        one decode step part by part (model, sampling,
                                                        host inputs, matmuls, attention; XLA ops;
                                                        benchmarks/engine_breakdown.py)
    python -m benchmarks.engine step --prefill-breakdown [--prefill-lengths 256]
                                                        one prefill chunk part by part (step, model program,
                                                        host inputs, sampling; q8 calls by projection by the
                                                        kernel's own clock; XLA ops)
    python -m benchmarks.engine structured [--slots 32] decode with no, one and every row constrained
    python -m benchmarks.engine prompt-weights [--slots 1,32]
                                                        the hybrid CPU weights' A/B in one process: decode
                                                        steps and prefill chunks with prompt rows on w16 or not
                                                        (benchmarks/engine_prompt_weights.py)

The references (matmul roofline, weight bytes, read speed) are benchmarks/measure.py's. Every ratio
compares numbers measured in the same run, interleaved, because the host is shared.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.measure import (copy_seconds, cpu_model, interleaved, matmul_roofline, median_ms,
                                weight_bytes_read_per_token)
from slipstream.engine.api import SlotState, StepBatch, StepSeq
from slipstream.engine.kv_cache import pages_needed
from slipstream.engine.request import SamplingParams
from slipstream.engine.device.runner import EngineConfig, JaxEngine
from slipstream.models.config import ModelConfig
from slipstream.kernels.attention import ragged_paged_attention
from slipstream.models.loader import load_model
from slipstream.quantization.weights import QUANTIZED_MODES
from slipstream.models.registry import DEFAULT_MODEL, resolve_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20)


# ---- setup --------------------------------------------------------------------------------------

@dataclasses.dataclass
class Setup:
    engine: JaxEngine
    pages: list[list[int]]     # slot -> its pages (slot max_slots - 1 is the prefill scratch sequence)
    context: int
    step: int = 0              # decode steps taken in this phase: positions advance from context

    def rewind(self) -> None:
        """Start a phase at `context` again (its decodes overwrite the last phase's K/V there): every
        phase measures the same context, and the pages per sequence need not grow with the phases."""
        self.step = 0


def positions_per_phase(steps: int, warmup: int) -> int:
    """Decode positions one phase may advance: the mixed phase's two variants each take one per round."""
    return 2 * (steps + warmup)


def engine_page_size(page_size: int | None) -> int:
    """The page size an engine built with this --page-size uses (None: its default for the backend)."""
    if page_size:
        return page_size
    if EngineConfig().page_size:
        return EngineConfig().page_size
    from slipstream.kernels.attention import kv_layout  # the backend's attention layout chooses

    return kv_layout(jax.default_backend()).page_size


def build(cfg: ModelConfig, params, *, slots: int, longest: int, scratch: int, page_size: int | None,
          max_seq_len: int, dtype: str, kv_cache_dtype: str, quantize: str, max_num_batched_tokens: int,
          context: int, prompt_weights: str = "auto") -> Setup:
    """An engine with `slots` decode slots of `longest` tokens each plus one scratch slot of `scratch`
    tokens for prefill chunks, every slot in its own pages."""
    page = engine_page_size(page_size)
    per_seq, per_scratch = pages_needed(longest, page), pages_needed(max(scratch, longest), page)
    config = EngineConfig(max_slots=slots + 1, max_seq_len=max(max_seq_len, longest, scratch), page_size=page,
                          num_pages=slots * per_seq + per_scratch + 1, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                          quantize=quantize, max_num_batched_tokens=max_num_batched_tokens,
                          prompt_weights=prompt_weights)
    start = time.perf_counter()
    engine = JaxEngine(cfg, params, config)
    print(f"engine ready in {time.perf_counter() - start:.1f} s ({engine.num_programs} programs)", flush=True)
    pages = [list(range(1 + s * per_seq, 1 + (s + 1) * per_seq)) for s in range(slots)]
    pages.append(list(range(1 + slots * per_seq, 1 + slots * per_seq + per_scratch)))
    return Setup(engine, pages, context)


def build_from_args(cfg: ModelConfig, params, args: argparse.Namespace) -> Setup:
    # the scratch slot also takes the mixed step's chunk: up to the whole token budget
    return build(cfg, params, slots=max(args.slots), longest=args.context + positions_per_phase(args.steps, args.warmup)
                 + 1, scratch=max(max(args.prefill_lengths), args.max_num_batched_tokens), page_size=args.page_size,
                 max_seq_len=args.max_seq_len, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                 quantize=args.quantize, max_num_batched_tokens=args.max_num_batched_tokens, context=args.context,
                 prompt_weights=args.prompt_weights)


def fill(setup: Setup, seed: int) -> None:
    """A distinct random prompt of `context` tokens in every decode slot, prefilled in budget-sized
    chunks (no sampling), then bound for greedy decoding (the tokens after it are generated ones; the scratch
    slot's chunks are prompt tokens: the hybrid weights' roles, EngineConfig.prompt_w16)."""
    engine, rng = setup.engine, np.random.default_rng(seed)
    chunk = engine.max_num_batched_tokens
    for slot, pages in enumerate(setup.pages):
        prompt = [int(t) for t in rng.integers(3, engine.vocab_size, setup.context)]
        scratch = slot == len(setup.pages) - 1  # measure_prefill's and measure_mixed's chunks: all prompt
        engine.insert(slot, SlotState([1] * (len(pages) * engine.page_size) if scratch else prompt, [], GREEDY))
        for start in range(0, setup.context, chunk):
            part = prompt[start:start + chunk]
            engine.model_logits(StepBatch([StepSeq(slot, part, start, pages, False)]))
    jax.block_until_ready(engine.cache)


def decodes(setup: Setup, batch: int) -> list[StepSeq]:
    position = setup.context + setup.step
    return [StepSeq(s, [100 + s], position, setup.pages[s], True) for s in range(batch)]


# ---- measurements -------------------------------------------------------------------------------

def attention_only(setup: Setup, batch: int) -> Callable[[], jax.Array]:
    """The step's attention op alone, once per layer, on the engine's cache: what the model calls."""
    engine, cfg = setup.engine, setup.engine.model_cfg
    t = engine.buckets.tokens(batch)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((t, cfg.num_heads, cfg.head_dim), np.float32)).astype(engine.dtype)
    kv = jnp.asarray(rng.standard_normal((t, cfg.num_kv_heads, cfg.head_dim), np.float32)).astype(engine.dtype)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def run(cache, kv_lens, pages, cu, n):
        def layer(carry, i):
            out, cache = ragged_paged_attention(q, kv, kv, carry[1], i, kv_lens, pages, cu, n,
                                                sm_scale=cfg.head_dim ** -0.5)
            return (carry[0] + out[0, 0, 0], cache), None

        (acc, cache), _ = jax.lax.scan(layer, (jnp.zeros((), q.dtype), cache),
                                       jnp.arange(cfg.num_layers, dtype=jnp.int32))
        return acc, cache

    def call():
        _, inputs, _ = engine.step_inputs(StepBatch(decodes(setup, batch)))
        _, _, kv_lens, pages, cu, n, _ = inputs
        acc, engine.cache = run(engine.cache, kv_lens, pages, cu, n)
        return acc

    return call


def kv_read_bytes(setup: Setup, batch: int) -> int:
    engine = setup.engine
    return batch * (setup.context + 1) * engine.bytes_per_token


def measure_decode(setup: Setup, roofline: Callable, batch: int, read_bw: float, args) -> dict:
    engine, cfg = setup.engine, setup.engine.model_cfg
    setup.rewind()

    def step():
        engine.step(StepBatch(decodes(setup, batch)))
        setup.step += 1

    x = jnp.ones((engine.buckets.tokens(batch), cfg.hidden_size), engine.dtype)
    times = interleaved({"step": step, "attention": attention_only(setup, batch), "roofline": lambda: roofline(x)},
                         args.steps, args.warmup)
    ms = {name: median_ms(t) for name, t in times.items()}
    kv_ms = kv_read_bytes(setup, batch) / read_bw * 1e3
    return {"slots": batch, "tokens_bucket": engine.buckets.tokens(batch), **{f"{k}_ms": v for k, v in ms.items()},
            "tok_s": batch / ms["step"] * 1e3, "step_over_roofline": ms["step"] / ms["roofline"],
            "kv_read_mb": kv_read_bytes(setup, batch) / 1e6, "kv_read_ms": kv_ms,
            "attention_over_kv_read": ms["attention"] / kv_ms,
            "floor_over_roofline": (ms["roofline"] + kv_ms) / ms["roofline"]}


def measure_prefill(setup: Setup, lengths: list[int], reps: int) -> list[dict]:
    """A fresh sequence's first chunk, sampled at its end (the scratch slot; its KV is overwritten)."""
    engine, rng = setup.engine, np.random.default_rng(1)
    slot = engine.max_slots - 1
    out = []
    for n in lengths:
        prompt = [int(t) for t in rng.integers(3, engine.vocab_size, n)]
        batch = StepBatch([StepSeq(slot, prompt, 0, setup.pages[slot], True)])
        times = interleaved({"prefill": lambda: engine.step(batch)}, reps, warmup=1)["prefill"]
        out.append({"tokens": n, "ms": median_ms(times), "tok_s": n / statistics.median(times)})
    return out


def measure_mixed(setup: Setup, batch: int, args) -> dict:
    """`batch` decodes plus a prefill chunk filling the rest of the budget in one step, against the
    same decodes and the same chunk as two separate steps."""
    engine, rng = setup.engine, np.random.default_rng(2)
    setup.rewind()
    slot = engine.max_slots - 1
    n = engine.max_num_batched_tokens - batch
    prompt = [int(t) for t in rng.integers(3, engine.vocab_size, n)]
    chunk = StepSeq(slot, prompt, 0, setup.pages[slot], True)

    def mixed():
        engine.step(StepBatch([*decodes(setup, batch), chunk]))
        setup.step += 1

    def separate():
        engine.step(StepBatch(decodes(setup, batch)))
        engine.step(StepBatch([chunk]))
        setup.step += 1

    times = interleaved({"mixed": mixed, "separate": separate}, args.steps, args.warmup)
    ms = {name: median_ms(t) for name, t in times.items()}
    return {"decodes": batch, "chunk": n, "mixed_ms": ms["mixed"], "separate_ms": ms["separate"],
            "mixed_over_separate": ms["mixed"] / ms["separate"]}


def markdown(report: dict) -> str:
    lines = [f"CPU: {report['cpu']}; {report['mode']}; context {report['context']}; "
             f"weights read per token {report['weight_mb']:.0f} MB; read bandwidth {report['read_gbs']:.1f} GB/s",
             "", "| slots | step ms | tok/s | matmul roofline ms | step/roofline | attention ms (30 layers) "
             "| KV read MB | KV read ms | attention/KV read | (roofline+KV)/roofline |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for d in report["decode"]:
        lines.append(f"| {d['slots']} | {d['step_ms']:.1f} | {d['tok_s']:.0f} | {d['roofline_ms']:.1f} | "
                     f"{d['step_over_roofline']:.2f} | {d['attention_ms']:.1f} | {d['kv_read_mb']:.0f} | "
                     f"{d['kv_read_ms']:.1f} | {d['attention_over_kv_read']:.2f} | {d['floor_over_roofline']:.2f} |")
    lines += ["", "| prefill chunk | ms | tok/s |", "|---:|---:|---:|"]
    lines += [f"| {p['tokens']} | {p['ms']:.1f} | {p['tok_s']:.0f} |" for p in report["prefill"]]
    if report.get("mixed"):
        m = report["mixed"]
        lines += ["", f"Mixed step ({m['decodes']} decodes + a {m['chunk']}-token chunk): {m['mixed_ms']:.1f} ms "
                      f"in one step vs {m['separate_ms']:.1f} ms as two ({m['mixed_over_separate']:.2f}x)"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--slots", default="1,8,32", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--context", type=int, default=384)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--prefill-lengths", default="64,256", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantize", default="none")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--prompt-weights", default="auto", choices=["auto", "w16", "same"],
                   help="EngineConfig.prompt_weights: w16 runs prompt rows (the prefill chunks) on int8-channel-w16 "
                        "with q8_0-a16 weights")
    p.add_argument("--out", default=None)
    p.add_argument("--read-bytes", type=int, default=1 << 30,
                   help="bytes of the memory read that gives the floors' bandwidth (default 1 GiB: past the LLC)")
    p.add_argument("--breakdown", action="store_true",
                   help="only the decode step of the first --slots count, part by part (model, sampling, host, "
                        "matmuls, attention)")
    p.add_argument("--breakdown-ops", action="store_true",
                   help="with --breakdown: the model and sampling programs' XLA ops")
    p.add_argument("--prefill-breakdown", action="store_true",
                   help="only a prefill chunk of the first --prefill-lengths, part by part (step, model, host, "
                        "sampling; q8 calls by projection; XLA ops)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["structured"]:
        from benchmarks.engine_structured import main as structured

        return structured(argv[1:])
    if argv[:1] == ["prompt-weights"]:
        from benchmarks.engine_prompt_weights import main as prompt_weights

        return prompt_weights(argv[1:])
    args = parse_args(argv[1:] if argv[:1] == ["step"] else argv)
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores, jax {jax.__version__}; load {os.getloadavg()}", flush=True)
    # int8 modes load as the server does (GGUF blocks converted exactly, Q4_1's minimum as a group
    # offset), not rounded from floats: the weights and bytes the served decode step streams
    int8 = args.quantize if args.quantize in QUANTIZED_MODES else "none"
    cfg, params = load_model(resolve_model(args.model), quantize=int8)
    setup = build_from_args(cfg, params, args)
    engine = setup.engine
    fill(setup, seed=0)
    # 1 GiB by default, well past the last-level cache (a 256 MiB read stayed in an Emerald Rapids' 300 MiB L3:
    # 25-31 GB/s against 15-17 from DRAM, which made the attention look 2x its K/V read time)
    _, read_s = copy_seconds(args.read_bytes, reps=5)
    read_bw = args.read_bytes / read_s
    roofline = matmul_roofline(engine.params, cfg)
    report = {"cpu": cpu_model(), "mode": f"quantize={args.quantize} kv={args.kv_cache_dtype} "
                                          f"prompt rows on w16: {engine.prompt_w16}",
              "context": args.context, "weight_mb": weight_bytes_read_per_token(engine.params) / 1e6,
              "read_gbs": read_bw / 1e9, "decode": [], "prefill": [], "kernels": _kernel_paths()}
    if args.prefill_breakdown or args.breakdown:
        from benchmarks.engine_breakdown import (breakdown_markdown, measure_breakdown, measure_prefill_breakdown,
                                                 prefill_breakdown_markdown)

        if args.prefill_breakdown:
            report["prefill_breakdown"] = measure_prefill_breakdown(setup, args.prefill_lengths[0], args)
            print(prefill_breakdown_markdown(report["prefill_breakdown"]))
        else:
            report["breakdown"] = {**measure_breakdown(setup, roofline, args), "context": args.context}
            print(breakdown_markdown(report["breakdown"]))
    else:
        for batch in args.slots:
            report["decode"].append(measure_decode(setup, roofline, batch, read_bw, args))
            print(json.dumps(report["decode"][-1]), flush=True)
        report["prefill"] = measure_prefill(setup, args.prefill_lengths, max(3, args.steps // 2))
        mixed_batch = min(32, max(args.slots))
        if mixed_batch < engine.max_num_batched_tokens:
            report["mixed"] = measure_mixed(setup, mixed_batch, args)
        report["load_after"] = os.getloadavg()
        print(markdown(report))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


def _kernel_paths() -> dict:
    from slipstream.kernels.native import kernel_paths

    return kernel_paths()


if __name__ == "__main__":
    main()
