"""Errors that say what is wrong where the client put it (issue 54 item 6): a text part without
text, a lone surrogate in a tool definition, a compressed body."""
from __future__ import annotations

import gzip
import json

from tests.server.conftest import LiveServer

TOOL = {"type": "function", "function": {"name": "f", "description": "ok", "parameters": {"type": "object"}}}


def _post(live: LiveServer, path: str, body: bytes, **headers: str):
    with live.http() as http:
        return http.post(path, content=body, headers={"content-type": "application/json", **headers})


def test_a_text_part_without_text_says_text_is_missing(live: LiveServer) -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}]}
    error = _post(live, "/v1/chat/completions", json.dumps(body).encode()).json()["error"]
    assert error["param"] == "messages.0.content.1.text"
    assert "missing" in error["message"] and "only text content parts" not in error["message"]


def test_a_lone_surrogate_in_a_tool_names_the_tool_field(live: LiveServer) -> None:
    tool = {**TOOL, "function": {**TOOL["function"], "description": "bad \ud800 text"}}
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
    reply = _post(live, "/v1/chat/completions", json.dumps(body).encode())  # json.dumps escapes it: \ud800
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "tools.0.function.description"
    assert "surrogate" in reply.json()["error"]["message"]


def test_a_compressed_body_is_415_naming_the_encoding_either_way(live: LiveServer) -> None:
    body = json.dumps({"prompt": "abc", "max_tokens": 2}).encode()
    for payload in (gzip.compress(body), body):  # a real gzip body, and plain JSON labelled gzip
        reply = _post(live, "/v1/completions", payload, **{"content-encoding": "gzip"})
        assert reply.status_code == 415, reply.text
        assert reply.json()["error"]["code"] == "unsupported_media_type" and "'gzip'" in reply.json()["error"]["message"]
    assert _post(live, "/v1/completions", body, **{"content-encoding": "identity"}).status_code == 200
