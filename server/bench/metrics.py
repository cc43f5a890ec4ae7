"""Per-request timings -> the numbers and JSON keys of `vllm bench serve` (calculate_metrics), and its table.

TPOT = (latency - TTFT) / (output tokens - 1), over requests with more than one output token; ITL pools
the gaps between streamed chunks of all requests; goodput counts requests within every SLO given.
"""
from __future__ import annotations

import collections
from typing import Any, Callable, Sequence

import numpy as np

from slipstream.server.bench.client import RequestOutput

METRICS = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
           "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}


def parse_goodput(pairs: Sequence[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs or []:
        name, _, value = pair.partition(":")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput takes KEY:VALUE pairs in milliseconds, got {pair!r}") from None
        if name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput metric must be one of ttft, tpot, e2el, got {name!r}")
        if slos[name] < 0:
            raise ValueError(f"--goodput {name} must be non-negative, got {value}")
    return slos


def _word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def calculate(outputs: Sequence[RequestOutput], duration_s: float, *, count_tokens: Callable[[str], int],
              percentiles: Sequence[float], metrics: Sequence[str], goodput: dict[str, float]) -> dict[str, Any]:
    """The result dict: totals, throughputs, then mean/median/std/pN of each selected metric in ms."""
    output_lens, ttfts, tpots, all_tpots, itls, e2els = [], [], [], [], [], []
    total_input = completed = 0
    for o in outputs:
        if not o.success:
            output_lens.append(0)
            continue
        n = o.output_tokens or count_tokens(o.generated_text)
        output_lens.append(n)
        total_input += o.prompt_len
        tpot = 0.0
        if n > 1:
            tpot = (o.latency - o.ttft) / (n - 1)
            tpots.append(tpot)
        all_tpots.append(tpot)  # a 1-token request meets any TPOT SLO, as in vLLM
        itls += o.itl
        ttfts.append(o.ttft)
        e2els.append(o.latency)
        completed += 1
    good = 0
    if goodput:
        per_metric = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        for i in range(completed):
            good += all(per_metric[name][i] <= slo / 1000 for name, slo in goodput.items())
    total_output = sum(output_lens)
    failures = collections.Counter(o.error for o in outputs if not o.success)
    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": completed,
        "failed": len(outputs) - completed,
        "failure_reasons": dict(failures.most_common()),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration_s,
        "request_goodput": good / duration_s if goodput else None,
        "input_throughput": total_input / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    values = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    for name in metrics:
        if name not in values:
            raise ValueError(f"--percentile-metrics takes ttft, tpot, itl, e2el; got {name!r}")
        v = np.asarray(values[name] or [0.0]) * 1000
        result[f"mean_{name}_ms"] = float(np.mean(v))
        result[f"median_{name}_ms"] = float(np.median(v))
        result[f"std_{name}_ms"] = float(np.std(v))
        for p in percentiles:
            result[f"p{_word(p)}_{name}_ms"] = float(np.percentile(v, p))
    result.update({
        "request_ids": [o.request_id for o in outputs],
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": output_lens,
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs],
        "start_times": [o.start_time for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
    })
    return result


def format_table(result: dict[str, Any], *, metrics: Sequence[str], percentiles: Sequence[float],
                 max_concurrency: int | None, request_rate: float) -> str:
    row = "{:<40} {:<10}".format
    num = lambda label, value: "{:<40} {:<10.2f}".format(label, value)  # noqa: E731
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
             row("Successful requests:", result["completed"]), row("Failed requests:", result["failed"])]
    if max_concurrency is not None:
        lines.append(row("Maximum request concurrency:", max_concurrency))
    if request_rate != float("inf"):
        lines.append(num("Request rate configured (RPS):", request_rate))
    lines += [num("Benchmark duration (s):", result["duration"]),
              row("Total input tokens:", result["total_input_tokens"]),
              row("Total generated tokens:", result["total_output_tokens"]),
              num("Request throughput (req/s):", result["request_throughput"])]
    if result["request_goodput"] is not None:
        lines.append(num("Request goodput (req/s):", result["request_goodput"]))
    lines += [num("Input token throughput (tok/s):", result["input_throughput"]),
              num("Output token throughput (tok/s):", result["output_throughput"]),
              num("Total token throughput (tok/s):", result["total_token_throughput"])]
    for name in metrics:
        short, header = METRICS[name]
        lines += ["{s:{c}^{n}}".format(s=header, n=50, c="-"),
                  num(f"Mean {short} (ms):", result[f"mean_{name}_ms"]),
                  num(f"Median {short} (ms):", result[f"median_{name}_ms"])]
        lines += [num(f"P{_word(p)} {short} (ms):", result[f"p{_word(p)}_{name}_ms"]) for p in percentiles]
    if result["failure_reasons"]:
        lines.append("{s:{c}^{n}}".format(s="Failures", n=50, c="-"))
        lines += [f"{count:>5} x {reason}" for reason, count in result["failure_reasons"].items()]
    lines.append("=" * 50)
    return "\n".join(lines)
