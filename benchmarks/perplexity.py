"""Accuracy of int8 weights and int8 KV on the default model: perplexity, greedy agreement, memory.

Everything runs through the paged engine path: params as JaxEngine prepares them (quantized at
load), the engine's KV layout (int8 pages with per-token-head scales), `forward_paged` and
`JaxEngine.generate`. int8 weights are smoothed (SmoothQuant) with statistics from the shipped
calibration text, never from the eval text. Run from the repo root (a few minutes on 2 CPU cores):
    .venv/bin/python -m benchmarks.perplexity [--window 512 --stride 256] [--out ppl.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from engine.api import DecodeRow, PrefillChunk, SlotState
from engine.kv_cache import pages_needed
from engine.request import SamplingParams
from engine.runner import EngineConfig, JaxEngine
from models.calibration import calibration_text
from models.config import ModelConfig
from models.llama import forward_paged, init_kv_cache
from quantization import weight_bytes

EVAL_TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "eval.txt")
PAGE_SIZE = 16
GREEDY_TOKENS = 24   # generated per prompt; agreement is judged on the first AGREE_TOKENS
AGREE_TOKENS = 16
PAGES_PER_PROMPT = 8  # 128 tokens: every prompt below plus GREEDY_TOKENS fits
# Same tokens, same cache: the two paths differ only in summation order (~1e-4 seen).
CHECK_TOL = 0.05


@dataclasses.dataclass(frozen=True)
class Mode:
    name: str
    quantize: str        # EngineConfig.quantize
    kv_cache_dtype: str  # EngineConfig.kv_cache_dtype


MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("f32", "none", "auto"),
    Mode("w8a16", "w8a16", "auto"),
    Mode("w8a8", "w8a8", "auto"),
    Mode("int8-kv", "none", "int8"),
    Mode("w8a8+int8-kv", "w8a8", "int8"),
)}

# Plain continuations and chat turns (ChatML, as SmolLM2-Instruct was trained on).
_PLAIN = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Water boils at a temperature of",
    "The best way to learn a new language is",
    "In 1969, the first humans to walk on the Moon",
    "A healthy breakfast usually includes",
    "The main difference between a virus and a bacterium is",
    "To make a cup of tea, first",
]
_CHAT = [
    "What is the tallest mountain in the world?",
    "Give me three tips for sleeping better.",
    "Write a haiku about autumn leaves.",
    "Explain what a prime number is to a ten-year-old.",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Suggest a name for a small bakery.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish and French.",
    "What are the benefits of regular exercise?",
]
PROMPTS: list[str] = _PLAIN + [
    f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n" for q in _CHAT]


def load_default_model() -> tuple[ModelConfig, dict, object]:
    from models.loader import load_gguf
    from models.registry import DEFAULT_MODEL, load_tokenizer, resolve_model

    path = resolve_model(DEFAULT_MODEL)
    cfg, params = load_gguf(path)
    return cfg, params, load_tokenizer(path)


def build_engine(cfg: ModelConfig, params: dict, mode: Mode, *, dtype: str, max_slots: int,
                 num_pages: int | None = None, kv_cache_memory: int | None = None,
                 max_seq_len: int = 2048, prefill_lengths: tuple[int, ...] = (16, 32, 64),
                 calibration_tokens: list[int] | None = None) -> JaxEngine:
    """An engine in `mode` that compiles only the shapes it is asked to run; int8 weights are
    smoothed with `calibration_tokens` (see calibration_tokens())."""
    extra = {"num_pages": num_pages} if num_pages is not None else {}
    if kv_cache_memory is not None:
        extra["kv_cache_memory"] = kv_cache_memory
    config = EngineConfig(max_slots=max_slots, page_size=PAGE_SIZE, max_seq_len=max_seq_len,
                          prefill_lengths=prefill_lengths, dtype=dtype, quantize=mode.quantize,
                          kv_cache_dtype=mode.kv_cache_dtype, **extra)
    return JaxEngine(cfg, params, config, precompile=False, calibration_tokens=calibration_tokens)


def calibration_tokens(tok) -> list[int]:
    """The shipped calibration text (models/calibration.py), never the eval text, as token ids."""
    return tok.encode(calibration_text())


def kv_bytes_per_token(engine: JaxEngine) -> float:
    """Measured from the cache arrays the engine allocated (K, V and any scales)."""
    total = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(engine.cache))
    return total / (engine.num_pages * engine.page_size)


# ---- perplexity ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _paged_fn(cfg: ModelConfig, dtype: jnp.dtype):
    return jax.jit(functools.partial(forward_paged, cfg=cfg, page_size=PAGE_SIZE, dtype=dtype),
                   donate_argnames=("cache",))


@jax.jit
def _nll(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(-log p(target), argmax) per row; logits f32 [R,V], targets int32 [R]."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0], jnp.argmax(logits, axis=-1)


def perplexity(engine: JaxEngine, tokens: list[int], *, window: int, stride: int,
               rows: int = 128) -> dict:
    """Sliding-window perplexity (each token scored once, with >= window - stride context after
    the first window) over the paged path with the engine's params and KV dtype.

    Per window: one prefill writes the window's K/V into its pages (quantized when the cache is
    int8), then decode-shaped rows (one per scored position, as in a decode step) read those pages
    and return that position's logits; rows write only to the padding page, so every row sees
    exactly what prefill stored. The prefill's own logits at the last scored position must match
    its row (a check that the two paths agree). Also returns each scored position's argmax ("top1").
    """
    if window % PAGE_SIZE or stride < 1 or stride > window:
        raise ValueError(f"window ({window}) must be a multiple of {PAGE_SIZE} and 1 <= stride "
                         f"({stride}) <= window")
    if len(tokens) < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, got {len(tokens)}")
    cfg, dtype = engine.model_cfg, engine.dtype
    n_pages = window // PAGE_SIZE
    kv_dtype = engine.cache["k"].dtype
    cache = init_kv_cache(cfg, n_pages + 1, PAGE_SIZE, kv_dtype)  # page 0: padding
    fn = _paged_fn(cfg, dtype)
    table = np.arange(1, n_pages + 1, dtype=np.int32)
    nll_sum, count, max_check = 0.0, 0, 0.0
    top1: list[np.ndarray] = []
    prev_end = 0
    for begin in range(0, len(tokens), stride):
        end = min(begin + window, len(tokens))
        seq = np.asarray(tokens[begin:end], np.int32)
        length = len(seq)
        # query position q (window-relative) predicts token q + 1
        queries = np.arange(max(prev_end, begin + 1) - begin - 1, length - 1, dtype=np.int32)
        pos = np.arange(length, dtype=np.int32)
        tok = np.zeros((1, window), np.int32)
        positions = np.zeros((1, window), np.int32)
        slots = np.zeros((1, window), np.int32)     # padding writes to page 0
        tok[0, :length], positions[0, :length] = seq, pos
        slots[0, :length] = table[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
        last = np.asarray([queries[-1]], np.int32)
        prefill_logits, cache = fn(params=engine.params, cache=cache, tokens=tok, positions=positions,
                                   write_slots=slots, block_tables=table[None], last_index=last)
        for start in range(0, len(queries), rows):
            q = queries[start:start + rows]
            r_tok = np.zeros((rows, 1), np.int32)
            r_pos = np.zeros((rows, 1), np.int32)
            r_tok[:len(q), 0], r_pos[:len(q), 0] = seq[q], q
            targets = np.zeros(rows, np.int32)
            targets[:len(q)] = seq[q + 1]
            logits, cache = fn(params=engine.params, cache=cache, tokens=r_tok, positions=r_pos,
                               write_slots=np.zeros((rows, 1), np.int32),
                               block_tables=np.broadcast_to(table, (rows, n_pages)),
                               last_index=np.zeros(rows, np.int32))
            nll, best = jax.device_get(_nll(logits, targets))
            nll = nll[:len(q)]
            top1.append(best[:len(q)])
            nll_sum += float(nll.sum())
            count += len(q)
            if q[-1] == queries[-1]:
                diff = np.abs(np.asarray(logits[len(q) - 1]) - np.asarray(prefill_logits[0]))
                max_check = max(max_check, float(diff.max()))
        prev_end = end
        if end == len(tokens):
            break
    if count != len(tokens) - 1:
        raise RuntimeError(f"scored {count} tokens, expected {len(tokens) - 1}")
    # w8a8 rounds per-token activations to int8 with SmolLM2's outlier dims setting the scale, so
    # a 1e-6 difference in summation order can flip a rounding and move logits by ~1; not checked.
    if engine.config.quantize != "w8a8" and max_check > CHECK_TOL:
        raise RuntimeError(f"decode-row logits differ from prefill logits by {max_check:.3g} "
                           f"(> {CHECK_TOL}): the scoring rows no longer read what prefill wrote")
    return {"perplexity": math.exp(nll_sum / count), "tokens": count,
            "prefill_vs_rows_max_abs_logit_diff": max_check, "top1": np.concatenate(top1)}


# ---- greedy agreement ---------------------------------------------------------------------------

def greedy(engine: JaxEngine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """All prompts decoded together through prefill/insert/generate, not stopping at EOS."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    pages = [list(range(1 + PAGES_PER_PROMPT * i, 1 + PAGES_PER_PROMPT * (i + 1))) for i in range(len(prompts))]
    for slot, prompt in enumerate(prompts):
        if pages_needed(len(prompt) + new_tokens, PAGE_SIZE) > PAGES_PER_PROMPT:
            raise ValueError(f"prompt {slot} ({len(prompt)} tokens) is too long for {PAGES_PER_PROMPT} pages")
        engine.prefill(PrefillChunk(prompt[:-1], 0, pages[slot]))
        engine.insert(slot, SlotState(prompt, [], params))
    last = [p[-1] for p in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    for step in range(new_tokens):
        rows = [DecodeRow(s, last[s], len(prompts[s]) - 1 + step, pages[s]) for s in range(len(prompts))]
        for s, sampled in enumerate(engine.generate(rows)):
            outs[s].append(sampled.token_id)
            last[s] = sampled.token_id
    for slot in range(len(prompts)):
        engine.free(slot)
    return outs


def agreement(ref: list[list[int]], got: list[list[int]], n: int) -> dict:
    def common(a: list[int], b: list[int]) -> int:
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        return k

    prefixes = [common(a, b) for a, b in zip(ref, got)]
    return {"identical_first_n": sum(p >= n for p in prefixes) / len(ref),
            "mean_common_prefix": float(np.mean(prefixes)), "n": n}


# ---- driver -------------------------------------------------------------------------------------

def run(modes: list[Mode], *, window: int, stride: int, dtype: str) -> list[dict]:
    cfg, params, tok = load_default_model()
    with open(EVAL_TEXT, encoding="utf-8") as f:
        text_ids = tok.encode(f.read())
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    cal_ids = calibration_tokens(tok)
    results, ref_tokens, ref_top1 = [], None, None
    for mode in modes:
        start = time.perf_counter()
        engine = build_engine(cfg, params, mode, dtype=dtype, max_slots=32,
                              num_pages=1 + PAGES_PER_PROMPT * len(PROMPTS), calibration_tokens=cal_ids)
        row = {"mode": mode.name, "quantize": mode.quantize, "kv_cache_dtype": mode.kv_cache_dtype,
               "weight_bytes": weight_bytes(engine.params), "kv_bytes_per_token": kv_bytes_per_token(engine)}
        row.update(perplexity(engine, text_ids, window=window, stride=stride))
        top1 = row.pop("top1")
        outs = greedy(engine, prompt_ids, GREEDY_TOKENS)
        if ref_tokens is None:
            ref_tokens, ref_top1 = outs, top1  # the first mode is the reference (f32 by default)
        # teacher-forced: same context at every position, so one flip does not derail the rest
        row["top1_agreement"] = float(np.mean(top1 == ref_top1))
        row["greedy"] = agreement(ref_tokens, outs, AGREE_TOKENS)
        row["seconds"] = time.perf_counter() - start
        results.append(row)
        print(f"[{mode.name}] ppl {row['perplexity']:.4f} in {row['seconds']:.0f} s", file=sys.stderr, flush=True)
        del engine
    return results


def print_table(results: list[dict], *, window: int, stride: int) -> None:
    base = results[0]["perplexity"]
    print(f"perplexity over benchmarks/data/eval.txt ({results[0]['tokens'] + 1} tokens, window {window}, "
          f"stride {stride}); top-1 =: teacher-forced argmax equal to {results[0]['mode']} over the text; "
          f"greedy: {len(PROMPTS)} prompts x {GREEDY_TOKENS} tokens, share with the first {AGREE_TOKENS} equal "
          f"to {results[0]['mode']} and mean common prefix")
    header = (f"{'mode':14} {'perplexity':>10} {'delta %':>8} {'top-1 =':>7} {'greedy =16':>10} "
              f"{'mean prefix':>11} {'weights MiB':>11} {'KV B/token':>10}")
    print(header)
    print("-" * len(header))
    for r in results:
        delta = 100.0 * (r["perplexity"] / base - 1.0)
        g = r["greedy"]
        print(f"{r['mode']:14} {r['perplexity']:10.4f} {delta:+8.2f} {r['top1_agreement']:7.1%} "
              f"{g['identical_first_n']:10.0%} "
              f"{g['mean_common_prefix']:11.1f} {r['weight_bytes'] / 2**20:11.1f} {r['kv_bytes_per_token']:10.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, first is the reference; "
                        f"from {', '.join(MODES)}")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--stride", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"],
                        help="activation dtype (float32: the f32 reference)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    results = run([MODES[m] for m in args.modes.split(",")], window=args.window, stride=args.stride,
                  dtype=args.dtype)
    print_table(results, window=args.window, stride=args.stride)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"backend": jax.default_backend(), "window": args.window, "stride": args.stride,
                       "dtype": args.dtype, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
