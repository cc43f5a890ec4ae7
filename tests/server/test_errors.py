"""Every error status a client can get, each in OpenAI's body shape with the offending field named."""
from __future__ import annotations

from typing import Any

import json

import httpx
import openai
import pytest

from slipstream.server.errors import ServiceError
from slipstream.server.openai_api import prepare_chat, prepare_completion
from slipstream.server.protocol import ChatCompletionRequest, CompletionRequest
from slipstream.server.service import Service, ServiceConfig
from tests.server.conftest import MODEL, CountingTokenizer, LiveServer, wait_for

CHAT = [{"role": "user", "content": "hi"}]


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize("field, value", [
    ("temperature", -1),          # rejected by the request model
    ("top_p", 0),                 # rejected by SamplingParams
    ("presence_penalty", 3),
    ("n", 0),
    ("logprobs", 21),
    ("stop", 3),                  # wrong type
])
def test_bad_value_is_400_naming_the_field(live: LiveServer, field: str, value: Any) -> None:
    with live.http() as http:
        err = _error(http.post("/v1/completions", json={"prompt": "abc", field: value}), 400)
    assert err["param"] == field
    assert field in err["message"]
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("bias, words", [
    ({"abc": 1}, "token ids"), ({"-1": 1}, "token ids"), ({"100000": 1}, "token ids in [0, "),
    ({"5": 101}, "[-100, 100]"),
    ({str(i): 1 for i in range(301)}, "at most 300"),
])
def test_bad_logit_bias_is_400_naming_it(live: LiveServer, bias: dict, words: str) -> None:
    with live.http() as http:
        for path, body in (("/v1/completions", {"prompt": "abc"}), ("/v1/chat/completions", {"messages": CHAT})):
            err = _error(http.post(path, json={**body, "logit_bias": bias}), 400)
            assert err["param"] == "logit_bias" and words in err["message"], err
        ok = http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "logit_bias": {"5": -100, "7": 3}})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("field, value", [
    ("top_k", 2**31), ("max_tokens", 2**31), ("seed", 2**63), ("repetition_penalty", 1e-300),
    ("min_p", 1.5), ("frequency_penalty", -2.5), ("n", 17), ("best_of", 0),
])
def test_values_numpy_cannot_hold_are_400_and_the_stream_in_flight_finishes(make_live, field: str,
                                                                           value: Any) -> None:
    # issue 12: top_k=2**31 passed validation, overflowed np.int32 on the engine thread and
    # failed the engine, every stream in flight and the process.
    live = make_live(step_sleep_s=0.005)
    with live.http() as http, http.stream("POST", "/v1/completions",
                                          json={"prompt": "a", "max_tokens": 20, "stream": True}) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        err = _error(http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, field: value}), 400)
        assert err["param"] == field
        events = [first, *(line for line in lines if line.startswith("data: "))]
    assert events[-1] == "data: [DONE]"
    text = "".join(json.loads(e[len("data: "):])["choices"][0]["text"] for e in events[:-1])
    assert text == "".join(chr(ord("b") + i) for i in range(20))
    assert httpx.get(f"{live.url}/ready").status_code == 200
    assert live.client().completions.create(model=MODEL, prompt="abc", max_tokens=2).choices[0].text == "de"


def test_bad_value_through_the_openai_client(live: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        live.client().chat.completions.create(model=MODEL, messages=CHAT, top_p=1.5)
    assert info.value.status_code == 400
    assert info.value.body["param"] == "top_p"


def test_chat_field_errors_name_the_chat_field(live: LiveServer) -> None:
    with live.http() as http:
        err = _error(http.post("/v1/chat/completions", json={"messages": CHAT, "max_completion_tokens": 0}), 400)
        assert err["param"] == "max_completion_tokens"
        err = _error(http.post("/v1/chat/completions", json={"messages": CHAT, "top_logprobs": 2}), 400)
        assert err["param"] == "top_logprobs"  # needs logprobs=true
        err = _error(http.post("/v1/chat/completions", json={"messages": CHAT, "logprobs": True,
                                                             "top_logprobs": 21}), 400)
        assert err["param"] == "top_logprobs" and "20" in err["message"]
        err = _error(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}]}), 400)
        assert err["param"] == "messages.0.content.0" and "text-only model" in err["message"]
        err = _error(http.post("/v1/chat/completions", json={"messages": []}), 400)
        assert err["param"] == "messages"


def test_unsupported_openai_fields_are_refused_not_ignored(live: LiveServer) -> None:
    with live.http() as http:
        assert _error(http.post("/v1/completions", json={"prompt": "a", "suffix": "b"}), 400)["param"] == "suffix"
        err = _error(http.post("/v1/completions", json={"prompt": "a", "max_tokens": 0}), 400)
        assert err["param"] == "max_tokens" and "echo" in err["message"]  # 0 only scores an echoed prompt
        err = _error(http.post("/v1/chat/completions", json={"messages": CHAT, "tools": [{"type": "function"}]}), 400)
        assert err["param"] == "tools"
        # Unknown fields are ignored, as OpenAI-compatible servers do.
        assert http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 1, "frobnicate": 1}).status_code == 200


def test_invalid_json_and_empty_prompt(live: LiveServer) -> None:
    with live.http() as http:
        err = _error(http.post("/v1/completions", content=b"{bad", headers={"content-type": "application/json"}), 400)
        assert "JSON" in err["message"]
        assert _error(http.post("/v1/completions", json={"prompt": []}), 400)["param"] == "prompt"
        assert _error(http.post("/v1/completions", json={"prompt": [-1]}), 400)["param"] == "prompt"
        assert _error(http.post("/v1/completions", json={"max_tokens": 1}), 400)["param"] == "prompt"


def test_prompt_too_long_names_limit_and_count(live: LiveServer) -> None:
    with live.http() as http:
        # BOS + 120 bytes + 16 default max_tokens = 137 > the mock's 128-token context.
        err = _error(http.post("/v1/completions", json={"prompt": "a" * 120}), 400)
    assert err["param"] == "prompt" and err["code"] == "context_length_exceeded"
    assert "128" in err["message"] and "121" in err["message"] and "137" in err["message"]
    assert live.scheduler.stats().rejections.get("too_long") == 1


def test_chat_prompt_too_long_without_max_tokens(live: LiveServer) -> None:
    content = "a" * 200
    with pytest.raises(openai.BadRequestError) as info:
        live.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}])
    tokens = len(f"<user>{content}\n<assistant>")
    assert info.value.body["param"] == "messages"
    assert str(tokens) in info.value.body["message"] and "128" in info.value.body["message"]


def test_unknown_model_is_404(live: LiveServer) -> None:
    client = live.client()
    for call in (lambda: client.completions.create(model="gpt-9", prompt="a"),
                 lambda: client.chat.completions.create(model="gpt-9", messages=CHAT),
                 lambda: client.models.retrieve("gpt-9")):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert info.value.body["code"] == "model_not_found" and "gpt-9" in info.value.body["message"]
    with live.http() as http:
        assert _error(http.get("/v1/nothing-here"), 404)["type"] == "invalid_request_error"


def test_api_key_required_on_v1_only(make_live) -> None:
    live = make_live(api_key="sekrit")
    with pytest.raises(openai.AuthenticationError):
        live.client(api_key="wrong").completions.create(model=MODEL, prompt="abc", max_tokens=1)
    err = _error(httpx.post(f"{live.url}/v1/completions", json={"prompt": "abc"}), 401)
    assert err["code"] == "invalid_api_key"
    _error(httpx.get(f"{live.url}/v1/models", headers={"Authorization": "Basic sekrit"}), 401)
    assert live.client().completions.create(model=MODEL, prompt="abc", max_tokens=2).choices[0].text == "de"
    for path in ("/health", "/ready", "/metrics"):  # probes and scrapers carry no key
        assert httpx.get(live.url + path).status_code == 200


def test_body_over_the_limit_is_413(make_live) -> None:
    live = make_live(max_body_bytes=2048)
    body = {"prompt": "a" * 3000}
    with live.http() as http:
        assert _error(http.post("/v1/completions", json=body), 413)["code"] == "request_too_large"

        def chunked():  # no Content-Length: the limit must hold while reading
            yield b'{"prompt": "'
            for _ in range(10):
                yield b"a" * 500
            yield b'"}'

        err = _error(http.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"}), 413)
        assert "2048" in err["message"]
        # Just under the limit still works.
        assert http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 1}).status_code == 200


def test_overload_is_429_with_retry_after(make_live) -> None:
    live = make_live(max_slots=1, max_queue=1, step_sleep_s=0.02)
    with live.http() as first, live.http() as second:
        # The first request holds the only slot (it would take ~2.4 s), the second fills the queue.
        r1 = first.send(first.build_request("POST", "/v1/completions",
                                            json={"prompt": "a", "max_tokens": 120, "stream": True}), stream=True)
        assert wait_for(lambda: live.scheduler.stats().slots_used == 1)
        r2 = second.send(second.build_request("POST", "/v1/completions",
                                              json={"prompt": "a", "max_tokens": 5, "stream": True}), stream=True)
        assert wait_for(lambda: live.scheduler.stats().waiting == 1)
        with pytest.raises(openai.RateLimitError) as info:
            live.client().completions.create(model=MODEL, prompt="abc", max_tokens=1)
        assert int(info.value.response.headers["retry-after"]) >= 1
        assert info.value.body["code"] == "overloaded"
        r1.close()  # frees the slot, so the queued request runs to completion
        assert r2.status_code == 200 and r2.read().endswith(b"data: [DONE]\n\n")
        r2.close()
    assert live.metric("slipstream_rejections_total", reason="overloaded") == 1


def test_not_started_is_503(make_live) -> None:
    live = make_live(start=False)
    with pytest.raises(openai.APIStatusError) as info:
        live.client().completions.create(model=MODEL, prompt="abc", max_tokens=1)
    assert info.value.status_code == 503
    assert info.value.body["code"] == "engine_unavailable"


# ---- issue 12: lone surrogates, strict types, cheap checks first, no internals -------------------


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "a\udfffb"]}, "prompt"),
    ("/v1/completions", {"prompt": "a", "stop": ["\ud800"]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages.0.content"),
])
def test_lone_surrogates_are_400_and_the_connection_stays_usable(live: LiveServer, path: str, body: dict,
                                                                  param: str) -> None:
    # json.dumps writes "\ud800" as an escape, as a client's JSON encoder would.
    raw = json.dumps(body).encode()
    with live.http() as http:
        err = _error(http.post(path, content=raw, headers={"content-type": "application/json"}), 400)
        assert err["param"].startswith(param)
        assert "surrogate" in err["message"] or "unicode" in err["message"].lower()
        # Same keep-alive connection: a 500 used to reset it.
        assert http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2}).json()["choices"][0]["text"] == "de"


@pytest.mark.parametrize("field, value", [("stream", "yes"), ("max_tokens", "10"), ("n", 2.0), ("echo", 1),
                                          ("logprobs", True)])
def test_strings_and_floats_are_not_coerced(live: LiveServer, field: str, value: Any) -> None:
    # OpenAI rejects these too; accepting "yes" as true would hide client bugs.
    with live.http() as http:
        assert _error(http.post("/v1/completions", json={"prompt": "abc", field: value}), 400)["param"] == field


def test_too_many_prompts_are_refused_before_any_is_tokenized(live: LiveServer) -> None:
    tokenizer = CountingTokenizer()
    service = Service(live.scheduler, live.engine, tokenizer, ServiceConfig(model_name=MODEL))
    with pytest.raises(ServiceError) as info:
        prepare_completion(service, CompletionRequest(prompt=["a"] * 200_000))
    assert (info.value.status, info.value.param) == (400, "prompt")  # not `n`
    with pytest.raises(ServiceError) as info:
        prepare_completion(service, CompletionRequest(prompt=["a"] * 40, n=2))
    assert info.value.param == "n"
    with pytest.raises(ServiceError) as info:
        prepare_completion(service, CompletionRequest(prompt="abc", top_p=0.5, presence_penalty=2, n=16,
                                                      best_of=3))
    assert info.value.param == "best_of"
    with pytest.raises(ServiceError):
        prepare_chat(service, ChatCompletionRequest(messages=CHAT, top_logprobs=3))
    assert tokenizer.encoded == 0


def test_a_text_prompt_over_the_byte_limit_is_refused_before_tokenizing(live: LiveServer) -> None:
    tokenizer = CountingTokenizer()
    service = Service(live.scheduler, live.engine, tokenizer, ServiceConfig(model_name=MODEL, max_prompt_bytes=1000))
    with pytest.raises(ServiceError) as info:
        prepare_completion(service, CompletionRequest(prompt="a" * 1001))
    assert (info.value.param, info.value.code) == ("prompt", "context_length_exceeded")
    assert tokenizer.encoded == 0


def test_unexpected_errors_are_500_without_exception_text(make_live) -> None:
    live = make_live()

    def broken(*args: Any, **kwargs: Any) -> list[int]:
        raise RuntimeError("secret internal detail")

    live.service.tokenizer.encode = broken  # type: ignore[method-assign]
    with live.http() as http:
        err = _error(http.post("/v1/completions", json={"prompt": "abc"}), 500)
    assert err["code"] == "internal_error" and err["type"] == "server_error"
    assert "secret" not in err["message"] and "RuntimeError" not in err["message"]
    assert httpx.get(f"{live.url}/ready").status_code == 200


def test_a_request_larger_than_the_queue_is_400_not_429_forever(make_live) -> None:
    # 8 prompts x n=8 is within max_choices (64) but can never fit a queue of 32: a 429 with
    # Retry-After would send the client back forever, even on an idle server.
    live = make_live(max_queue=32)
    with live.http() as http:
        for _ in range(2):
            reply = http.post("/v1/completions", json={"prompt": ["abc"] * 8, "n": 8, "max_tokens": 1})
            err = _error(reply, 400)
            assert "retry-after" not in reply.headers
            assert err["param"] == "n" and "64 queue places" in err["message"] and "holds 32" in err["message"]
        # what fits the queue still runs
        assert len(http.post("/v1/completions", json={"prompt": ["abc"] * 4, "n": 8, "max_tokens": 1}
                             ).json()["choices"]) == 32
