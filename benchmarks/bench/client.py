"""One streamed request to an OpenAI completions or chat endpoint, timed the way `vllm bench serve` times it.

TTFT is the first SSE chunk that carries a choice; each later choice chunk adds one ITL sample; the
latency ends at the last choice chunk. Output tokens come from the server's `usage` (asked for with
stream_options.include_usage, read from whichever chunk carries it, which for llama.cpp's server is the
last choice chunk), else from re-tokenizing the text. One departure: a chat chunk with only a role and
no content or finish_reason is not a token, so it neither starts TTFT nor adds an ITL sample.
Connections are reused between requests by default, as vLLM's client (aiohttp) does.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from benchmarks.bench.datasets import SampleRequest


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


def new_http_client(timeout_s: float = 6 * 3600, *, keep_alive: bool = False,
                    max_connections: int | None = None) -> httpx.AsyncClient:
    """keep_alive: reuse connections between requests (up to max_connections idle ones), as vLLM's client
    (aiohttp) and the OpenAI SDK do; otherwise a fresh connection per request."""
    pool = (max_connections or 256) if keep_alive else 0
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30.0), trust_env=False,
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=pool))


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
_STALE_CONNECTION = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


async def send_request(client: httpx.AsyncClient, url: str, kind: str, payload: dict[str, Any],
                       prompt_len: int, request_id: str | None = None,
                       fresh_client: httpx.AsyncClient | None = None) -> RequestOutput:
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
            async with http.stream("POST", url, json=payload, headers=_headers(request_id)) as response:
                responded = True
                if response.status_code != 200:
                    body = (await response.aread()).decode("utf-8", "replace").strip()
                    out.error = f"HTTP {response.status_code}: {body[:300]}"
                    return out
                # read to the end of the body (past [DONE]), so the connection can be reused
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, SSE comments (pings), event names
                    data = line[5:].strip()
                    if data == "[DONE]":
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
        except (httpx.HTTPError, OSError, json.JSONDecodeError) as e:
            out.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            return out
    out.generated_text = "".join(text)
    if first:
        out.error = "the stream ended without a token"
        return out
    out.success, out.latency = True, last - st
    return out
