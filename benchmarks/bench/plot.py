"""PNG for RESULTS.md: output tok/s and TTFT p50/p99 against concurrency, one line per server.

Run by compare.py with a Python that has matplotlib (`python plot.py summary.json out.png`); it imports
nothing else from this repository.
"""
from __future__ import annotations

import json
import sys


def plot(rows: list[dict], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    servers = list(dict.fromkeys(r["server"] for r in rows))
    fig, (ax_tput, ax_ttft) = plt.subplots(1, 2, figsize=(12, 4.8))
    for i, server in enumerate(servers):
        pts = sorted((r for r in rows if r["server"] == server), key=lambda r: r["max_concurrency"])
        xs = [r["max_concurrency"] for r in pts]
        color = f"C{i}"
        ax_tput.plot(xs, [r["output_throughput"] for r in pts], "o-", color=color, label=server)
        ax_ttft.plot(xs, [r["median_ttft_ms"] for r in pts], "o-", color=color, label=f"{server} p50")
        ax_ttft.plot(xs, [r["p99_ttft_ms"] for r in pts], "x--", color=color, label=f"{server} p99")
    for ax in (ax_tput, ax_ttft):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.grid(True, which="both", alpha=0.3)
        ticks = sorted({r["max_concurrency"] for r in rows})
        ax.set_xticks(ticks, [str(t) for t in ticks])
    ax_tput.set_ylabel("output tokens/s")
    ax_tput.set_title("Output throughput")
    ax_tput.legend(fontsize=8)
    ax_ttft.set_yscale("log")
    ax_ttft.set_ylabel("TTFT (ms)")
    ax_ttft.set_title("Time to first token (solid p50, dashed p99)")
    ax_ttft.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        plot(json.load(f), sys.argv[2])
