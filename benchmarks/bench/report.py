"""RESULTS.md for compare.py: the machine, the versions, the exact commands, a table and the plot."""
from __future__ import annotations

import os
import platform
import re
import subprocess
from typing import Any, Sequence

INTERESTING_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni",
                     "amx_tile", "amx_int8", "amx_bf16")


def machine() -> dict[str, str]:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    field = lambda name: (re.search(rf"^{name}:\s*(.+)$", lscpu, re.M) or [None, "?"])[1].strip()  # noqa: E731
    flags = field("Flags").split()
    with open("/proc/meminfo") as f:
        mem_kb = int(f.readline().split()[1])
    return {"cpu": field("Model name"), "cpus": field(r"CPU\(s\)"), "threads_per_core": field(r"Thread\(s\) per core"),
            "flags": " ".join(f for f in INTERESTING_FLAGS if f in flags) or "(none of the SIMD flags listed)",
            "memory": f"{mem_kb / 2**20:.0f} GiB", "kernel": platform.release()}


def _fmt(v: Any, digits: int = 1) -> str:
    return f"{v:.{digits}f}" if isinstance(v, (int, float)) else str(v)


def table(rows: Sequence[dict]) -> str:
    head = ("| server | conc. | prompts | req/s | output tok/s | total tok/s | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | "
            "TPOT p50 ms | ITL p99 ms | E2E p50 ms | failed |")
    lines = [head, "|---|" + "---:|" * 12]
    for r in rows:
        lines.append(f"| {r['server']} | {r['max_concurrency']} | {r['completed'] + r['failed']} | "
                     f"{_fmt(r['request_throughput'], 2)} | {_fmt(r['output_throughput'])} | "
                     f"{_fmt(r['total_token_throughput'])} | {_fmt(r['median_ttft_ms'])} | {_fmt(r.get('p90_ttft_ms', '-'))} | "
                     f"{_fmt(r['p99_ttft_ms'])} | "
                     f"{_fmt(r['median_tpot_ms'])} | {_fmt(r['p99_itl_ms'])} | {_fmt(r['median_e2el_ms'])} | "
                     f"{r['failed']} |")
    return "\n".join(lines)


def write(path: str, *, rows: Sequence[dict], servers: Sequence[dict], versions: dict[str, str],
          compare_command: str, bench_commands: Sequence[str], workload: str, plot_file: str | None,
          started: str, finished: str, notes: Sequence[str] = (), agreement: str | None = None) -> None:
    m = machine()
    out = [
        "# Serving comparison: Slipstream, llama.cpp server, vLLM CPU",
        "",
        f"Written by `benchmarks/compare.py` ({started} to {finished} UTC). Every number below comes from one "
        "run of the command under *Commands*; rerun it to reproduce. Client: `slipstream bench` "
        "(vLLM `bench serve` definitions: TTFT to the first streamed token, TPOT = (latency - TTFT) / "
        "(output tokens - 1), ITL between streamed chunks, E2E to the last token).",
        "",
        "## Machine",
        "",
        f"- CPU: {m['cpu']}, {m['cpus']} logical CPUs ({m['threads_per_core']} thread(s) per core), {m['memory']} RAM, "
        f"Linux {m['kernel']}",
        f"- SIMD flags: {m['flags']}",
        "",
        "## Versions",
        "",
        *[f"- {k}: {v}" for k, v in versions.items()],
        "",
        "## Workload",
        "",
        workload,
        "",
        "## Results",
        "",
        table(rows),
        "",
    ]
    if plot_file:
        out += [f"![output tok/s and TTFT against concurrency]({os.path.basename(plot_file)})", ""]
    out += ["## Servers", ""]
    out += [f"- **{s['name']}**: {s['description']}. Ready in {_fmt(s.get('ready_s', float('nan')), 0)} s.\n"
            f"  `{s['command']}`" for s in servers]
    out += ["", "## Commands", "", "```", compare_command, "```", "", "Each server, each concurrency:", "", "```",
            *bench_commands, "```", ""]
    if agreement:
        out += ["## Our client against `vllm bench serve`", "",
                "Same server, same workload shape, both clients in turn (`compare.py --check-vllm-bench`):", "",
                agreement.strip(), ""]
    if notes:
        out += ["## Notes", "", *[f"- {n}" for n in notes], ""]
    with open(path, "w") as f:
        f.write("\n".join(out))
