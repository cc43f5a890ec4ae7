"""bench_agreement's report: the per-run table of both clients' numbers, their means and differences, the same
over the undisturbed rounds alone, and the paired comparison against the server's own stamps."""
from __future__ import annotations

import subprocess

import numpy as np

KEYS = [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "p99")] + [
    "output_throughput", "request_throughput"]


def table(runs: list[dict], c: int, n: int, args) -> str:
    paired = [k for k in ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms") if f"server_{k}" in runs[0]]
    keys = KEYS + ["client_cpu_s", "server_cpu_s", "other_cpu_share", "server_prompt_tokens", "server_prefilled_tokens",
                   "prefix_hit_tokens", "server_mean_ttft_ms", "server_mean_queue_ms", "client_minus_server_mean_ttft_ms",
                   "median_deliver_ms", "median_read_ms", "median_receive_ms", "connections"]
    keys += [f"server_{k}" for k in paired] + [f"client_minus_server_{k}" for k in paired]
    keys = [k for k in keys if all(k in r for r in runs)]  # --simultaneous records no per-run CPU or scrape
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_line = next((" ".join(line.split()) for line in cpu.splitlines() if line.startswith("Model name")), "?")
    rate = float(args.request_rate) / (2 if args.simultaneous else 1)
    arrivals = "all at once" if rate == float("inf") else f"{rate:g} requests/s each (burstiness {args.burstiness})"
    lines = [f"One Slipstream server (`{args.server_args}`), concurrency {c}, arrivals {arrivals}, {n} prompts of {args.input_len} in / "
             f"{args.output_len} out (ignore_eos, greedy), {args.num_warmups} warm-ups, {args.rounds} rounds "
             f"(ours first in even rounds), after an unmeasured settling run of {args.settle_prompts or n} prompts"
             f"{'; both clients at once, each with half the concurrency and prompts' if args.simultaneous else ''}"
             f"{', both clients sending prompts from our generator' if args.same_prompts else ''}"
             f"{' (the same prompts at the same moments in both runs of a round: an A/A run)' if args.identical else ''}"
             f". {model_line}", "",
             "| metric | " + " | ".join(r["label"] for r in runs) + " | ours (mean) | vllm (mean) | difference |",
             "|---|" + "---:|" * (len(runs) + 3)]
    for k in keys:
        mine = [r[k] for r in runs if r["who"] == "ours"]
        theirs = [r[k] for r in runs if r["who"] == "vllm"]
        a, b = sum(mine) / len(mine), sum(theirs) / len(theirs)
        if k.startswith("client_minus_"):
            diff = f"{a - b:+.2f} ms"  # small differences of two small numbers: in ms, not %
        else:
            diff = f"{100 * (a - b) / b:+.1f}%" if b else "-"
        lines.append(f"| {k} | " + " | ".join(f"{r[k]:.2f}" for r in runs) + f" | {a:.2f} | {b:.2f} | {diff} |")
    if "other_cpu_share" in keys:
        lines += undisturbed(runs, args.max_other_cpu)
    if paired:
        lines += ["", "Paired, each run against the server's own numbers for it: what ours adds to a statistic less what "
                  "vLLM's adds, as a share of the statistic (the server's, averaged over all runs). Differences between "
                  "runs of the server cancel here; they do not in the table's raw columns.", "",
                  "| statistic | ours adds (ms) | vLLM adds (ms) | difference, % of the statistic |", "|---|---:|---:|---:|"]
        for k in paired:
            mine = np.mean([r[f"client_minus_server_{k}"] for r in runs if r["who"] == "ours"])
            theirs = np.mean([r[f"client_minus_server_{k}"] for r in runs if r["who"] == "vllm"])
            level = np.mean([r[f"server_{k}"] for r in runs])
            lines.append(f"| {k} | {mine:+.2f} | {theirs:+.2f} | {100 * (mine - theirs) / level:+.2f}% |")
    return "\n".join(lines)


def undisturbed(runs: list[dict], limit: float) -> list[str]:
    """The raw comparison over the rounds where nothing else on the machine took more than `limit` of its CPU time
    in either run (decided per round, so both clients keep the same number of runs)."""
    rounds = sorted({r["round"] for r in runs})
    kept = [k for k in rounds if all(r["other_cpu_share"] <= limit for r in runs if r["round"] == k)]
    lines = ["", f"Undisturbed rounds (other processes at most {100 * limit:g}% of the machine's CPU time in both runs): "
             f"{len(kept)} of {len(rounds)} ({', '.join(map(str, kept)) or 'none'})."]
    if not kept:
        return lines
    lines += ["", "| metric | ours (mean) | vllm (mean) | difference |", "|---|---:|---:|---:|"]
    for k in KEYS:
        a = np.mean([r[k] for r in runs if r["who"] == "ours" and r["round"] in kept])
        b = np.mean([r[k] for r in runs if r["who"] == "vllm" and r["round"] in kept])
        lines.append(f"| {k} | {a:.2f} | {b:.2f} | {100 * (a - b) / b:+.1f}% |")
    return lines
