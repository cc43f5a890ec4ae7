"""One streamed request to an OpenAI completions or chat endpoint, timed the way `vllm bench serve` times it.

TTFT is the first SSE chunk that carries a choice; each later choice chunk adds one ITL sample; the
latency ends at the last choice chunk. Output tokens come from the server's `usage` (asked for with
stream_options.include_usage, read from whichever chunk carries it, which for llama.cpp's server is the
last choice chunk), else from re-tokenizing the text. One departure: a chat chunk with only a role and
no content or finish_reason is not a token, so it neither starts TTFT nor adds an ITL sample.

The transport is aiohttp, as in vLLM's client: connections are reused between requests by default, and each
received piece of the body is split into SSE lines by hand. On a 2-core machine the client shares the CPUs
with the server, so what it costs per chunk moves the server's numbers: httpx's `aiter_lines` cost ~140 us a
chunk against aiohttp's ~60 us, and at 8 concurrent the server's steps ran up to 10% slower in half of the
runs driven by the httpx client (benchmarks/bench_agreement.py).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from slipstream.server.bench.datasets import SampleRequest


@dataclass
class RequestOutput:
    success: bool = False
    error: str = ""
    generated_text: str = ""
    prompt_len: int = 0               # the server's usage.prompt_tokens when given, else the dataset's
    output_tokens: int | None = None  # usage.completion_tokens when the server reports it
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start_time: float = 0.0           # perf_counter when the request was sent
    request_id: str | None = None     # sent as x-request-id, as vLLM does


def new_http_client(timeout_s: float = 6 * 3600, *, keep_alive: bool = False, max_connections: int | None = None,
                    unix_socket: str | None = None) -> aiohttp.ClientSession:
    """keep_alive: reuse connections between requests (at most max_connections open at once), as vLLM's client
    and the OpenAI SDK do; otherwise a fresh connection per request. Proxies from the environment are ignored.
    unix_socket: connect to this path (`serve --uds`) instead of the URL's host and port."""
    pool = (dict(limit=max_connections or 0, keepalive_timeout=60) if keep_alive
            else dict(limit=0, force_close=True))
    connector = aiohttp.UnixConnector(unix_socket, **pool) if unix_socket else aiohttp.TCPConnector(**pool)
    return aiohttp.ClientSession(connector=connector, trust_env=False,
                                 timeout=aiohttp.ClientTimeout(total=timeout_s, sock_connect=30.0))


def build_payload(kind: str, model: str, req: SampleRequest, *, ignore_eos: bool,
                  sampling: dict[str, Any]) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    if kind == "chat":
        payload["messages"] = [{"role": "user", "content": req.prompt}]
        payload["max_completion_tokens"] = req.expected_output_len
    else:
        payload["prompt"] = req.prompt
        payload["max_tokens"] = req.expected_output_len
    if ignore_eos:
        payload["ignore_eos"] = True
    payload.update(sampling)
    return payload


def _headers(request_id: str | None) -> dict[str, str]:
    headers = {"x-request-id": request_id} if request_id else {}
    key = os.environ.get("OPENAI_API_KEY")
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return headers


def _is_token_chunk(kind: str, choice: dict) -> tuple[bool, str]:
    if kind == "chat":
        delta = choice.get("delta") or {}
        content = delta.get("content") or ""
        return bool(content) or choice.get("finish_reason") is not None or "role" not in delta, content
    return True, choice.get("text") or ""


# What a pooled connection the server has already closed fails with, before any response arrives
_STALE_CONNECTION = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


async def _sse_data(response: aiohttp.ClientResponse):
    """The payload of each `data:` line of an SSE body, as the pieces of it arrive (comments, event names and
    blank separators skipped); a line split across two pieces is joined first."""
    tail = b""
    async for piece in response.content.iter_any():
        lines = (tail + piece).split(b"\n")
        tail = lines.pop()
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip()
    if tail.startswith(b"data:"):
        yield tail[5:].strip()


async def send_request(client: aiohttp.ClientSession, url: str, kind: str, payload: dict[str, Any],
                       prompt_len: int, request_id: str | None = None,
                       fresh_client: aiohttp.ClientSession | None = None) -> RequestOutput:
    """One streamed request. With kept-alive connections, a server that closes each connection after its stream
    (llama.cpp's) can close a pooled one just as it is reused: a request that fails that way, before any
    response, is sent once more on a new connection (fresh_client, one without keep-alive). Its timing still
    starts at the first try."""
    out = RequestOutput(prompt_len=prompt_len, request_id=request_id)
    text: list[str] = []
    st = time.perf_counter()
    out.start_time = last = st
    first = True
    for attempt, http in ((1, client), (2, fresh_client)):
        responded = False
        try:
            async with http.post(url, json=payload, headers=_headers(request_id)) as response:
                responded = True
                if response.status != 200:
                    body = (await response.read()).decode("utf-8", "replace").strip()
                    out.error = f"HTTP {response.status}: {body[:300]}"
                    return out
                # read to the end of the body (past [DONE]), so the connection can be reused
                async for data in _sse_data(response):
                    if data == b"[DONE]":
                        continue
                    now = time.perf_counter()
                    chunk = json.loads(data)
                    if chunk.get("error"):
                        out.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                        return out
                    choices = chunk.get("choices") or []
                    if choices:
                        is_token, piece = _is_token_chunk(kind, choices[0])
                        if is_token:
                            if first:
                                out.ttft, first = now - st, False
                            else:
                                out.itl.append(now - last)
                            last = now
                        text.append(piece)
                    usage = chunk.get("usage")
                    if usage:
                        out.output_tokens = usage.get("completion_tokens")
                        if usage.get("prompt_tokens") is not None:
                            out.prompt_len = usage["prompt_tokens"]
            break
        except _STALE_CONNECTION as e:
            if attempt == 1 and not responded and fresh_client is not None:
                continue
            out.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            return out
        except (aiohttp.ClientError, OSError, TimeoutError, json.JSONDecodeError) as e:
            out.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            return out
    out.generated_text = "".join(text)
    if first:
        out.error = "the stream ended without a token"
        return out
    out.success, out.latency = True, last - st
    return out
