"""Embeddings through the HTTP API, `POST /v1/embeddings`: each server's vectors for passages cut from
benchmarks/data/eval.txt against transformers' (f32 PyTorch on CPU, the same checkpoint), and their throughput
against Slipstream's plain prefill of the same passages (`/v1/completions`, `max_tokens: 1`) and against llama.cpp's
server on the same model (its Q8_0 GGUF, built by benchmarks/bench/peers.py), in one run.

Each server runs alone, in turn: Slipstream with --no-prefix-cache (benchmarks.scoring.serve), llama.cpp with
LLAMA_CPP_FLAGS and --no-cache-prompt --cache-ram 0 (its embeddings never reuse a slot's cache either). Inputs go in
requests of --batch, --concurrency requests at a time; a warm-up pass first (the pooling programs compile at first use
on CPU), then the median of --reps passes. Run from the repo root:
    .venv/bin/python -m benchmarks.embeddings [--configs "default=;f32=--quantize none --kv-cache-dtype float32"]
        [--pooling last] [--passages 256 --batch 32 --concurrency 4 --reps 3] [--out embeddings.json]
On a TPU, with random weights (no reference, no llama.cpp; passages of N random token ids):
    python -m benchmarks.embeddings --configs "llama-3.2-1b=--model llama-3.2-1b --load-format dummy" \
        --no-reference --no-peers --random-tokens 160 --settle 60
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import random
import shlex
import socket
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import httpx
import numpy as np

from benchmarks.perplexity import EVAL_TEXT
from benchmarks.scoring import machine_name, serve

SHORT = ["Hi", "The cat sat on the mat.", "Paris is the capital of France."]
RANDOM_IDS = (3, 256)  # every vocabulary has these ids (the tests' tiny models have 256); which ids changes no work


def passages(n: int, seed: int = 0) -> list[str]:
    """SHORT, then n passages of 85-170 consecutive words of eval.txt (about 100-200 tokens), each from its own
    first word: no two share a prefix for a cache to reuse."""
    with open(EVAL_TEXT, encoding="utf-8") as f:
        words = f.read().split()
    rnd = random.Random(seed)
    starts = rnd.sample(range(len(words) - 170), n)
    return SHORT + [" ".join(words[s:s + rnd.randint(85, 170)]) for s in starts]


def random_passages(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(*RANDOM_IDS) for _ in range(length)] for _ in range(n)]


def unit(rows: np.ndarray) -> np.ndarray:
    return rows / np.maximum(np.linalg.norm(rows, axis=-1, keepdims=True), 1e-12)


def hf_tokenize(model: str, texts: list[str]) -> list[list[int]]:
    import transformers

    folder, name = os.path.split(model) if model.endswith(".gguf") else (model, None)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return [tokenizer(t)["input_ids"] for t in texts]


def reference(model: str, inputs: list[list[int]], pooling: str) -> np.ndarray:
    """transformers' last_hidden_state (the final norm applied) of each input alone, f32 on CPU, pooled as the
    servers pool it, normalized: (inputs, hidden)."""
    import torch
    import transformers

    folder, name = os.path.split(model) if model.endswith(".gguf") else (model, None)
    hf = transformers.AutoModel.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for ids in inputs:
            hidden = hf(torch.tensor([ids])).last_hidden_state[0]  # (tokens, hidden)
            rows.append((hidden.mean(0) if pooling == "mean" else hidden[-1]).numpy())
    return unit(np.stack(rows))


def run_passes(client: httpx.Client, inputs: list, *, batch: int, concurrency: int,
               embed: bool) -> tuple[float, int, np.ndarray | None]:
    """One pass over `inputs` in requests of `batch`, `concurrency` at a time: (seconds, prompt tokens the server
    counted, the embeddings in input order or None for prefill)."""
    chunks = [inputs[i:i + batch] for i in range(0, len(inputs), batch)]

    def post(chunk: list) -> tuple[int, list[np.ndarray]]:
        if embed:
            body = client.post("/v1/embeddings", json={"input": chunk, "encoding_format": "base64"}
                               ).raise_for_status().json()
            data = sorted(body["data"], key=lambda d: d["index"])
            return body["usage"]["prompt_tokens"], [np.frombuffer(base64.b64decode(d["embedding"]), "<f4")
                                                    for d in data]
        body = client.post("/v1/completions", json={"prompt": chunk, "max_tokens": 1}).raise_for_status().json()
        return body["usage"]["prompt_tokens"], []

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(post, chunks))
    seconds = time.perf_counter() - start
    vectors = [v for _, vs in done for v in vs]
    return seconds, sum(t for t, _ in done), unit(np.stack(vectors)) if embed else None


def measure(client: httpx.Client, inputs: list, *, batch: int, concurrency: int, reps: int,
            prefill: bool) -> tuple[dict, np.ndarray]:
    """A warm-up pass, then `reps` passes of embedding (and of prefill, interleaved): medians, rates, and the
    warm-up pass's vectors (how far a later pass's differ: batch neighbours change between passes)."""
    kinds = ("embed", "prefill") if prefill else ("embed",)
    start = time.perf_counter()
    _, _, first = run_passes(client, inputs, batch=batch, concurrency=concurrency, embed=True)
    if prefill:
        run_passes(client, inputs, batch=batch, concurrency=concurrency, embed=False)
    out: dict = {"first_pass_s": time.perf_counter() - start, "repeat_cosine_min": 1.0}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(reps):
        for kind in kinds:
            seconds, tokens, vectors = run_passes(client, inputs, batch=batch, concurrency=concurrency,
                                                  embed=kind == "embed")
            times[kind].append(seconds)
            out[f"{kind}_tokens"] = tokens
            if vectors is not None:
                out["repeat_cosine_min"] = min(out["repeat_cosine_min"], float(np.min(np.sum(vectors * first, axis=1))))
    for kind in kinds:
        out[f"{kind}_s"] = statistics.median(times[kind])
        out[f"{kind}_inputs_per_s"] = len(inputs) / out[f"{kind}_s"]
        out[f"{kind}_tokens_per_s"] = out[f"{kind}_tokens"] / out[f"{kind}_s"]
    if prefill:
        out["embed_vs_prefill"] = out["embed_tokens_per_s"] / out["prefill_tokens_per_s"]
    return out, first


def measure_server(client: httpx.Client, row: dict, args: argparse.Namespace, inputs: list, texts: list[str] | None,
                   ids: list[list[int]] | None, ref: np.ndarray | None, *,
                   tokenize: Callable[[str], list[int]], prefill: bool) -> dict:
    """`row` with a server's numbers: how many texts it tokenizes unlike the reference's tokenizer, its rates, and
    the cosines of its vectors to the reference's."""
    if texts is not None and ids is not None:
        row["token_ids_mismatched"] = sum(tokenize(t) != want for t, want in zip(texts, ids))
    numbers, vectors = measure(client, inputs, batch=args.batch, concurrency=args.concurrency, reps=args.reps,
                               prefill=prefill)
    row.update(numbers)
    if ref is not None:
        cos = np.sum(vectors * ref, axis=1)
        row.update(cosine_min=float(cos.min()), cosine_median=float(np.median(cos)))
    return row


# Steps of 2048 tokens, -b = -ub (an embedding's input must be whole in one ubatch: llama-server sets -b to -ub
# itself), about 13 passages; 32 slots, so the requests in flight keep a step full; one KV pool for all slots
# (-kvu). With a KV stream per slot (-no-kvu, as benchmarks/compare.py runs generation) mean-pooled vectors of
# inputs that share a step came out wrong (cosine to transformers' down to 0.69; 0.9998 one input at a time; the
# llama.cpp of llama-cpp-python 0.3.36): its ubatches then take each input in parts, and a mean covers the last.
LLAMA_CPP_FLAGS = "-np 32 -c 16384 -b 2048 -ub 2048 -kvu"


def llama_cpp(model: str, pooling: str, flags: str, tmp: str, build_jobs: int) -> tuple:
    """llama.cpp's server on the Q8_0 GGUF with `flags`, started (peers.RunningServer) and ready: (the server, its
    command). A thread per core, as Slipstream uses; no prompt cache."""
    from benchmarks.bench import peers

    bin_dir = peers.ensure_llama_cpp(build_jobs)
    gguf = peers.ensure_gguf(model, "Q8_0", bin_dir)
    threads = str(os.cpu_count() or 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = peers.ServerSpec("llama.cpp", "llama.cpp server, Q8_0 GGUF", [
        str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", "{port}",
        "--embeddings", "--pooling", pooling, "-t", threads, "-tb", threads, *shlex.split(flags),
        "--no-cache-prompt", "--cache-ram", "0"])
    server = peers.RunningServer(spec, port, Path(tmp) / "llama.log")
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server, spec.command(port)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="default=;f32=--quantize none --kv-cache-dtype float32",
                        help="name=slipstream serve flags, separated by ';'")
    parser.add_argument("--model", help="served by every config without its own --model, and the reference's and "
                                        "llama.cpp's checkpoint (default: the default model's GGUF)")
    parser.add_argument("--pooling", choices=("last", "mean"), default="last")
    parser.add_argument("--passages", type=int, default=256)
    parser.add_argument("--random-tokens", type=int, default=0, metavar="N",
                        help="passages of N random token ids, sent as ids, instead of eval.txt's text: for "
                             "dummy-weight presets, where only the timing means anything")
    parser.add_argument("--batch", type=int, default=32, help="inputs per request")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--settle", type=float, default=0.0, metavar="S",
                        help="seconds to wait after /ready (on accelerators the pooling programs compile in the "
                             "background once the server is up)")
    parser.add_argument("--no-reference", action="store_true", help="skip transformers' vectors (and the cosines)")
    parser.add_argument("--no-peers", action="store_true", help="skip llama.cpp's server")
    parser.add_argument("--llama-cpp-flags", default=LLAMA_CPP_FLAGS,
                        help="llama-server's batching flags (besides the model, --embeddings, --pooling, threads and "
                             "no prompt cache)")
    parser.add_argument("--build-jobs", type=int, default=2, help="for building llama.cpp the first time")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.model is None and not (args.no_reference and args.no_peers):
        from slipstream.models.registry import DEFAULT_MODEL, resolve_model

        args.model = resolve_model(DEFAULT_MODEL)
    if not args.no_peers and not str(args.model).endswith(".gguf"):
        parser.error("llama.cpp's server needs a GGUF --model: pass --no-peers")

    machine = machine_name()
    print(f"machine: {machine}")
    texts = None if args.random_tokens else passages(args.passages)
    inputs = random_passages(args.passages, args.random_tokens) if args.random_tokens else texts
    kind = f"passages of {args.random_tokens} random ids" if args.random_tokens else "eval.txt passages"
    print(f"{len(inputs)} inputs ({kind}); pooling {args.pooling}; requests of {args.batch} inputs, "
          f"{args.concurrency} at a time; median of {args.reps} passes", flush=True)
    ids = inputs if args.random_tokens else None if args.no_reference else hf_tokenize(args.model, texts)
    if ids is not None:
        print(f"{sum(map(len, ids))} tokens, {min(map(len, ids))} to {max(map(len, ids))} an input")
    ref = None if args.no_reference else reference(args.model, ids, args.pooling)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for entry in args.configs.split(";"):
            name, _, flags = entry.partition("=")
            uds = os.path.join(tmp, f"{name}.sock")
            model = ["--model", args.model] if args.model else []  # a config's own --model comes later and wins
            proc = serve([*model, "--pooling", args.pooling, *shlex.split(flags)], uds, os.path.join(tmp, "serve.log"))
            time.sleep(args.settle)
            try:
                client = httpx.Client(transport=httpx.HTTPTransport(uds=uds), base_url="http://slipstream", timeout=600)
                results.append(measure_server(
                    client, {"server": f"slipstream {name}", "flags": flags}, args, inputs, texts, ids, ref,
                    tokenize=lambda t: client.post("/tokenize", json={"prompt": t}).raise_for_status().json()["tokens"],
                    prefill=True))
            finally:
                proc.terminate()
                proc.wait(60)
            row = results[-1]
            print(f"{row['server']}: {row['embed_inputs_per_s']:.1f} inputs/s", flush=True)
        if not args.no_peers:
            server, command = llama_cpp(args.model, args.pooling, args.llama_cpp_flags, tmp, args.build_jobs)
            try:
                client = httpx.Client(base_url=server.base_url, timeout=600, trust_env=False)
                row = measure_server(  # the ids its /v1/embeddings runs: special tokens added as the GGUF says
                    client, {"server": "llama.cpp Q8_0", "command": command}, args, inputs, texts, ids, ref,
                    tokenize=lambda t: client.post("/tokenize", json={"content": t, "add_special": True}
                                                   ).raise_for_status().json()["tokens"], prefill=False)
            finally:
                server.stop()
            results.append(row)
            print(f"llama.cpp: {command}")
            for r in results[:-1]:
                r["vs_llama_cpp"] = r["embed_inputs_per_s"] / row["embed_inputs_per_s"]
    print_table(results)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"machine": machine, "pooling": args.pooling, "inputs": len(inputs),
                       "random_tokens": args.random_tokens, "batch": args.batch, "concurrency": args.concurrency,
                       "reps": args.reps, "results": results}, f, indent=2)


COLUMNS = [("cosine_min", "cos min", "{:.6f}"), ("cosine_median", "cos median", "{:.6f}"),
           ("token_ids_mismatched", "ids differ", "{}"), ("embed_inputs_per_s", "inputs/s", "{:.1f}"),
           ("embed_tokens_per_s", "tokens/s", "{:.0f}"), ("prefill_tokens_per_s", "prefill tok/s", "{:.0f}"),
           ("embed_vs_prefill", "embed/prefill", "{:.2f}x"), ("vs_llama_cpp", "vs llama.cpp", "{:.2f}x"),
           ("repeat_cosine_min", "repeat cos min", "{:.6f}"), ("first_pass_s", "first pass s", "{:.1f}")]


def print_table(results: list[dict]) -> None:
    """One row per server: its embeddings against transformers', its rates and their ratios (- where not measured)."""
    columns = [c for c in COLUMNS if any(c[0] in r for r in results)]
    cells = [[r["server"]] + [fmt.format(r[key]) if key in r else "-" for key, _, fmt in columns] for r in results]
    head = ["server"] + [title for _, title, _ in columns]
    widths = [max(len(row[i]) for row in [head, *cells]) for i in range(len(head))]
    for row in [head, *cells]:
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))))


if __name__ == "__main__":
    main()
