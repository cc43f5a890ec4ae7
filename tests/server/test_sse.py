"""Server-sent events on the wire, read raw with httpx: exact framing, chunk shapes and the [DONE] end."""
from __future__ import annotations

import json
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
    assert chunks[-1]["usage"] == {"prompt_tokens": len("<user>hi\n<assistant>"), "completion_tokens": 3,
                                   "total_tokens": len("<user>hi\n<assistant>") + 3}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")

