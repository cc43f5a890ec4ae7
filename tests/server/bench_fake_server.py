"""An OpenAI-style streaming server on a fixed schedule: every request gets its first token TTFT seconds
after it arrives, then one token every ITL seconds, whatever the load. It records when it wrote each
token chunk (perf_counter is CLOCK_MONOTONIC, shared with the client's process), so a test can compare
the client's numbers with what the server really did as well as with the schedule."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route


@dataclass
class Schedule:
    ttft_s: float = 0.2
    itl_s: float = 0.05
    usage_style: str = "separate"  # "separate": a final choices=[] chunk (vLLM); "last": on the last choice chunk (llama.cpp)
    fail_every: int = 0             # every n-th request (1-based) answers 503 instead of streaming
    role_chunk_first: bool = True   # chat: an immediate {"role": "assistant"} chunk, before any token
    cached_ttft_s: float | None = None  # a prefix cache: a prompt seen before (since configure) gets this TTFT


@dataclass
class Stats:
    received: int = 0
    active: int = 0
    peak_active: int = 0
    prompt_tokens: list[int] = field(default_factory=list)
    max_tokens: list[int] = field(default_factory=list)
    bodies: list[dict] = field(default_factory=list)
    sent: dict[str, list[float]] = field(default_factory=dict)  # x-request-id -> perf_counter of each token chunk
    cache_hits: int = 0  # requests whose prompt was seen before (Schedule.cached_ttft_s)
    ports: list[int] = field(default_factory=list)  # the client's port of each request: one per connection


def build_app(state: dict, count_tokens) -> Starlette:
    async def configure(request: Request):
        state["schedule"], state["stats"] = Schedule(**await request.json()), Stats()
        state["seen_prompts"] = set()
        return JSONResponse({})

    async def read_stats(_: Request):
        return JSONResponse(dataclasses.asdict(state["stats"]))

    async def models(_: Request):
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def generate(request: Request):
        arrived = time.perf_counter()
        schedule, stats = state["schedule"], state["stats"]
        body = await request.json()
        stats.received += 1
        stats.bodies.append(body)
        stats.ports.append(request.client.port)
        if schedule.fail_every and stats.received % schedule.fail_every == 0:
            return PlainTextResponse("overloaded", status_code=503)
        chat = request.url.path.endswith("chat/completions")
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        n = body.get("max_completion_tokens") if chat else body.get("max_tokens")
        prompt_tokens = count_tokens(prompt)
        ttft_s = schedule.ttft_s
        if schedule.cached_ttft_s is not None:
            if prompt in state["seen_prompts"]:
                stats.cache_hits += 1
                ttft_s = schedule.cached_ttft_s
            state["seen_prompts"].add(prompt)
        stats.prompt_tokens.append(prompt_tokens)
        stats.max_tokens.append(n)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}

        def chunk(i: int | None, *, final: bool = False, with_usage: bool = False) -> bytes:
            if i is None:
                choices = []
            elif chat:
                delta = {"role": "assistant", "content": ""} if i < 0 else {"content": f" w{i}"}
                choices = [{"index": 0, "delta": delta, "finish_reason": "length" if final else None}]
            else:
                choices = [{"index": 0, "text": f" w{i}", "finish_reason": "length" if final else None}]
            data = {"id": "x", "object": "chunk", "choices": choices}
            if with_usage:
                data["usage"] = usage
            return b"data: " + json.dumps(data).encode() + b"\n\n"

        sent = stats.sent.setdefault(request.headers.get("x-request-id", str(stats.received)), [])

        async def events():
            stats.active += 1
            stats.peak_active = max(stats.peak_active, stats.active)
            try:
                if chat and schedule.role_chunk_first:
                    yield chunk(-1)
                for i in range(n):
                    # absolute deadlines, so one late wake-up does not shift every later token; and never
                    # before them: uvicorn's uvloop timers have millisecond ticks and fire up to ~1 ms early
                    # (a measured TTFT of 0.29988 s against a 0.3 s schedule)
                    deadline = arrived + ttft_s + i * schedule.itl_s
                    while (left := deadline - time.perf_counter()) > 0:
                        await asyncio.sleep(left)
                    last = i == n - 1
                    sent.append(time.perf_counter())
                    yield chunk(i, final=last, with_usage=last and schedule.usage_style == "last")
                if schedule.usage_style == "separate" and body.get("stream_options", {}).get("include_usage"):
                    yield chunk(None, with_usage=True)
                yield b"data: [DONE]\n\n"
            finally:
                stats.active -= 1

        headers = {"connection": "close"} if schedule.usage_style == "last" else {}
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    return Starlette(routes=[Route("/configure", configure, methods=["POST"]), Route("/stats", read_stats),
                             Route("/v1/models", models), Route("/v1/completions", generate, methods=["POST"]),
                             Route("/v1/chat/completions", generate, methods=["POST"])])


class FakeServer:
    """The app in its own process (so the client's timing shares no GIL with it) on a free loopback port.
    `configure` swaps the schedule and clears the stats; `stats` reads them back."""

    def __init__(self, tokenizer, trace_path: str | None = None) -> None:
        # tokenizer: the client's (models/tokenizer.Tokenizer), handed to the server's process as its
        # tokenizer.json: parsing the GGUF again there (its reader imports JAX) took most of the start-up.
        # trace_path: the app is wrapped in benchmarks/bench/trace_server's per-request trace, written there
        self._tokenizer_dir = tempfile.mkdtemp(prefix="fake-server-")
        tokenizer._hf.save(os.path.join(self._tokenizer_dir, "tokenizer.json"))
        self._proc = subprocess.Popen([sys.executable, "-m", "tests.server.bench_fake_server", self._tokenizer_dir,
                                       *([trace_path] if trace_path else [])],
                                      stdout=subprocess.PIPE, text=True,
                                      cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        line = self._proc.stdout.readline()
        if not line.startswith("port "):
            self._proc.kill()
            raise RuntimeError(f"fake server did not start: {line!r}")
        self.base_url = f"http://127.0.0.1:{int(line.split()[1])}"
        self._warm_up()

    def _warm_up(self) -> None:
        # one streamed request on a zero schedule before any test's, so the first request a test times does not
        # pay for the server's lazy imports (a clean clone on CI: its first TTFT 171 ms against a 150 ms schedule)
        self.configure(Schedule(ttft_s=0.0, itl_s=0.0))
        with httpx.stream("POST", f"{self.base_url}/v1/completions", trust_env=False, timeout=30,
                          json={"prompt": "warm up", "max_tokens": 2, "stream": True}) as response:
            response.raise_for_status()
            for _ in response.iter_bytes():
                pass
        self.configure(Schedule())  # the default schedule and empty stats, as a fresh server has

    def configure(self, schedule: Schedule) -> "FakeServer":
        httpx.post(f"{self.base_url}/configure", json=dataclasses.asdict(schedule), trust_env=False).raise_for_status()
        return self

    def stats(self) -> Stats:
        return Stats(**httpx.get(f"{self.base_url}/stats", trust_env=False).json())

    def close(self) -> None:
        self._proc.terminate()
        self._proc.wait(timeout=10)
        shutil.rmtree(self._tokenizer_dir, ignore_errors=True)


def main() -> None:
    from slipstream.models.tokenizer import Tokenizer

    tok = Tokenizer.from_hf_dir(sys.argv[1])
    state = {"schedule": Schedule(), "stats": Stats(), "seen_prompts": set()}
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)  # connections queue from the moment the port is printed, before uvicorn serves them
    print(f"port {sock.getsockname()[1]}", flush=True)
    app = build_app(state, lambda text: len(tok.encode(text, add_special_tokens=False)))
    if len(sys.argv) > 2:
        from benchmarks.bench.trace_server import TraceRequests

        app = TraceRequests(app, sys.argv[2])
    uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off")).run(sockets=[sock])


if __name__ == "__main__":
    main()
