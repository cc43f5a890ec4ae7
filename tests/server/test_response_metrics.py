"""Every answer is visible in /metrics: HTTP responses by route template, status class and error
code (4xx and 5xx alike), gRPC calls by status code; and an unexpected 500 keeps the connection."""
from __future__ import annotations

import http.client
import json
from typing import Any

import grpc
import httpx
import pytest

from tests.server.conftest import LiveServer
from tests.server.grpc_helpers import start_grpc, text_request

HTTP = "slipstream_http_responses_total"


def _count(live: LiveServer, route: str, status_class: str, code: str) -> float:
    try:
        return live.metric(HTTP, route=route, status_class=status_class, code=code)
    except KeyError:
        return 0.0


def _broken(*args: Any, **kwargs: Any) -> list[int]:
    raise RuntimeError("secret internal detail")


def test_every_status_class_and_code_is_counted_per_route(make_live) -> None:
    live = make_live(api_key="k")
    with live.http() as client:
        assert client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2}).status_code == 200
        assert client.post("/v1/completions", json={"prompt": "abc", "temperature": 5}).status_code == 400
        assert client.post("/v1/completions", content=b'{"prompt": NaN}').status_code == 400
        assert client.get("/v1/models/some-other-model").status_code == 404
        assert client.get("/no/such/path").status_code == 404
    assert httpx.post(f"{live.url}/v1/chat/completions", json={}).status_code == 401
    live.service.tokenizer.encode = _broken  # type: ignore[method-assign]
    with live.http() as client:
        assert client.post("/v1/completions", json={"prompt": "abc"}).status_code == 500

    assert _count(live, "/v1/completions", "2xx", "none") == 1
    assert _count(live, "/v1/completions", "4xx", "invalid_value") == 1
    assert _count(live, "/v1/completions", "4xx", "invalid_json") == 1
    assert _count(live, "/v1/completions", "5xx", "internal_error") == 1
    assert _count(live, "/v1/chat/completions", "4xx", "invalid_api_key") == 1
    # the route template, not the raw path: label values stay bounded
    assert _count(live, "/v1/models/{model}", "4xx", "model_not_found") == 1
    assert _count(live, "other", "4xx", "not_found") == 1  # every error body has a code
    labels = {dict(key[1]).get("route") for key in live.metrics() if key[0] == HTTP}
    assert labels <= {"/v1/completions", "/v1/chat/completions", "/v1/models/{model}", "/metrics", "other"}


def test_a_5xx_series_exists_before_the_first_error(live: LiveServer) -> None:
    # rate() over a series that appears only with the first error misses that error
    assert _count(live, "/v1/chat/completions", "5xx", "internal_error") == 0
    assert ("slipstream_grpc_responses_total", (("code", "INTERNAL"), ("method", "Decode"))) in live.metrics()


def test_an_unexpected_500_keeps_the_keep_alive_connection(make_live) -> None:
    live = make_live()
    live.service.tokenizer.encode = _broken  # type: ignore[method-assign]
    host, port = live.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        for _ in range(2):
            conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "abc"}),
                         headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            body = json.loads(response.read())
            assert response.status == 500 and body["error"]["code"] == "internal_error"
            assert "secret" not in body["error"]["message"]
            assert not response.will_close and conn.sock is not None
    finally:
        conn.close()


def test_grpc_status_codes_are_counted(make_live) -> None:
    live = make_live()
    rpc = start_grpc(live.service)
    try:
        list(rpc.stub.Decode(text_request("abc", 2), timeout=10))
        with pytest.raises(grpc.RpcError):
            list(rpc.stub.Decode(text_request("abc", -1), timeout=10))
        decode = rpc.channel.unary_stream("/jetstream_proto.Orchestrator/Decode",
                                          request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw)
        with pytest.raises(grpc.RpcError):
            list(decode(b"\xff\xff\xff", timeout=10))
    finally:
        rpc.stop()
    assert live.metric("slipstream_grpc_responses_total", method="Decode", code="OK") == 1
    assert live.metric("slipstream_grpc_responses_total", method="Decode", code="INVALID_ARGUMENT") == 2
