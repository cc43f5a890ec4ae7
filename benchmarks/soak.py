"""Fault soak on loopback: a MockEngine server in a child process under mixed streaming and
non-streaming load with random client disconnects, a 10x flood, a slow reader, then SIGTERM
mid-stream. Bounded in request count and time. It asserts at the end that

- every request that was not cancelled completed with exactly the expected text;
- no slot or page leaked (running, waiting, slots and pages held back at 0);
- the server's RSS grew under 5% after warm-up;
- /metrics reconciles with the client's counts (successes, cancellations, 429s, no errors);
- SIGTERM drains: /ready answers 503 while the listener is open, streams finish, exit code 0.

    python -m benchmarks.soak                # about 10 minutes of load
    python -m benchmarks.soak --short        # ~20 s, what `make test` runs (tests/benchmarks/test_soak.py)

MockEngine continues a prompt byte by byte ("A" -> "BCD..."), so every text is known in advance.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import httpx

BOS, EOS = 256, 257


class ByteTokenizer:
    """ids 0..255 are UTF-8 bytes; 256 is BOS and 257 EOS (as the server tests use)."""

    vocab_size = 258
    eos_token_ids = frozenset({EOS})

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + list(text.encode())

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"


# ---- the server process ---------------------------------------------------------------------------


def serve(args: argparse.Namespace) -> int:
    from engine.mock_engine import MockEngine
    from engine.scheduler import Scheduler, SchedulerConfig
    from server.app import create_app, make_server
    from server.service import Service, ServiceConfig

    engine = MockEngine(vocab_size=ByteTokenizer.vocab_size, eos_token_ids=frozenset({EOS}), max_seq_len=128,
                        max_slots=args.max_slots, num_pages=256, step_sleep_s=args.step_sleep)
    # MockEngine logs every step for the tests that inspect it; over a long soak that log alone
    # would grow RSS without bound, so keep only its tail (the soak injects no failures).
    engine.step_log = collections.deque(maxlen=256)  # type: ignore[assignment]
    engine.events = collections.deque(maxlen=256)  # type: ignore[assignment]
    scheduler = Scheduler(engine, ByteTokenizer(), SchedulerConfig(max_queue=args.max_queue))
    service = Service(scheduler, engine, ByteTokenizer(), ServiceConfig(model_name="soak"))
    app = create_app(service, api_key=None)
    scheduler.start()
    server = make_server(app, "127.0.0.1", args.port, shutdown_timeout_s=args.shutdown_timeout, log_level="warning")

    # As `slipstream serve` does: uvicorn re-raises SIGTERM after its drain; that is a clean exit.
    def clean_exit(signum: int, frame: Any) -> None:
        sys.exit(1 if server.engine_failed else 0)

    signal.signal(signal.SIGTERM, clean_exit)
    server.run()
    return 1 if server.engine_failed else 0


# ---- the client side ----------------------------------------------------------------------------


def expected(prompt: str, max_tokens: int) -> str:
    return "".join(chr(ord(prompt[-1]) + 1 + i) for i in range(max_tokens))


@dataclasses.dataclass
class Counts:
    completed: int = 0        # sub-requests (choices) that finished, text checked
    disconnected: int = 0     # sub-requests of streams the client left before their end
    timed_out: int = 0        # sub-requests of non-streaming requests the client gave up on (the
                              # server may never have seen them, if the timeout hit while sending)
    rejected_429: int = 0
    wrong: list[str] = dataclasses.field(default_factory=list)
    latencies_429: list[float] = dataclasses.field(default_factory=list)
    latencies_ok: list[float] = dataclasses.field(default_factory=list)


def _body(rng: random.Random, stream: bool) -> dict[str, Any]:
    prompt = rng.choice("ABCDEFGHIJ") * rng.randint(1, 20)
    return {"prompt": prompt, "max_tokens": rng.randint(1, 30), "n": rng.choice([1, 1, 1, 2]), "stream": stream,
            "temperature": rng.choice([0.0, 0.7]), "seed": rng.randint(0, 1000)}


async def one_request(http: httpx.AsyncClient, rng: random.Random, counts: Counts, *, disconnect_p: float,
                      body: dict[str, Any] | None = None, slow_s: float = 0.0) -> None:
    stream = rng.random() < 0.6 if body is None else body["stream"]
    body = body or _body(rng, stream)
    n, want = body["n"], expected(body["prompt"], body["max_tokens"])
    leave = rng.random() < disconnect_p
    start = time.monotonic()
    try:
        if not stream:
            timeout = rng.uniform(0.001, 0.05) if leave else 30.0
            try:
                response = await http.post("/v1/completions", json=body, timeout=timeout)
            except httpx.TimeoutException:
                counts.timed_out += n  # the client closes the connection: the server cancels
                return
            if response.status_code == 429:
                counts.rejected_429 += 1
                counts.latencies_429.append(time.monotonic() - start)
                return
            texts = [c["text"] for c in response.json()["choices"]] if response.status_code == 200 else []
            if texts != [want] * n:
                counts.wrong.append(f"{response.status_code} {response.text[:200]}")
            else:
                counts.completed += n
                counts.latencies_ok.append(time.monotonic() - start)
            return
        async with http.stream("POST", "/v1/completions", json=body, timeout=30.0) as response:
            if response.status_code == 429:
                counts.rejected_429 += 1
                counts.latencies_429.append(time.monotonic() - start)
                return
            texts, done, events = [""] * n, [False] * n, 0
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    counts.wrong.append(f"error event {chunk}")
                    return
                for choice in chunk["choices"]:
                    texts[choice["index"]] += choice["text"]
                    done[choice["index"]] |= choice["finish_reason"] is not None
                events += 1
                if leave and events >= 1 and not all(done):
                    counts.disconnected += done.count(False)
                    counts.completed += done.count(True)  # a sibling that already finished
                    return  # leaving the block closes the connection mid-stream
                if slow_s:
                    await asyncio.sleep(slow_s)
            if texts != [want] * n or not all(done):
                counts.wrong.append(f"stream texts {texts} != {want!r}")
            else:
                counts.completed += n
                counts.latencies_ok.append(time.monotonic() - start)
    except httpx.HTTPError as exc:
        counts.wrong.append(f"{type(exc).__name__}: {exc}")


async def load(url: str, counts: Counts, *, seconds: float, max_requests: int, concurrency: int, seed: int,
               disconnect_p: float) -> int:
    """Closed-loop load: `concurrency` clients, each sending one request after another."""
    deadline, sent = time.monotonic() + seconds, 0
    async with httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=concurrency * 2)) as http:
        async def worker(k: int) -> None:
            nonlocal sent
            rng = random.Random(seed * 1000 + k)
            while time.monotonic() < deadline and sent < max_requests:
                sent += 1
                await one_request(http, rng, counts, disconnect_p=disconnect_p)

        await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return sent


async def flood(url: str, counts: Counts, *, rate: float, seconds: float, seed: int) -> int:
    """Open-loop arrivals at `rate` per second regardless of how the server keeps up."""
    rng, tasks = random.Random(seed), []
    async with httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=None)) as http:
        start = time.monotonic()
        for i in range(int(rate * seconds)):
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            body = _body(rng, stream=False) | {"n": 1}
            tasks.append(asyncio.ensure_future(one_request(http, rng, counts, disconnect_p=0.0, body=body)))
        await asyncio.gather(*tasks)
    return len(tasks)


def scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=5).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:  # summed over data-parallel replicas (the `replica` label)
            key = s.name + "".join(f"{{{v}}}" for k, v in s.labels.items() if k != "replica")
            out[key] = out.get(key, 0.0) + s.value
    return out


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def wait_idle(url: str, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        held = (m["slipstream_requests_running"], m["slipstream_requests_waiting"],
                m["jetstream_slots_used_percentage"], m["slipstream_kv_pages_used"])
        if held == (0, 0, 0, 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


async def sigterm_drain(url: str, proc: subprocess.Popen, *, streams: int, max_tokens: int) -> dict[str, Any]:
    """SIGTERM with `streams` streams in flight: /ready must say 503 while the listener is open."""
    rng, counts = random.Random(7), Counts()
    bodies = [{"prompt": "A", "max_tokens": max_tokens, "n": 1, "stream": True} for _ in range(streams)]
    timings: dict[str, float] = {}
    async with httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=None)) as http:
        tasks = [asyncio.ensure_future(one_request(http, rng, counts, disconnect_p=0.0, body=b)) for b in bodies]
        while scrape(url)["slipstream_requests_running"] < min(streams, 4):
            await asyncio.sleep(0.01)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        refused_new, closed = None, None
        async with httpx.AsyncClient(base_url=url) as probe:
            while closed is None:
                try:
                    status = (await probe.get("/ready", timeout=1)).status_code
                    if status == 503 and "ready_503" not in timings:
                        timings["ready_503"] = time.monotonic() - sent
                        r = await probe.post("/v1/completions", json={"prompt": "A", "max_tokens": 1})
                        refused_new = r.status_code
                except httpx.TransportError:
                    closed = time.monotonic() - sent
                await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        timings["streams_done"] = time.monotonic() - sent  # upper bound: gathered after the close
    code = proc.wait(timeout=30)
    timings["listener_closed"] = closed
    timings["exited"] = time.monotonic() - sent
    return {"timings": timings, "exit_code": code, "new_request_during_drain": refused_new,
            "streams_completed": counts.completed, "streams": streams, "wrong": counts.wrong}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "benchmarks.soak", "serve", "--port", str(port), "--max-slots", str(args.max_slots),
           "--max-queue", str(args.max_queue), "--step-sleep", str(args.step_sleep), "--shutdown-timeout", "20"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(cmd, cwd=root)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("soak server did not become ready within 60 s")


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
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command")
    srv = sub.add_parser("serve", help="(internal) the MockEngine server the soak drives")
    srv.add_argument("--port", type=int, required=True)
    for a in (p, srv):
        a.add_argument("--max-slots", type=int, default=4)
        a.add_argument("--max-queue", type=int, default=16)
        a.add_argument("--step-sleep", type=float, default=0.01, help="seconds per engine step")
    srv.add_argument("--shutdown-timeout", type=float, default=20)
    p.add_argument("--short", action="store_true", help="~20 s: what make test runs")
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
        args.duration, args.warmup, args.max_requests, args.flood_seconds = 6, 3, 2000, 2
    report = run(args)
    problems = check(report)
    print(json.dumps(report, indent=2))
    for problem in problems:
        print(f"soak: FAIL: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
