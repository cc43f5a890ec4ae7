"""Server-sent events on the wire, read raw with httpx: exact framing, chunk shapes and the [DONE] end."""
from __future__ import annotations

import json
import socket
from typing import Any

from tests.server.conftest import MODEL, LiveServer


def _stream(live: LiveServer, path: str, body: dict[str, Any]) -> tuple[bytes, list[dict[str, Any]]]:
    with live.http() as http, http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].split(";")[0] == "text/event-stream"
        assert response.headers["cache-control"] == "no-cache"
        raw = response.read()
    events = raw.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""], raw[-80:]
    payloads = []
    for event in events[:-2]:
        assert event.startswith(b"data: ") and b"\n" not in event, event
        payloads.append(json.loads(event[len(b"data: "):]))
    # Byte for byte: nothing but `data: <compact json>\n\n` per chunk, then the [DONE] sentinel.
    rebuilt = b"".join(b"data: " + json.dumps(p, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
                       for p in payloads)
    assert raw == rebuilt + b"data: [DONE]\n\n"
    return raw, payloads


def test_completion_stream_framing_and_chunk_shape(live: LiveServer) -> None:
    _, chunks = _stream(live, "/v1/completions", {"model": MODEL, "prompt": "abc", "max_tokens": 5, "stream": True})
    assert chunks, "no chunks before [DONE]"
    for chunk in chunks:
        assert set(chunk) == {"id", "object", "created", "model", "choices"}  # no usage unless asked
        assert chunk["object"] == "text_completion" and chunk["model"] == MODEL
        assert [set(c) for c in chunk["choices"]] == [{"index", "text", "logprobs", "finish_reason"}]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "defgh"
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"


def test_completion_stream_logprobs_offsets_continue_across_chunks(live: LiveServer) -> None:
    _, chunks = _stream(live, "/v1/completions",
                        {"prompt": "abc", "max_tokens": 4, "stream": True, "logprobs": 0})
    tokens, offsets = [], []
    for chunk in chunks:
        lp = chunk["choices"][0]["logprobs"]
        tokens += lp["tokens"]
        offsets += lp["text_offset"]
    assert tokens == ["d", "e", "f", "g"]
    assert offsets == [0, 1, 2, 3]


def test_chat_stream_framing_role_chunk_and_usage_chunk(live: LiveServer) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    _, chunks = _stream(live, "/v1/chat/completions", body)
    assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]
    content = [c for c in chunks[1:] if c["choices"]]
    assert all(set(c["choices"][0]["delta"]) <= {"content"} for c in content)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in content) == "?@A"
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    # include_usage: every chunk carries "usage": null, then one last chunk with no choices.
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    usage = chunks[-1]["usage"]
    assert usage.pop("prompt_tokens_details")["cached_tokens"] >= 0  # test_cached_tokens.py checks its value
    assert usage == {"prompt_tokens": len("<user>hi\n<assistant>"), "completion_tokens": 3,
                     "total_tokens": len("<user>hi\n<assistant>") + 3}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")



def _raw_stream(live: LiveServer, version: bytes, keep_alive: bool = False) -> tuple[bytes, bytes]:
    """A streamed completion's head and body bytes as they came off the socket (the server closes the
    connection after it unless keep_alive, then a second request on the same connection follows)."""
    body = json.dumps({"model": MODEL, "prompt": "abc", "max_tokens": 5, "stream": True}).encode()
    request = (b"POST /v1/completions HTTP/" + version + b"\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + str(len(body)).encode() + b"\r\n"
               + (b"" if keep_alive else b"Connection: close\r\n") + b"\r\n" + body)
    host, port = live.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(request * (2 if keep_alive else 1))
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
            if keep_alive and raw.count(b"0\r\n\r\n") == 2 and raw.endswith(b"0\r\n\r\n"):
                break
    head, _, rest = raw.partition(b"\r\n\r\n")
    return head, rest


def _dechunk(raw: bytes) -> tuple[list[bytes], bytes]:
    """The chunks of a chunked body, strictly framed (size in hex, CRLF, data, CRLF, a zero chunk last), and
    what follows it."""
    chunks = []
    while True:
        size, _, raw = raw.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            assert raw.startswith(b"\r\n"), raw[:20]
            return chunks, raw[2:]
        assert raw[n:n + 2] == b"\r\n", raw[:n + 2]
        chunks.append(raw[:n])
        raw = raw[n + 2:]


def test_stream_chunks_framed_on_the_wire(live: LiveServer) -> None:
    # HTTP/1.1: chunked, one event per chunk (the server frames the events after the first itself:
    # server/gate.py chunked_send), the same text as httpx reads
    head, rest = _raw_stream(live, b"1.1")
    assert b"transfer-encoding: chunked" in head.lower()
    chunks, after = _dechunk(rest)
    assert after == b"" and len(chunks) >= 3 and chunks[-1] == b"data: [DONE]\n\n"
    assert all(c.startswith(b"data: ") and c.endswith(b"\n\n") and c.count(b"\n\n") == 1 for c in chunks)
    assert "".join(json.loads(c[len(b"data: "):])["choices"][0]["text"] for c in chunks[:-1]) == "defgh"
    # two streams on one keep-alive connection: each framed whole
    head, rest = _raw_stream(live, b"1.1", keep_alive=True)
    first, after = _dechunk(rest)
    second, tail = _dechunk(after.partition(b"\r\n\r\n")[2])
    assert after.startswith(b"HTTP/1.1 200") and tail == b""
    assert first[-1] == second[-1] == b"data: [DONE]\n\n" and b"".join(first).count(b"data: ") == len(first)
    # HTTP/1.0: no chunked framing; the events as they are, until the server closes
    head, rest = _raw_stream(live, b"1.0")
    assert b"transfer-encoding" not in head.lower()
    assert rest.endswith(b"data: [DONE]\n\n") and b"\r\n" not in rest and b'"text":"d' in rest



def test_a_queued_stream_gets_its_headers_before_the_engine_takes_it_up(make_live) -> None:
    # a streaming response waits for its request's first step to launch before its headers, but only a
    # little: behind a request holding the engine's one slot, the second one waits in the queue, and its
    # headers come while it still waits
    live = make_live(max_slots=1, step_sleep_s=0.02)
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 100, "stream": True}
    with live.http() as http, http.stream("POST", "/v1/completions", json=body) as first:
        chunks = first.iter_bytes()
        next(chunks)  # the first request runs
        with live.http() as http2, http2.stream("POST", "/v1/completions", json={**body, "max_tokens": 3}) as second:
            assert second.status_code == 200 and second.headers["content-type"].startswith("text/event-stream")
            stats = live.scheduler.stats()
            assert stats.running == 1 and stats.waiting == 1  # still queued behind the first
            raw = second.read()
        assert b"".join(chunks).endswith(b"data: [DONE]\n\n")
    texts = [json.loads(e[len(b"data: "):])["choices"][0]["text"] for e in raw.split(b"\n\n")[:-2]]
    assert "".join(texts) == "def"
