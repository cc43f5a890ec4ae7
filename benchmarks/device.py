"""One run that measures an accelerator (or a CPU): HBM read rate, matmul rates, the engine's decode
step and a prefill chunk against floors from this run's own numbers, then `slipstream serve` over a
unix socket under `slipstream bench`. This process only orchestrates and never opens the device.

    python -m benchmarks.device --model llama-3.1-8b --load-format dummy [--quantize ...] [--dtype ...]

`--phases spec` (not in the default set) measures speculative decoding instead: a verification step's
time for K = 0, 2, 4, 8 drafts per sequence at 1 and 32 sequences, and greedy output with n-gram
speculation against greedy without it (benchmarks/device_spec.py).

The measurements that hold the device run in one child process (benchmarks/device_phases.py); the
server starts after it has exited (one program holds a TPU at a time). Each phase prints its
numbers as it ends and adds them to DIR/device.json; DIR/device.md is the table of what finished.
"""
from __future__ import annotations

import argparse
import http.client
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from benchmarks.device_report import markdown

PHASES = ("hbm", "matmul", "engine", "spec", "serving")
DEFAULT_PHASES = ("hbm", "matmul", "engine", "serving")  # spec: on request (--phases spec)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = p.add_argument_group("model and engine (the same for the in-process phases and the server)")
    model.add_argument("--model", default="smollm2-135m-instruct")
    model.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                       help="dummy: random weights for --model's config (an architecture preset or an HF directory)")
    model.add_argument("--dtype", default="auto")
    model.add_argument("--quantize", default="auto")
    model.add_argument("--kv-cache-dtype", default="auto")
    model.add_argument("--page-size", type=int, default=None, help="default: the engine's")
    run = p.add_argument_group("what to run")
    run.add_argument("--phases", default=",".join(DEFAULT_PHASES),
                     help=f"a subset of {','.join(PHASES)} (default {','.join(DEFAULT_PHASES)})")
    run.add_argument("--skip-serving", action="store_true")
    run.add_argument("--startup", action="store_true",
                     help="start the server a second time on the same compile cache (warm start-up)")
    run.add_argument("--phase-timeout", type=float, default=540,
                     help="seconds for the in-process phases together, and for each server start and client run")
    run.add_argument("--output-dir", default=None, help="default: $OUT if set, else ./device-results")
    size = p.add_argument_group("sizes")
    size.add_argument("--hbm-bytes", type=int, default=None,
                      help="bytes summed by the HBM probe (default: 2 GiB capped at a quarter of device memory; "
                           "256 MiB on CPU)")
    size.add_argument("--matmul-m", type=_ints, default=[1, 32, 256, 2048], help="rows of the activations")
    size.add_argument("--matmul-layers", type=int, default=8, help="weights in the lax.scan that times each matmul")
    size.add_argument("--slots", type=_ints, default=[1, 32, 64], help="decode batch sizes")
    size.add_argument("--context", type=int, default=1024, help="tokens in each sequence's KV during decode")
    size.add_argument("--prefill-tokens", type=int, default=2048, help="the prefill chunk (the engine's token budget)")
    size.add_argument("--steps", type=int, default=10, help="timed repetitions of each engine measurement")
    size.add_argument("--warmup", type=int, default=2)
    size.add_argument("--profile", action="store_true",
                      help="the device's top ops of one decode step per batch and of the prefill chunk (profiler)")
    spec = p.add_argument_group("spec phase (speculative decoding: benchmarks/device_spec.py)")
    spec.add_argument("--spec-slots", type=_ints, default=[1, 32], help="sequences per verification step")
    spec.add_argument("--spec-drafts", type=_ints, default=[0, 2, 4, 8],
                      help="drafts K per sequence (K + 1 query tokens; 0: the plain decode step)")
    spec.add_argument("--spec-prompts", type=int, default=16, help="requests of the greedy identity runs")
    spec.add_argument("--spec-output-len", type=int, default=64, help="tokens each identity request generates")
    spec.add_argument("--spec-passage-len", type=int, default=200,
                      help="tokens of each repeat prompt's passage (and of each random prompt)")
    serve = p.add_argument_group("serving phase")
    serve.add_argument("--serving-prompts", type=int, default=128)
    serve.add_argument("--serving-concurrency", type=int, default=32)
    serve.add_argument("--serving-input-len", type=int, default=512)
    serve.add_argument("--serving-output-len", type=int, default=128)
    serve.add_argument("--serving-temperature", type=float, default=0.0,
                       help="the requests' temperature (0: greedy, as issue 48's serving targets are measured)")
    serve.add_argument("--serve-flags", default="", help="extra `slipstream serve` flags, one string")
    serve.add_argument("--serving-trace", action="store_true",
                       help="after the serving run, the same requests again on a server restarted (warm cache) under "
                            "benchmarks.bench.trace_server: where a request's time to first token went on the server "
                            "(trace_server.ttft_parts; its stamps cost a little host time, so the plain run's numbers "
                            "stay the ones reported)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    phases = [x for x in args.phases.split(",") if x]
    unknown = sorted(set(phases) - set(PHASES))
    if unknown:
        raise SystemExit(f"--phases: unknown {', '.join(unknown)} (choose from {', '.join(PHASES)})")
    if args.skip_serving and "serving" in phases:
        phases.remove("serving")
    args.phases = phases
    args.output_dir = args.output_dir or os.environ.get("OUT") or "device-results"
    for name in ("context", "prefill_tokens", "steps", "matmul_layers", "serving_prompts", "serving_concurrency",
                 "serving_input_len", "serving_output_len", "spec_prompts", "spec_output_len"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.slots or min(args.slots) < 1 or not args.matmul_m or min(args.matmul_m) < 1:
        raise SystemExit("--slots and --matmul-m need positive integers")
    if not args.spec_slots or min(args.spec_slots) < 1 or not args.spec_drafts or min(args.spec_drafts) < 0:
        raise SystemExit("--spec-slots needs positive integers and --spec-drafts integers >= 0")
    if args.spec_passage_len < 8:
        raise SystemExit(f"--spec-passage-len must be >= 8, got {args.spec_passage_len}")
    return args


# ---- the results file ---------------------------------------------------------------------------

def results_path(args: argparse.Namespace) -> str:
    return os.path.join(args.output_dir, "device.json")


def record(args: argparse.Namespace, section: str, value, shown=None) -> None:
    """Add one phase's numbers to device.json (rewritten whole, so a cut run keeps what finished),
    print them (or `shown`, the part that is new), and refresh device.md."""
    path = results_path(args)
    report = read_results(path)
    report[section] = value
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)
    with open(os.path.join(args.output_dir, "device.md"), "w") as f:
        f.write(markdown(report) + "\n")
    print(f"[{section}] {json.dumps(value if shown is None else shown)}", flush=True)


def read_results(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


# ---- serving over a unix socket -----------------------------------------------------------------

class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


def _ready(uds: str) -> bool:
    if not os.path.exists(uds):
        return False
    conn = _UnixHTTPConnection(uds, timeout=5)
    try:
        conn.request("GET", "/ready")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def _greedy_completion(uds: str) -> list:
    """One greedy completion's tokens over the socket: a warm server must answer as the cold one did."""
    conn = _UnixHTTPConnection(uds, timeout=120)
    try:
        body = {"prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0,
                "ignore_eos": True, "logprobs": 1}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        reply = json.loads(response.read())
        if response.status != 200:
            raise RuntimeError(f"greedy completion: HTTP {response.status}: {reply}")
        return reply["choices"][0]["logprobs"]["tokens"]
    finally:
        conn.close()


def _loaded_programs(log_path: str) -> int | None:
    """How many programs the latest server start loaded whole (its start-up line), if it said."""
    found = re.findall(r"\((\d+) loaded whole", _tail(log_path, 1 << 16))
    return int(found[-1]) if found else None


def _cpu_env() -> dict:
    """A helper process's environment: it must not open the accelerator the server holds."""
    return {**os.environ, "JAX_PLATFORMS": "cpu"}


def serve_command(args: argparse.Namespace, uds: str, cache: str, module: str = "slipstream.server.cli") -> list[str]:
    context = args.serving_input_len + args.serving_output_len
    cmd = [sys.executable, "-m", module, "serve", "--uds", uds, "--compile-cache", cache,
           "--model", args.model, "--dtype", args.dtype, "--quantize", args.quantize,
           "--kv-cache-dtype", args.kv_cache_dtype, "--max-slots", str(args.serving_concurrency),
           "--max-seq-len", str(context + 1)]
    if args.load_format != "auto":
        cmd += ["--load-format", args.load_format]
    if args.page_size:
        cmd += ["--page-size", str(args.page_size)]
    flags = args.serve_flags.split()
    engine = read_results(results_path(args)).get("engine", {})
    if "--kv-cache-memory" not in flags and engine.get("kv_bytes_per_token"):
        # room for every slot's whole sequence (the default budget is sized for the default model)
        page = engine.get("page_size", 16)
        tokens = args.serving_concurrency * (-(-(context + 1) // page) + 1) * page
        cmd += ["--kv-cache-memory", str(tokens * engine["kv_bytes_per_token"])]
    return cmd + flags


def start_server(args: argparse.Namespace, uds: str, cache: str, log_path: str, traces: tuple[str, str] | None = None):
    """(process, seconds from launch to /ready answering 200); with `traces` (the requests' and the steps'
    JSONL files) under benchmarks.bench.trace_server."""
    module, env = "slipstream.server.cli", None
    if traces is not None:
        module = "benchmarks.bench.trace_server"
        env = {**os.environ, "SLIPSTREAM_TRACE": traces[0], "SLIPSTREAM_TRACE_STEPS": traces[1]}
    cmd = serve_command(args, uds, cache, module)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    start = time.perf_counter()
    while not _ready(uds):
        if proc.poll() is not None:
            raise RuntimeError(f"slipstream serve exited with {proc.returncode}; see {log_path}:\n"
                               f"{_tail(log_path)}")
        if time.perf_counter() - start > args.phase_timeout:
            stop_server(proc)
            raise TimeoutError(f"slipstream serve not ready after {args.phase_timeout:.0f} s; see {log_path}")
        time.sleep(0.2)
    return proc, time.perf_counter() - start


def server_machine(args: argparse.Namespace, log_path: str) -> dict:
    """The machine as the server logged it ("device: 1 x TPU v5 lite (tpu backend, jax ...)"), for a run
    without the in-process phases that record it from JAX."""
    from benchmarks.measure import cpu_model

    found = re.findall(r"device: (.+)", _tail(log_path, 1 << 16))
    return {"device": found[-1].strip() if found else "?", "cpu": cpu_model(), "cores": os.cpu_count(),
            "model": args.model, "load_format": args.load_format,
            "mode": f"dtype={args.dtype} quantize={args.quantize} kv={args.kv_cache_dtype}"}


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _tail(path: str, n: int = 3000) -> str:
    with open(path, "rb") as f:
        return f.read()[-n:].decode(errors="replace")


def run_client(args: argparse.Namespace, uds: str, out_name: str = "serving-bench.json") -> dict:
    from slipstream.models.registry import resolve_model  # no JAX: this process must not open the device

    # the file whose tokenizer the server uses (an architecture preset's config for --load-format dummy)
    tokenizer = resolve_model(args.model, args.load_format)
    cmd = [sys.executable, "-m", "slipstream.server.cli", "bench", "--base-url", f"unix:{uds}", "--dataset-name", "random",
           "--random-input-len", str(args.serving_input_len), "--random-output-len", str(args.serving_output_len),
           "--ignore-eos", "--num-prompts", str(args.serving_prompts),
           "--max-concurrency", str(args.serving_concurrency), "--tokenizer", tokenizer, "--disable-tqdm",
           "--temperature", str(args.serving_temperature),
           "--save-result", "--result-dir", args.output_dir, "--result-filename", out_name]
    done = subprocess.run(cmd, env=_cpu_env(), timeout=args.phase_timeout, capture_output=True, text=True)
    print(done.stdout[-4000:], flush=True)
    if done.returncode != 0:
        raise RuntimeError(f"slipstream bench exited with {done.returncode}:\n{done.stderr[-3000:]}")
    with open(os.path.join(args.output_dir, out_name)) as f:
        result = json.load(f)
    return {"prompts": args.serving_prompts, "concurrency": args.serving_concurrency,
            "input_len": args.serving_input_len, "output_len": args.serving_output_len,
            "temperature": args.serving_temperature,
            "completed": result["completed"], "failed": result.get("failed", 0),
            "output_tok_s": result["output_throughput"], "ttft_p50_ms": result["median_ttft_ms"],
            "tpot_p50_ms": result["median_tpot_ms"], "duration_s": result["duration"]}


def traced_run(args: argparse.Namespace, uds: str, cache: str, log_path: str) -> dict:
    """The serving run again under benchmarks.bench.trace_server: the client's numbers and the server's
    medians of where each request's time to first token went (trace_server.ttft_parts)."""
    from benchmarks.bench.trace_server import ttft_parts

    traces = tuple(os.path.join(args.output_dir, f"trace-{kind}.jsonl") for kind in ("requests", "steps"))
    for path in traces:
        if os.path.exists(path):
            os.remove(path)
    proc, _ = start_server(args, uds, cache, log_path, traces)
    try:
        client = run_client(args, uds, "serving-bench-traced.json")
    finally:
        stop_server(proc)
    return {"client": client, "ttft_parts_ms": ttft_parts(*traces)}


def serving_phase(args: argparse.Namespace) -> None:
    if importlib.util.find_spec("aiohttp") is None:  # before a server start that costs minutes
        raise RuntimeError("the serving phase runs slipstream bench, which needs aiohttp (pip install -e '.[bench]')")
    # a short path: unix socket paths are limited to ~107 bytes
    work = tempfile.mkdtemp(prefix="slip-dev-")
    uds, cache = os.path.join(work, "serve.sock"), os.path.join(work, "jax-cache")
    log_path = os.path.join(args.output_dir, "serve.log")
    try:
        proc, cold = start_server(args, uds, cache, log_path)
        if "machine" not in read_results(results_path(args)):  # no in-process phase ran: the server's own line
            record(args, "machine", server_machine(args, log_path))
        startup = {"cold_s": cold}
        record(args, "startup", startup)
        try:
            if args.startup:
                startup["tokens"] = _greedy_completion(uds)
            record(args, "serving", run_client(args, uds))
        finally:
            stop_server(proc)
        if args.startup:
            proc, warm = start_server(args, uds, cache, log_path)
            try:
                same = _greedy_completion(uds) == startup["tokens"]
            finally:
                stop_server(proc)
            record(args, "startup", {**startup, "warm_s": warm, "warm_programs_loaded": _loaded_programs(log_path),
                                     "warm_answers_as_cold": same})
        if args.serving_trace:
            record(args, "serving_trace", traced_run(args, uds, cache, log_path))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    if os.path.exists(results_path(args)):
        os.remove(results_path(args))
    errors = {}
    if set(args.phases) - {"serving"}:
        try:
            done = subprocess.run([sys.executable, "-m", "benchmarks.device_phases", *argv],
                                  timeout=args.phase_timeout)
            if done.returncode != 0:
                errors["in-process"] = f"exited with {done.returncode}"
        except subprocess.TimeoutExpired:
            errors["in-process"] = f"cut after {args.phase_timeout:.0f} s"
    if "serving" in args.phases:
        try:
            serving_phase(args)
        except (RuntimeError, OSError, subprocess.TimeoutExpired, KeyError) as e:
            errors["serving"] = str(e)[-2000:]
    if errors:
        record(args, "errors", errors)
    print("\n" + markdown(read_results(results_path(args))), flush=True)
    print(f"\nwrote {results_path(args)} and device.md", flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
