"""The soak's clients: requests whose every text is known in advance (MockEngine continues a prompt
byte by byte), sent closed-loop, as an open-loop flood, or as streams in flight through a SIGTERM;
each outcome is tallied in Counts. What must hold afterwards is tests/soak/soak.py's check().
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import signal
import subprocess
import time
from typing import Any

import httpx

from tests.soak.soak_server import scrape


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
