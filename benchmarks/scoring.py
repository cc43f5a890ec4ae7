"""Scoring text through the HTTP API, as evaluation harnesses do: `/v1/completions` with the text's token ids, `echo`,
`logprobs: 0` and `max_tokens: 0`. Reports the default model's perplexity on benchmarks/data/eval.txt computed from
the returned prompt logprobs (the same sliding windows as benchmarks.perplexity, whose table it should equal for the
same weights and K/V), and how long scoring takes against plain prefill of the same windows (`max_tokens: 1`, no
echo), interleaved in one run.

Each server is `slipstream serve` on a unix socket with the flags given and --no-prefix-cache (a scored window's
pages would otherwise make its plain prefill a cache hit; scoring computes every window whole either way). Run
from the repo root:
    .venv/bin/python -m benchmarks.scoring [--configs "default=;f32=--quantize none --kv-cache-dtype float32"]
        [--window 512 --stride 256 --reps 3] [--out scoring.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

from benchmarks.measure import cpu_model
from benchmarks.perplexity import EVAL_TEXT


# engine/device/programs.py's log line for each scoring or pooling program it compiles
COMPILED = re.compile(r"compiled the (.+?) program \((\d+) tokens\) in ([\d.]+) s")


def windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """benchmarks.perplexity's windows over n tokens: (begin, end, first scored position in the window), so each
    token after the first is scored once, with >= window - stride tokens before it after the first window."""
    out, prev_end = [], 0
    for begin in range(0, n, stride):
        end = min(begin + window, n)
        out.append((begin, end, max(prev_end, begin + 1) - begin))
        prev_end = end
        if end == n:
            break
    return out


def serve(flags: list[str], uds: str, log_path: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "slipstream.server.cli", "serve", "--uds", uds, "--no-prefix-cache", *flags]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    client = httpx.Client(transport=httpx.HTTPTransport(uds=uds), base_url="http://slipstream", timeout=5)
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"slipstream serve {shlex.join(flags)} exited with {proc.returncode}; see {log_path}")
        try:
            if client.get("/ready").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.terminate()
            raise TimeoutError(f"slipstream serve not ready in 600 s; see {log_path}")
        time.sleep(0.2)


def measure(uds: str, tokens: list[int], *, window: int, stride: int, reps: int) -> dict:
    """Perplexity from the echoed logprobs, and the median seconds of scoring all windows against prefilling them."""
    client = httpx.Client(transport=httpx.HTTPTransport(uds=uds), base_url="http://slipstream", timeout=600)
    spans = windows(len(tokens), window, stride)

    def score() -> float:
        nll, count = 0.0, 0
        for begin, end, first in spans:
            body = client.post("/v1/completions", json={"prompt": tokens[begin:end], "echo": True, "logprobs": 0,
                                                        "max_tokens": 0}).raise_for_status().json()
            lps = body["choices"][0]["logprobs"]["token_logprobs"]
            if len(lps) != end - begin or lps[0] is not None:
                raise RuntimeError(f"window {begin}..{end}: {len(lps)} logprobs for {end - begin} tokens")
            scored = lps[first:]  # entry q: token q given the ones before it in the window
            nll -= sum(scored)
            count += len(scored)
        if count != len(tokens) - 1:
            raise RuntimeError(f"scored {count} tokens, expected {len(tokens) - 1}")
        return math.exp(nll / count)

    def prefill() -> None:
        for begin, end, _ in spans:
            client.post("/v1/completions", json={"prompt": tokens[begin:end], "max_tokens": 1}).raise_for_status()

    start = time.perf_counter()
    score()  # warm-up: compiles the scoring program
    first_s = time.perf_counter() - start
    times: dict[str, list[float]] = {"score": [], "prefill": []}
    perplexities = []
    for _ in range(reps):
        for name, fn in (("score", score), ("prefill", prefill)):
            start = time.perf_counter()
            out = fn()
            times[name].append(time.perf_counter() - start)
            if name == "score":
                perplexities.append(out)
    if max(perplexities) - min(perplexities) > 1e-6 * perplexities[0]:
        raise RuntimeError(f"perplexity differs between runs: {perplexities}")
    window_tokens = sum(end - begin for begin, end, _ in spans)
    score_s, prefill_s = statistics.median(times["score"]), statistics.median(times["prefill"])
    return {"perplexity": perplexities[0], "windows": len(spans), "window_tokens": window_tokens, "first_score_s": first_s,
            "score_s": score_s, "prefill_s": prefill_s, "score_tokens_per_s": window_tokens / score_s,
            "prefill_tokens_per_s": window_tokens / prefill_s, "score_vs_prefill": score_s / prefill_s}


def check(uds: str, tokens: list[int], positions: int) -> float:
    """The largest difference between an echoed prompt's logprob of a token and the one reported when the same
    token is sampled after the same prefix (forced with logit_bias; reported logprobs are the model's own), over
    `positions` positions of the first window."""
    client = httpx.Client(transport=httpx.HTTPTransport(uds=uds), base_url="http://slipstream", timeout=600)
    prompt = tokens[:min(len(tokens), 512)]
    echoed = client.post("/v1/completions", json={"prompt": prompt, "echo": True, "logprobs": 0, "max_tokens": 0}
                         ).raise_for_status().json()["choices"][0]["logprobs"]["token_logprobs"]
    worst = 0.0
    for i in sorted({round(1 + j * (len(prompt) - 2) / max(1, positions - 1)) for j in range(positions)}):
        forced = client.post("/v1/completions", json={"prompt": prompt[:i], "max_tokens": 1, "logprobs": 0,
                                                      "temperature": 0, "logit_bias": {str(prompt[i]): 100}}
                             ).raise_for_status().json()["choices"][0]["logprobs"]
        worst = max(worst, abs(forced["token_logprobs"][0] - echoed[i]))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="default=;f32=--quantize none --kv-cache-dtype float32",
                        help="name=serve flags, separated by ';'")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--stride", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--random-tokens", type=int, default=0, metavar="N",
                        help="score N random token ids (in [100, 30000)) instead of eval.txt: for dummy-weight "
                             "presets, where only the timing and the check mean anything")
    parser.add_argument("--check", type=int, default=8, metavar="K",
                        help="compare K positions' echoed logprobs with forced-decode ones (0: skip)")
    parser.add_argument("--settle", type=float, default=0.0, metavar="S",
                        help="seconds to wait after /ready before scoring (on accelerators the scoring program "
                             "compiles in the background once the server is up)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    if not 1 <= args.stride < args.window:
        parser.error("--stride must be in [1, --window): each window's first token is scored in the window before")
    if args.random_tokens:
        import random
        rnd = random.Random(0)
        tokens = [rnd.randrange(100, 30000) for _ in range(args.random_tokens)]
    else:
        from slipstream.models.registry import DEFAULT_MODEL, load_tokenizer, resolve_model

        tokenizer = load_tokenizer(resolve_model(DEFAULT_MODEL))
        with open(EVAL_TEXT, encoding="utf-8") as f:
            tokens = list(tokenizer.encode(f.read()))  # as benchmarks.perplexity tokenizes it
    machine = machine_name()
    print(f"machine: {machine}; {len(tokens)} tokens, windows of {args.window} every {args.stride}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for entry in args.configs.split(";"):
            name, _, flags = entry.partition("=")
            uds = os.path.join(tmp, f"{name}.sock")
            log_path = os.path.join(tmp, f"{name}.log")
            proc = serve(shlex.split(flags), uds, log_path)
            time.sleep(args.settle)
            try:
                row = {"config": name, "flags": flags, **measure(uds, tokens, window=args.window, stride=args.stride,
                                                                   reps=args.reps)}
                if args.check:
                    row["check_max_abs_diff"] = check(uds, tokens, args.check)
            finally:
                proc.terminate()
                proc.wait(60)
                with open(log_path, encoding="utf-8", errors="replace") as f:
                    compiled = [m for line in f if (m := COMPILED.search(line))]
            # the extended programs (scoring, pooling) the server compiled meanwhile, and their seconds
            row["extended_compiles"] = [[m[1], int(m[2]), float(m[3])] for m in compiled]
            print(f"{name}: server log: {len(compiled)} extended programs compiled in "
                  f"{sum(float(m[3]) for m in compiled):.1f} s: "
                  + ", ".join(f"{m[1]} {m[2]}: {float(m[3]):.1f} s" for m in compiled))
            results.append(row)
            print(f"{name:10} perplexity {row['perplexity']:.4f}  scoring {row['score_s']:.2f} s "
                  f"({row['score_tokens_per_s']:.0f} tok/s)  prefill {row['prefill_s']:.2f} s "
                  f"({row['prefill_tokens_per_s']:.0f} tok/s)  scoring/prefill {row['score_vs_prefill']:.2f}x  "
                  f"first scoring pass {row['first_score_s']:.1f} s  echoed vs forced-decode logprobs: "
                  f"max |diff| {row.get('check_max_abs_diff', float('nan')):.2e}", flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"machine": machine, "tokens": len(tokens), "window": args.window, "stride": args.stride, "results": results}, f,
                      indent=2)


def machine_name() -> str:
    """The CPU, and the accelerator when JAX finds one (asked in a child process: the servers need the device)."""
    probe = ("import jax; d = jax.devices()[0]; "
             "print(d.device_kind if d.platform != 'cpu' else '')")
    kind = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip()
    return f"{cpu_model()}, {os.cpu_count()} cores" + (f"; {kind}" if kind else "")


if __name__ == "__main__":
    main()
