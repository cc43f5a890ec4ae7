"""Multi-LoRA serving cost: the same `slipstream bench` workload against the base model, then spread over
LoRA adapters (random weights, PEFT format, written here with safetensors), each on its own fresh server.
Reports output tok/s and TTFT p90 side by side, and their ratios (issue 50's bar: >= 0.85x and <= 1.2x).
With --rounds N the two servers take turns (base, lora, then lora, base, ...: load that drifts during the
run falls on both) and the medians of each column are compared.

    .venv/bin/python -m benchmarks.lora --root /tmp/lora-bench            # write adapters, print commands
    .venv/bin/python -m benchmarks.lora --root /tmp/lora-bench --run      # and run both, one after another
    .venv/bin/python -m benchmarks.lora --root /tmp/lora-bench --run --rounds 2   # base, lora, lora, base
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
import urllib.request

import numpy as np
from safetensors.numpy import save_file

SERVE = [sys.executable, "-m", "slipstream.server.cli", "serve"]
BENCH = [sys.executable, "-m", "slipstream.server.cli", "bench"]


def write_adapters(model: str, root: str, count: int, rank: int, seed: int = 0) -> list[str]:
    """`count` random rank-`rank` adapters on every q/k/v/o/gate/up/down linear of `model`, under `root`."""
    from slipstream.models.loader import load_model
    from slipstream.models.lora import lora_targets
    from slipstream.models.registry import resolve_model

    cfg, base = load_model(resolve_model(model))
    targets = lora_targets(base)
    rng = np.random.default_rng(seed)
    names = []
    for k in range(count):
        name = f"bench-r{rank}-{k}"
        out = os.path.join(root, name)
        os.makedirs(out, exist_ok=True)
        tensors = {}
        for t in targets.values():
            for i in range(cfg.num_layers):
                key = f"base_model.model.{t.hf_prefix.format(i=i)}"
                # A like peft's kaiming init, B small and non-zero: outputs change, but stay text
                a = rng.standard_normal((rank, t.d_in)) / np.sqrt(t.d_in)
                tensors[f"{key}.lora_A.weight"] = a.astype(np.float32)
                tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((t.d_out, rank)) * 0.01).astype(np.float32)
        save_file(tensors, os.path.join(out, "adapter_model.safetensors"))
        with open(os.path.join(out, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(targets),
                       "lora_dropout": 0.0, "bias": "none", "base_model_name_or_path": model}, f)
        names.append(name)
    return names


def _wait_ready(port: int, proc: subprocess.Popen, timeout: float = 900.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server not ready within {timeout:.0f}s")


def _run(label: str, serve: list[str], bench: list[str], port: int, out_dir: str) -> dict:
    print(f"== {label}\n$ {shlex.join(serve)}\n$ {shlex.join(bench)}", file=sys.stderr, flush=True)
    proc = subprocess.Popen(serve, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_ready(port, proc)
        subprocess.run(bench + ["--save-result", "--result-dir", out_dir, "--result-filename", f"{label}.json"],
                       check=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    with open(os.path.join(out_dir, f"{label}.json")) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", required=True, help="where the adapters are written (the server's --lora-root)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--adapters", type=int, default=8, help="adapters loaded at start")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--used", type=int, default=4, help="adapters the requests spread over")
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--run", action="store_true", help="start each server and run the benchmark (else print)")
    p.add_argument("--rounds", type=int, default=1, help="turns of both servers, the order flipped each round")
    args = p.parse_args(argv)

    names = write_adapters(args.model, args.root, args.adapters, args.rank)
    common = ["--model", args.model, "--port", str(args.port)]
    lora = ["--lora-root", args.root, "--max-loras", str(args.max_loras), "--max-lora-rank", str(args.rank),
            "--lora-modules", *(f"{n}={n}" for n in names)]
    bench = BENCH + ["--port", str(args.port), "--dataset-name", "random", "--num-prompts", str(args.num_prompts),
                     "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
                     "--max-concurrency", str(args.concurrency), "--ignore-eos", "--temperature", "0",
                     "--tokenizer", args.model]
    runs = [("base", SERVE + common, bench + ["--model", args.model]),
            ("lora", SERVE + common + lora, bench + ["--model", args.model, "--lora-modules", *names[:args.used]])]
    if not args.run:
        for label, serve, b in runs:
            print(f"# {label}\n{shlex.join(serve)} &\n{shlex.join(b)}\n")
        return 0
    per = {"base": [], "lora": []}
    for k in range(args.rounds):
        for label, serve, b in (runs if k % 2 == 0 else runs[::-1]):
            per[label].append(_run(label, serve, b, args.port, args.root))
    if args.rounds > 1:
        print(f"{'round':8}{'base tok/s':>12}{'lora tok/s':>12}{'ratio':>8}{'base TTFT p90':>15}{'lora TTFT p90':>15}{'ratio':>8}")
        for k, (b, lo) in enumerate(zip(per["base"], per["lora"]), 1):
            print(f"{k:<8}{b['output_throughput']:12.1f}{lo['output_throughput']:12.1f}"
                  f"{lo['output_throughput'] / b['output_throughput']:8.3f}{b['p90_ttft_ms']:15.1f}"
                  f"{lo['p90_ttft_ms']:15.1f}{lo['p90_ttft_ms'] / b['p90_ttft_ms']:8.3f}")
    med = {label: {key: float(np.median([r[key] for r in rs])) for key in ("output_throughput", "p90_ttft_ms")}
           for label, rs in per.items()}
    base, lo = med["base"], med["lora"]
    tok = lo["output_throughput"] / base["output_throughput"]
    ttft = lo["p90_ttft_ms"] / base["p90_ttft_ms"]
    from benchmarks.measure import cpu_model

    print(f"CPU: {cpu_model()}")
    print(f"{'median' if args.rounds > 1 else '':24}{'base':>12}{'lora':>12}{'ratio':>8}")
    print(f"{'output tok/s':24}{base['output_throughput']:12.1f}{lo['output_throughput']:12.1f}{tok:8.3f}")
    print(f"{'TTFT p90 (ms)':24}{base['p90_ttft_ms']:12.1f}{lo['p90_ttft_ms']:12.1f}{ttft:8.3f}")
    print(json.dumps({"output_tok_s_ratio": tok, "ttft_p90_ratio": ttft, "adapters": args.adapters,
                      "used": args.used, "rank": args.rank, "concurrency": args.concurrency, "rounds": args.rounds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
