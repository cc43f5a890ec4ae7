"""`slipstream serve` with a per-request trace, to tell a client's timing from the server's.

    SLIPSTREAM_TRACE=/tmp/trace.jsonl python -m benchmarks.bench.trace_server serve --port 8000 ...

The server is the ordinary one; only its ASGI app is wrapped. For every completions request the wrapper
appends one JSON line: the x-request-id, the client's address (a reused connection keeps its port), and
time.perf_counter() stamps of when the app got the request, when its body was read, and when each response
chunk was written (`sends`; `first` and `last` of them). perf_counter is CLOCK_MONOTONIC on Linux, the clock both clients stamp
their requests with, so the lines join a client's --save-detailed results by request id. Diagnostics only:
not how Slipstream is served.

With SLIPSTREAM_TRACE_STEPS=FILE it also (or only, without SLIPSTREAM_TRACE) appends one JSON line per
planned step: when the planner was asked (perf_counter), its decodes, its prefill chunks (request id, start,
length, whether it samples) and the requests still waiting, so a request's TTFT can be split into the steps
it waited for; and one line per call of the scheduler's submit and the engine's launch and insert (time_calls). `python -m benchmarks.bench.trace_server steps FILE [FULL]` prints the steps' intervals by
kind (step_intervals): with FULL the batch size, the decode steps' p50 is the server's step time.

read_trace / join_trace / server_view read a trace back against a client's --save-detailed results.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from slipstream.engine.scheduler import StepEvent


class TraceRequests:
    """ASGI middleware: one JSON line per completions request (see the module docstring)."""

    def __init__(self, app, path: str) -> None:
        self.app = app
        self.file = open(path, "a", buffering=1, encoding="utf-8")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].endswith("completions"):
            return await self.app(scope, receive, send)
        rec = {"id": dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1"),
               "client": list(scope.get("client") or ()), "dispatch": time.perf_counter(),
               "body": None, "first": None, "last": None, "chunks": 0, "sends": []}

        async def traced_receive():
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body"):
                rec["body"] = time.perf_counter()
            return message

        async def traced_send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                now = time.perf_counter()
                if rec["first"] is None:
                    rec["first"] = now
                    body = message["body"]  # the first SSE event names the generation (the steps' request ids)
                    start = body.find(b'"id":"')
                    if start >= 0:
                        rec["gen_id"] = body[start + 6:body.find(b'"', start + 6)].decode("latin-1")
                rec["last"] = now
                rec["chunks"] += 1
                rec["sends"].append(now)
            await send(message)

        try:
            await self.app(scope, traced_receive, traced_send)
        finally:
            self.file.write(json.dumps(rec) + "\n")


def read_trace(path: Path, prefix: str) -> dict[str, dict]:
    """trace_server's lines for the requests whose x-request-id starts with prefix, by id."""
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec["id"].startswith(prefix):
            out[rec["id"]] = rec
    return out


def join_trace(res: dict, prefix: str, trace: dict[str, dict]) -> list[dict]:
    """Per request, where its TTFT went (ms): `deliver` from the client's send to the server's app getting it,
    `server` from there to the server writing the first chunk, `receive` from that write to the client
    seeing it; the three add up to the client's TTFT. `conn` is the client's port (reused with keep-alive)."""
    rows = []
    for i, (start, ttft, ok) in enumerate(zip(res["start_times"], res["ttfts"], [not e for e in res["errors"]])):
        rec = trace.get(f"{prefix}{i}")
        if not ok or rec is None or rec["first"] is None:
            continue
        # the token chunks the server wrote (the usage chunk and [DONE] follow them)
        sends = rec["sends"][:res["output_lens"][i]]
        rows.append({"i": i, "start": start, "ttft_ms": 1000 * ttft, "deliver_ms": 1000 * (rec["dispatch"] - start),
                     "read_ms": 1000 * (rec["body"] - rec["dispatch"]) if rec["body"] else float("nan"),
                     "server_ms": 1000 * (rec["first"] - rec["dispatch"]),
                     "receive_ms": 1000 * (start + ttft - rec["first"]), "conn": rec["client"][1] if rec["client"] else 0,
                     "server_itl_ms": [1000 * (b - a) for a, b in zip(sends, sends[1:])]})
    return rows


def server_view(joined: list[dict], client: dict) -> dict[str, float]:
    """The same statistics from the server's own stamps (TTFT from the app getting the request to its first chunk
    written, ITL between chunks written), and what the client's numbers add to them. A client that times
    correctly adds only its transport (connect, send, receive), whatever the server did in that run."""
    if not joined:
        return {}
    ttft = np.array([j["server_ms"] for j in joined])
    itl = np.array([g for j in joined for g in j["server_itl_ms"]] or [float("nan")])
    out = {"server_median_ttft_ms": float(np.median(ttft)), "server_p99_ttft_ms": float(np.percentile(ttft, 99)),
           "server_median_itl_ms": float(np.median(itl)), "server_p99_itl_ms": float(np.percentile(itl, 99))}
    for k in list(out):
        out["client_minus_" + k] = client[k.removeprefix("server_")] - out[k]
    return out


def step_writer(path: str) -> Callable[[StepEvent], None]:
    """A scheduler step listener appending one JSON line per planned step (see the module docstring)."""
    out = open(path, "a", buffering=1, encoding="utf-8")

    def write(event: StepEvent) -> None:
        chunks = [c for c in event.plan.chunks if c.length > 1 or c.start < c.seq.prefill_end]
        out.write(json.dumps({
            "t": event.planned_at, "decodes": len(event.plan.chunks) - len(chunks), "running": event.running,
            "prefill": [[c.seq.request_id, c.start, c.length, c.sample] for c in chunks],
            "waiting": list(event.waiting)}) + "\n")

    return write


def time_calls(path: str, obj, names: tuple[str, ...]) -> None:
    """Wrap obj's methods `names` to append one JSON line per call to `path`: {"call": name, "t0", "t1"
    (perf_counter at entry and return), "id": the request id where the first argument has one}. The
    scheduler's submit and the engine's launch and insert, so a lone request's time before its prefill
    step is planned splits into the submit, the engine thread's admission, and the step's launch."""
    out = open(path, "a", buffering=1, encoding="utf-8")
    for name in names:
        fn = getattr(obj, name)

        def timed(*args, _fn=fn, _name=name, **kwargs):
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                rid = getattr(args[0], "request_id", None) if args else None
                out.write(json.dumps({"call": _name, "t0": t0, "t1": time.perf_counter(), "id": rid}) + "\n")

        setattr(obj, name, timed)


def step_intervals(path: str, full: int) -> dict[str, dict[str, float]]:
    """A step trace's time from each plan to the next, by kind of step: "decode, full" (decodes only, at
    least `full` of them: a busy server's steady state), "decode" (fewer) and "prefill" (with a chunk).
    Per kind: steps, p10/p50/p90 ms and the seconds they took. At steady state the decodes' interval
    is the server's step time, the engine's device time plus whatever host work it waits for."""
    lines = [line for line in map(json.loads, Path(path).read_text().splitlines()) if "prefill" in line]
    kinds: dict[str, list[float]] = {"decode, full": [], "decode": [], "prefill": []}
    for line, after in zip(lines, lines[1:]):
        kind = "prefill" if line["prefill"] else "decode, full" if line["decodes"] >= full else "decode"
        kinds[kind].append((after["t"] - line["t"]) * 1e3)
    return {kind: {"steps": len(ms), "p10_ms": float(np.percentile(ms, 10)), "p50_ms": float(np.median(ms)),
                   "p90_ms": float(np.percentile(ms, 90)), "seconds": sum(ms) / 1e3}
            for kind, ms in kinds.items() if ms}


TTFT_PARTS = ("read", "to_submit", "submit", "to_plan", "to_launch", "launch", "to_first_chunk", "server_ttft")
SUBMIT_PARTS = ("to_start", "to_encode", "encode", "encoded_to_submit")  # to_submit's, in order


def ttft_parts(requests_path: str, steps_path: str) -> dict[str, float]:
    """Where each request's server-side time to first token went (ms, medians over the requests both traces
    hold; `requests` counts them): `read` the body, `to_submit` from the body to the scheduler's submit
    (parsing, validation, tokenizing, the hop off the event loop), `submit` the call, `to_plan` from its return to
    the planner being asked for the step that samples the request's first token (the engine thread waking,
    admitting, earlier steps), `to_launch` from there to that step's launch, `launch` the call (host arrays,
    dispatch), `to_first_chunk` from its return to the first chunk written (the device's step, the copy back,
    detokenizing, the event loop's write); `server_ttft` their sum. For a lone request at a time. Where the
    steps' trace has the service's start and encode calls (trace_server stamps them), to_submit also in
    SUBMIT_PARTS: `to_start` from the body to the endpoint's call of start (the app's parsing, validation),
    `to_encode` from there to the tokenizer's call (the hop to a worker thread, checks), `encode`, and
    `encoded_to_submit`."""
    calls: dict[str, list[dict]] = {"submit": [], "launch": []}
    plans: list[dict] = []
    for line in map(json.loads, Path(steps_path).read_text().splitlines()):
        if "call" in line:
            calls.setdefault(line["call"], []).append(line)
        else:
            plans.append(line)
    submits = {c["id"]: c for c in calls["submit"]}  # the scheduler's ids: the generation's, "-" and the choice
    launches = sorted(calls["launch"], key=lambda c: c["t0"])
    parts: dict[str, list[float]] = {k: [] for k in TTFT_PARTS}
    for rec in map(json.loads, Path(requests_path).read_text().splitlines()):
        rid = f"{rec.get('gen_id')}-0"
        sub = submits.get(rid)
        plan = next((p for p in plans if any(c[0] == rid and c[3] for c in p["prefill"])), None)
        if sub is None or plan is None or rec["first"] is None or rec["body"] is None:
            continue
        launch = next((c for c in launches if c["t0"] >= plan["t"]), None)
        if launch is None:
            continue
        stamps = [rec["dispatch"], rec["body"], sub["t0"], sub["t1"], plan["t"], launch["t0"], launch["t1"],
                  rec["first"]]
        for name, a, b in zip(TTFT_PARTS, stamps, stamps[1:]):
            parts[name].append(1e3 * (b - a))
        parts["server_ttft"].append(1e3 * (rec["first"] - rec["dispatch"]))
        # to_submit in parts, where the service's start (the endpoint's call) and encode are stamped too
        start = next((c for c in reversed(calls.get("start", [])) if rec["body"] <= c["t0"] <= sub["t0"]), None)
        encode = next((c for c in reversed(calls.get("encode", []))
                       if start is not None and start["t0"] <= c["t0"] <= sub["t0"]), None)
        if encode is not None:
            fine = [rec["body"], start["t0"], encode["t0"], encode["t1"], sub["t0"]]
            for name, a, b in zip(SUBMIT_PARTS, fine, fine[1:]):
                parts.setdefault(name, []).append(1e3 * (b - a))
    out = {k: float(np.median(v)) for k, v in parts.items() if v}
    out["requests"] = len(parts["server_ttft"])
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["steps"]:  # python -m benchmarks.bench.trace_server steps FILE [FULL]
        for kind, row in step_intervals(argv[1], int(argv[2]) if len(argv) > 2 else 1).items():
            print(f"{kind}: {row['steps']} steps, plan to plan p50 {row['p50_ms']:.2f} ms (p10 {row['p10_ms']:.2f}, "
                  f"p90 {row['p90_ms']:.2f}), {row['seconds']:.2f} s")
        return 0
    import slipstream.server.app
    from slipstream.server import cli

    path = os.environ.get("SLIPSTREAM_TRACE")
    steps = os.environ.get("SLIPSTREAM_TRACE_STEPS")
    if not path and not steps:
        print("trace_server: set SLIPSTREAM_TRACE (requests) and/or SLIPSTREAM_TRACE_STEPS (steps) to the JSONL "
              "files to append to", file=sys.stderr)
        return 2
    create_app = slipstream.server.app.create_app

    def traced_create_app(service, *args, **kwargs):
        app = create_app(service, *args, **kwargs)
        if path:  # a wrapper around every response chunk: leave it out to time the steps alone
            app.add_middleware(TraceRequests, path=path)
        if steps:
            for scheduler in service.scheduler.replicas:
                scheduler.add_step_listener(step_writer(steps))
                time_calls(steps, scheduler, ("submit",))
                time_calls(steps, scheduler._engine, ("launch", "insert"))
            time_calls(steps, service, ("start", "encode"))  # start: its t0 is the endpoint's call
        return app

    slipstream.server.app.create_app = traced_create_app  # cmd_serve imports it from slipstream.server.app when it runs
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
