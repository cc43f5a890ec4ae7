"""Hostile text in every request field that reaches a parser (JSON arguments, schemas, tool
definitions, the body itself, protobuf): a 5000-deep `[[[...]]]` (RecursionError in Python's json)
and a 5000-digit number (ValueError: the int-string limit). Each must be a 400 naming the field
(gRPC: INVALID_ARGUMENT), never a 5xx, and the keep-alive connection must serve the next request."""
from __future__ import annotations

import http.client
import json
from typing import Any, Iterator

import grpc
import pytest

from slipstream.engine.structured import Constraint
from slipstream.server.errors import ServiceError
from slipstream.server.proto import jetstream_pb2 as pb
from slipstream.server.structured import compile_constraint
from tests.server.conftest import LiveServer
from tests.server.grpc_helpers import GrpcLive, start_grpc, text_request

DEEP = "[" * 5000 + "]" * 5000
LONG = "1" * 5000
HOSTILE = {"deep": DEEP, "long": LONG}
USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _chat_with_arguments(text: str) -> dict[str, Any]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": text}}
    return {"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}


# (path, body, the param the error must name); every field whose text reaches a parser
CASES = [
    *[(path, {**base, "guided_json": text}, "guided_json")
      for path, base in (("/v1/completions", {"prompt": "a"}), ("/v1/chat/completions", {"messages": USER}))
      for text in HOSTILE.values()],
    *[(path, {**base, "structured_outputs": {"json": text}}, "structured_outputs.json")
      for path, base in (("/v1/completions", {"prompt": "a"}), ("/v1/chat/completions", {"messages": USER}))
      for text in HOSTILE.values()],
    *[("/v1/chat/completions", _chat_with_arguments(text), "messages.1.tool_calls.0.function.arguments")
      for text in HOSTILE.values()],
    ("/v1/chat/completions", {"messages": USER, "tools": [TOOL],
                              "tool_choice": {"type": "function", "function": "f"}}, "tool_choice"),
    *[("/v1/chat/completions", {"messages": USER, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", key: defs}}}]},
       f"tools.0.function.parameters.{key}")
      for key in ("$defs", "definitions") for defs in ([1], "x")],
]

def _nested_arrays(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


# Tool parameters as deep as a JSON body can carry: the forced-call grammar is built by recursion.
CASES += [("/v1/chat/completions", {"messages": USER, "tools": [
    {"type": "function", "function": {"name": "f", "parameters": _nested_arrays(900)}}], "tool_choice": choice},
    "tools.0.function.parameters") for choice in ("required", {"type": "function", "function": {"name": "f"}})]
CASE_IDS = [f"{'chat' if 'chat' in path else 'cmpl'}-{param}-{i}" for i, (path, _, param) in enumerate(CASES)]


def _post(conn: http.client.HTTPConnection, path: str, body: bytes,
          headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    return response.status, json.loads(response.read() or b"{}")


def _assert_keep_alive(conn: http.client.HTTPConnection) -> None:
    """The next request goes over the same socket: a 5xx used to make the server close it."""
    sock = conn.sock
    assert sock is not None, "the server closed the connection after the error"
    status, body = _post(conn, "/v1/completions", json.dumps({"prompt": "abc", "max_tokens": 2}).encode())
    assert status == 200 and body["choices"][0]["text"] == "de"
    assert conn.sock is sock


@pytest.fixture
def conn(live: LiveServer) -> Iterator[http.client.HTTPConnection]:
    host, port = live.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    yield connection
    connection.close()


@pytest.mark.parametrize("path, body, param", CASES, ids=CASE_IDS)
def test_hostile_field_is_400_naming_it_and_keeps_the_connection(conn, path: str, body: dict, param: str) -> None:
    status, reply = _post(conn, path, json.dumps(body).encode())
    assert status == 400, reply
    assert reply["error"]["param"] == param
    assert reply["error"]["code"] == "invalid_value"
    _assert_keep_alive(conn)


@pytest.mark.parametrize("body", [
    b'{"prompt": "a", "max_tokens": ' + LONG.encode() + b"}",
    b'{"prompt": ' + DEEP.encode() + b"}",
    b'{"prompt": "a", "temperature": NaN}',
    b'{"prompt": "a", "temperature": Infinity}',
    b'{"prompt": "a", "temperature": -Infinity}',
], ids=["long-number", "deep", "nan", "inf", "-inf"])
def test_unparseable_body_is_400_invalid_json_and_keeps_the_connection(conn, body: bytes) -> None:
    status, reply = _post(conn, "/v1/completions", body)
    assert status == 400, reply
    assert reply["error"]["code"] == "invalid_json"
    assert "JSON" in reply["error"]["message"]
    _assert_keep_alive(conn)


def test_non_finite_numbers_are_named_at_body_parse(conn) -> None:
    status, reply = _post(conn, "/v1/completions", b'{"prompt": "a", "temperature": NaN}')
    assert status == 400 and "NaN" in reply["error"]["message"] and "finite" in reply["error"]["message"]


# ---- the grammar compiler itself (the mock server above has no tokenizer llguidance can read) ------


class _ServedModel:
    """What compile_constraint reads of a Service: the default model's tokenizer and vocabulary."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = 49152
        self.engine = type("Engine", (), {"eos_token_ids": tuple(tokenizer.eos_token_ids)})()


@pytest.fixture(scope="module")
def served_model(default_tokenizer) -> _ServedModel:
    return _ServedModel(default_tokenizer)


PAREN = "(" * 5000 + "a" + ")" * 5000


@pytest.mark.parametrize("kind, source", [
    *[(kind, text) for kind in ("regex", "grammar") for text in (DEEP, LONG, PAREN, "start: " + PAREN)],
    *[("choice", [text]) for text in (DEEP, LONG)],
    *[("json_schema", schema) for schema in ({"type": "string", "pattern": PAREN}, {"enum": [int(LONG[:4000])]},
                                             {"type": "integer", "maximum": 1e308}, {"const": DEEP},
                                             {"$ref": "#/" + "a/" * 2000})],
])
def test_hostile_grammars_compile_or_are_400_naming_the_field(served_model, kind: str, source: Any) -> None:
    try:
        compile_constraint(served_model, Constraint(kind, source, field="the_field"))
    except ServiceError as exc:
        assert (exc.status, exc.param) == (400, "the_field"), exc.message


# ---- gRPC ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rpc(live: LiveServer) -> Iterator[GrpcLive]:
    server = start_grpc(live.service)
    yield server
    server.stop()


@pytest.mark.parametrize("text", list(HOSTILE.values()), ids=list(HOSTILE))
def test_grpc_hostile_json_schema_is_invalid_argument(rpc: GrpcLive, text: str) -> None:
    request = text_request("abc", 2, sampling=pb.SlipstreamSampling(json_schema=text))
    with pytest.raises(grpc.RpcError) as info:
        list(rpc.stub.Decode(request, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.json_schema" in info.value.details()
    # the channel still serves
    assert [r.stream_content.samples[0].text for r in rpc.stub.Decode(text_request("abc", 2), timeout=10)]


def test_grpc_malformed_protobuf_is_invalid_argument(rpc: GrpcLive, caplog: pytest.LogCaptureFixture) -> None:
    decode = rpc.channel.unary_stream("/jetstream_proto.Orchestrator/Decode",
                                      request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw)
    with caplog.at_level("INFO"), pytest.raises(grpc.RpcError) as info:
        list(decode(b"\xff\xff\xff", timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "DecodeError" not in info.value.details() and "Unexpected" not in info.value.details()
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL") or r.exc_info]
