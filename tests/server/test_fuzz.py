"""Property-based fuzzing (issue 12): every request field at its extremes, through the service layer
and the engine's sampling-state build, and schemathesis over our own OpenAPI document against a live
MockEngine server. The bar is zero 5xx: a bad value is the client's 4xx, never the server's error.

`pytest -s` prints how many cases ran and how many 5xx were seen."""
from __future__ import annotations

import collections
import math
import sys
from typing import Any, Iterator

import grpc
import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

from slipstream.engine.request import MAX_INT32
from slipstream.engine.device.sampling import SamplingArrays
from slipstream.server.errors import ServiceError, grpc_code
from slipstream.server.grpc_service import prepare_decode
from slipstream.server.openai_api import prepare_chat, prepare_completion
from slipstream.server.proto import jetstream_pb2 as pb
from slipstream.server.protocol import ChatCompletionRequest, CompletionRequest
from slipstream.server.generation import Prepared
from slipstream.server.service import Service
from tests.server.conftest import BOS, LiveServer

# Counters for the summary printed at the end of the module (cases, and statuses by hundreds).
SEEN: collections.Counter[str] = collections.Counter()

_INTS = st.sampled_from([0, 1, -1, 2, 16, 17, 20, 21, 64, 65, 127, 128, MAX_INT32, MAX_INT32 + 1, 2**63 - 1, 2**63,
                         2**64, -(2**63), 10**30]) | st.integers()
_FLOATS = st.sampled_from([0.0, -0.0, 1e-45, 1e-300, 0.01, 0.5, 1.0, 2.0, 2.0000001, -2.0, 100.0, 3.4e38, 3.5e38,
                           1e308, math.inf, -math.inf, math.nan]) | st.floats()
_TEXT = st.sampled_from(["", "a", "abc", "\ud800", "a\udfffb", "\x00", "é😀", "x" * 1025]) | st.text(max_size=20)
_ANY = st.recursive(st.none() | st.booleans() | _INTS | _FLOATS | _TEXT,
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3), max_leaves=6)
_SAMPLING = {
    "max_tokens": _INTS | _ANY, "temperature": _FLOATS | _ANY, "top_p": _FLOATS, "top_k": _INTS, "min_p": _FLOATS,
    "repetition_penalty": _FLOATS, "presence_penalty": _FLOATS, "frequency_penalty": _FLOATS, "seed": _INTS,
    "n": _INTS, "stop": _TEXT | st.lists(_TEXT, max_size=10) | _ANY, "stream": st.booleans() | _ANY,
    "ignore_eos": st.booleans(), "model": _TEXT, "logit_bias": _ANY, "user": _TEXT,
}
_COMPLETION = st.fixed_dictionaries(
    {"prompt": _TEXT | st.lists(_TEXT, max_size=70) | st.lists(_INTS, max_size=5)
     | st.lists(st.lists(_INTS, max_size=3), max_size=3) | _ANY},
    optional={**_SAMPLING, "logprobs": _INTS, "echo": st.booleans(), "best_of": _INTS, "suffix": _TEXT})
_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]),
                                  "content": _TEXT | st.lists(st.fixed_dictionaries(
                                      {"type": st.sampled_from(["text", "image_url"]), "text": _TEXT}), max_size=3)
                                  | st.none()})
_CHAT = st.fixed_dictionaries(
    {"messages": st.lists(_MESSAGE, max_size=3) | _ANY},
    optional={**_SAMPLING, "logprobs": st.booleans(), "top_logprobs": _INTS, "max_completion_tokens": _INTS,
              "response_format": _ANY})


def _through_service(service: Service, prepare: Any, model: Any, body: dict[str, Any]) -> None:
    SEEN["service cases"] += 1
    try:
        prepared: Prepared = prepare(service, model.model_validate(body))
    except ValidationError:
        SEEN["service 4xx"] += 1  # the HTTP layer's 400
        return
    except ServiceError as exc:
        SEEN[f"service {exc.status // 100}xx"] += 1
        assert exc.status < 500, exc.message
        return
    SEEN["service accepted"] += 1
    # What the engine thread does with it: build the sampling arrays for a batch.
    SamplingArrays.from_params([prepared.params], [prepared.params.seed or 0], [0], 2)
    assert all(0 <= t < service.vocab_size for p in prepared.prompts for t in p)


_FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))


@_FUZZ
@given(body=_COMPLETION)
def test_completion_fields_at_their_extremes_are_accepted_or_4xx(live: LiveServer, body: dict[str, Any]) -> None:
    _through_service(live.service, prepare_completion, CompletionRequest, body)


@_FUZZ
@given(body=_CHAT)
def test_chat_fields_at_their_extremes_are_accepted_or_4xx(live: LiveServer, body: dict[str, Any]) -> None:
    _through_service(live.service, prepare_chat, ChatCompletionRequest, body)


_F32 = st.floats(width=32) | st.sampled_from([math.inf, -math.inf, math.nan, 3.4e38, 0.0])
_I32 = st.integers(-(2**31), 2**31 - 1)


@_FUZZ
@given(max_tokens=st.sampled_from([0, 1, 4]) | _I32, num_samples=st.integers(0, 3) | _I32, text=st.text(max_size=30), ids=st.lists(_I32, max_size=5),
       use_text=st.booleans(), has_bos=st.booleans(),
       sampling=st.fixed_dictionaries({}, optional={
           "temperature": _F32, "top_p": _F32, "top_k": _I32, "min_p": _F32, "seed": st.integers(0, 2**64 - 1),
           "presence_penalty": _F32, "frequency_penalty": _F32, "repetition_penalty": _F32,
           "stop": st.lists(st.text(max_size=3), max_size=10), "ignore_eos": st.booleans()}))
def test_grpc_fields_at_their_extremes_are_accepted_or_invalid_argument(
        live: LiveServer, max_tokens: int, num_samples: int, text: str, ids: list[int], use_text: bool,
        has_bos: bool, sampling: dict[str, Any]) -> None:
    SEEN["grpc cases"] += 1
    content = ({"text_content": pb.DecodeRequest.TextContent(text=text)} if use_text
               else {"token_content": pb.DecodeRequest.TokenContent(token_ids=ids)})
    request = pb.DecodeRequest(max_tokens=max_tokens, num_samples=num_samples, has_bos=has_bos,
                               sampling=pb.SlipstreamSampling(**sampling), **content)
    try:
        prepared = prepare_decode(live.service, request, (BOS,))
    except ServiceError as exc:
        SEEN[f"grpc {exc.status // 100}xx"] += 1
        assert grpc_code(exc) in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), exc.message
        return
    SEEN["grpc accepted"] += 1
    SamplingArrays.from_params([prepared.params], [prepared.params.seed or 0], [0], 2)


# ---- schemathesis over /openapi.json against the live server -------------------------------------


_OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
               ("GET", "/v1/models/{model}"), ("GET", "/health"), ("GET", "/ready"), ("GET", "/metrics")]
_CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def api_schema(live: LiveServer) -> Any:
    return schemathesis.openapi.from_dict(httpx.get(f"{live.url}/openapi.json", timeout=5).json())


# A negative case needs something to break: only the POST bodies have one.
@pytest.mark.parametrize("method, path, mode", [
    *((m, p, GenerationMode.POSITIVE) for m, p in _OPERATIONS),
    *((m, p, GenerationMode.NEGATIVE) for m, p in _OPERATIONS if m == "POST")], ids=str)
def test_openapi_document_against_the_live_server(api_schema: Any, live: LiveServer, method: str, path: str,
                                                  mode: GenerationMode) -> None:
    """Requests valid (positive) and invalid (negative) by our own schema: every response is
    documented, matches its schema and content type, and none is a 5xx."""
    operation = api_schema[path][method]
    strategy = operation.as_strategy(generation_mode=mode)
    examples = 120 if method == "POST" else 15

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        case = data.draw(strategy)
        response = case.call(base_url=live.url, timeout=10)
        SEEN["schemathesis cases"] += 1
        SEEN[f"schemathesis {response.status_code // 100}xx"] += 1
        case.validate_response(response, checks=_CHECKS)

    run()


@pytest.fixture(scope="module", autouse=True)
def _summary() -> Iterator[None]:
    yield
    print("\nfuzz summary: " + ", ".join(f"{k}={v}" for k, v in sorted(SEEN.items())), file=sys.stderr)
