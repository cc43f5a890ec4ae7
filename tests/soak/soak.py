"""Fault soak on loopback: a MockEngine server in a child process under mixed streaming and
non-streaming load with random client disconnects, a 10x flood, a slow reader, then SIGTERM
mid-stream. Bounded in request count and time. It asserts at the end that

- every request that was not cancelled completed with exactly the expected text;
- no slot or page leaked (running, waiting, slots and pages held back at 0);
- the server's RSS grew under 5% after warm-up;
- /metrics reconciles with the client's counts (successes, cancellations, 429s, no errors);
- SIGTERM drains: /ready answers 503 while the listener is open, streams finish, exit code 0.

    python -m tests.soak.soak                # about 10 minutes of load
    python -m tests.soak.soak --short        # ~15 s, what `make test` runs (tests/server/test_soak.py)

MockEngine continues a prompt byte by byte ("A" -> "BCD..."), so every text is known in advance.
The server side is tests/soak/soak_server.py, the clients tests/soak/soak_traffic.py; this file runs
the phases and checks the outcome.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from typing import Any

import httpx

from tests.soak.soak_server import rss_bytes, serve, start_server, wait_idle
from tests.soak.soak_traffic import Counts, flood, load, one_request, sigterm_drain


def run(args: argparse.Namespace) -> dict[str, Any]:
    proc, url = start_server(args)
    report: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items() if k != "command"}}
    try:
        counts = Counts()
        began = time.monotonic()
        # Warm-up: the same mix, then a short flood, so the peak of connections and buffers the
        # measured phases reach is already allocated when the RSS baseline is taken.
        t0 = time.monotonic()
        asyncio.run(load(url, counts, seconds=args.warmup, max_requests=10**9, concurrency=args.concurrency,
                         seed=1, disconnect_p=args.disconnect_p))
        warm_rate = args.flood_factor * len(counts.latencies_ok) / (time.monotonic() - t0)
        asyncio.run(flood(url, counts, rate=warm_rate, seconds=min(2.0, args.flood_seconds), seed=11))
        wait_idle(url)
        rss_warm = rss_bytes(proc.pid)
        counts.latencies_ok.clear()
        t0 = time.monotonic()
        sent = asyncio.run(load(url, counts, seconds=args.duration, max_requests=args.max_requests,
                                concurrency=args.concurrency, seed=2, disconnect_p=args.disconnect_p))
        load_s = time.monotonic() - t0
        done_before = counts.completed
        capacity = len(counts.latencies_ok) / load_s  # requests/s completed at saturation (closed loop)
        flood_rate = args.flood_factor * capacity
        counts.latencies_429.clear()
        flooded = asyncio.run(flood(url, counts, rate=flood_rate, seconds=args.flood_seconds, seed=3))
        # a slow reader beside normal traffic: it must neither stall the others nor lose text
        slow = Counts()

        async def slow_and_normal() -> None:
            async with httpx.AsyncClient(base_url=url) as http:
                reader = one_request(http, random.Random(4), slow, disconnect_p=0.0, slow_s=0.05,
                                     body={"prompt": "A", "max_tokens": 60, "n": 1, "stream": True})
                await asyncio.gather(reader, load(url, counts, seconds=1.0, max_requests=50, concurrency=2, seed=5,
                                                  disconnect_p=0.0))

        asyncio.run(slow_and_normal())
        counts.completed += slow.completed
        counts.wrong += slow.wrong
        metrics = wait_idle(url)
        rss_end = rss_bytes(proc.pid)
        total_s = time.monotonic() - began
        report.update({
            "requests_sent_under_load": sent, "load_seconds": round(load_s, 1), "total_seconds": round(total_s, 1),
            "completed_choices": counts.completed, "disconnected_choices": counts.disconnected,
            "timed_out_choices": counts.timed_out,
            "wrong": counts.wrong[:5], "wrong_count": len(counts.wrong),
            "capacity_rps": round(capacity, 1), "flood_rate_rps": round(flood_rate, 1), "flood_requests": flooded,
            "flood_429": len(counts.latencies_429),
            "latency_429_ms": _percentiles(counts.latencies_429),
            "rejected_429_total": counts.rejected_429, "slow_reader_completed": slow.completed == 1,
            "rss_warm_mb": round(rss_warm / 2**20, 1), "rss_end_mb": round(rss_end / 2**20, 1),
            "rss_growth_pct": round(100 * (rss_end - rss_warm) / rss_warm, 2),
            "leaks": {k: metrics[k] for k in ("slipstream_requests_running", "slipstream_requests_waiting",
                                              "jetstream_slots_used_percentage", "slipstream_kv_pages_used")},
            "metrics": {k: metrics[k] for k in ("jetstream_request_success_count_total",
                                                "slipstream_cancellations_total", "slipstream_request_errors_total",
                                                "slipstream_rejections_total{overloaded}")},
            "completed_under_load": done_before,
        })
        report["sigterm"] = asyncio.run(sigterm_drain(url, proc, streams=args.drain_streams, max_tokens=40))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return report


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    pick = lambda q: round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)  # noqa: E731
    return {"p50": pick(0.5), "p99": pick(0.99), "max": pick(1.0)}


def check(report: dict[str, Any]) -> list[str]:
    """What must hold; an empty list means the soak passed."""
    problems = []
    m, sig = report["metrics"], report["sigterm"]
    if report["wrong_count"]:
        problems.append(f"{report['wrong_count']} requests came back wrong: {report['wrong']}")
    if any(report["leaks"].values()):
        problems.append(f"slots or pages held after the load: {report['leaks']}")
    if report["rss_growth_pct"] >= 5:
        problems.append(f"RSS grew {report['rss_growth_pct']}% after warm-up")
    success, cancelled = m["jetstream_request_success_count_total"], m["slipstream_cancellations_total"]
    # A choice the client left may still have finished first: it then counts as a success.
    known = report["completed_choices"] + report["disconnected_choices"]
    if not (success >= report["completed_choices"] and known <= success + cancelled <= known
            + report["timed_out_choices"]):
        problems.append(f"metrics do not reconcile: success={success} cancelled={cancelled}, client saw "
                        f"{report['completed_choices']} completed, {report['disconnected_choices']} disconnected "
                        f"and {report['timed_out_choices']} timed out")
    if m["slipstream_request_errors_total"]:
        problems.append(f"{m['slipstream_request_errors_total']} requests ended with an error")
    if m["slipstream_rejections_total{overloaded}"] != report["rejected_429_total"]:
        problems.append(f"429s: server counted {m['slipstream_rejections_total{overloaded}']}, client "
                        f"{report['rejected_429_total']}")
    if report["flood_429"] == 0:
        problems.append("the flood never reached the queue limit (no 429): it tested nothing")
    if not report["slow_reader_completed"]:
        problems.append("the slow reader did not get its whole text")
    t = sig["timings"]
    if sig["exit_code"] != 0 or sig["wrong"] or sig["streams_completed"] != sig["streams"]:
        problems.append(f"SIGTERM drain: {sig}")
    if "ready_503" not in t or t["listener_closed"] is None or t["ready_503"] >= t["listener_closed"]:
        problems.append(f"/ready did not answer 503 before the listener closed: {t}")
    if sig["new_request_during_drain"] != 503:
        problems.append(f"a new request during the drain got {sig['new_request_during_drain']}, not 503")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.soak.soak", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command")
    srv = sub.add_parser("serve", help="(internal) the MockEngine server the soak drives")
    srv.add_argument("--port", type=int, required=True)
    for a in (p, srv):
        a.add_argument("--max-slots", type=int, default=4)
        a.add_argument("--max-queue", type=int, default=16)
        a.add_argument("--step-sleep", type=float, default=0.01, help="seconds per engine step")
    srv.add_argument("--shutdown-timeout", type=float, default=20)
    p.add_argument("--short", action="store_true", help="~15 s: what make test runs")
    p.add_argument("--duration", type=float, default=600, help="seconds of mixed load")
    p.add_argument("--warmup", type=float, default=30)
    p.add_argument("--max-requests", type=int, default=200_000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--disconnect-p", type=float, default=0.15)
    p.add_argument("--flood-factor", type=float, default=10)
    p.add_argument("--flood-seconds", type=float, default=10)
    p.add_argument("--drain-streams", type=int, default=6)
    args = p.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.short:
        # 3 s of mixed load (~75 requests, ~15 clients gone mid-stream; ~250 choices completed with the warm-up)
        # and a 1 s flood (~150 429s): every check still has cases to hold
        args.duration, args.warmup, args.max_requests, args.flood_seconds = 3, 3, 2000, 1
    report = run(args)
    problems = check(report)
    print(json.dumps(report, indent=2))
    for problem in problems:
        print(f"soak: FAIL: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
