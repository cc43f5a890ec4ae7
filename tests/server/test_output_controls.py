"""vLLM's output controls on both endpoints: stop_token_ids, include_stop_str_in_output, skip_special_tokens, and on
chat add_generation_prompt / continue_final_message (a prefilled assistant reply the model goes on with); the vLLM
fields this server does not implement are 400s naming them unless left at their neutral value.

MockEngine continues a prompt byte by byte ("abc" -> "def..."; id 256 is ByteTokenizer's BOS, a special token,
257 its EOS)."""
from __future__ import annotations

import json

import pytest

from tests.server.conftest import LiveServer


def complete(live: LiveServer, **body) -> dict:
    with live.http() as http:
        r = http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 6, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_stop_token_ids_end_the_output_without_their_text(live: LiveServer) -> None:
    out = complete(live, stop_token_ids=[ord("g"), 250])
    assert out["choices"][0]["text"] == "def" and out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == 4  # the stop token is generated, and counted


def test_include_stop_str_in_output_keeps_the_matched_stop_string(live: LiveServer) -> None:
    assert complete(live, stop=["fg", "x"])["choices"][0]["text"] == "de"
    assert complete(live, stop=["fg", "x"], include_stop_str_in_output=True)["choices"][0]["text"] == "defg"
    with live.http() as http, http.stream("POST", "/v1/completions", json={
            "prompt": "abc", "max_tokens": 6, "stop": ["fg"], "include_stop_str_in_output": True, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == "defg"


def test_skip_special_tokens_false_shows_them(live: LiveServer) -> None:
    # [255] continues with 256 (BOS: special) and then 257 (EOS: ends the output, never shown)
    assert complete(live, prompt=[255])["choices"][0]["text"] == ""
    assert complete(live, prompt=[255], skip_special_tokens=False)["choices"][0]["text"] == "<s>"


def test_continue_final_message_goes_on_with_the_assistants_prefilled_reply(live: LiveServer) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, here"}]
    with live.http() as http:
        r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3,
                                                    "continue_final_message": True, "add_generation_prompt": False})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "fgh"  # after the final "e"
        assert r.json()["usage"]["prompt_tokens"] == len("<user>hi\n<assistant>Sure, here")  # no end of turn
        r = http.post("/v1/chat/completions", json={"messages": messages[:1], "max_tokens": 1,
                                                    "add_generation_prompt": False})
        assert r.json()["usage"]["prompt_tokens"] == len("<user>hi\n")  # no assistant turn opened
        for body in ({"messages": messages, "continue_final_message": True},  # add_generation_prompt still true
                     {"messages": messages[:1], "continue_final_message": True, "add_generation_prompt": False},
                     {"messages": [*messages[:1], {"role": "assistant", "content": ""}],
                      "continue_final_message": True, "add_generation_prompt": False}):
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] in ("continue_final_message", "messages"), r.text


def test_min_tokens_keeps_stop_strings_from_ending_the_first_tokens(live: LiveServer) -> None:
    """(The engine masks EOS and stop tokens before min_tokens: tests/engine/test_runner.py; MockEngine's replies
    ignore masks.) "f" is the third token: a stop string from the min_tokens-th token on."""
    assert complete(live, stop=["f"], min_tokens=3)["choices"][0]["text"] == "de"
    assert complete(live, stop=["f"], min_tokens=4)["choices"][0]["text"] == "defghi"
    assert complete(live, stop=["d"], min_tokens=2)["choices"][0]["text"] == "defghi"  # "d" came too early
    with live.http() as http:
        r = http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "min_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text


@pytest.mark.parametrize("field, value", [("use_beam_search", True), ("bad_words", ["x"]), ("prompt_logprobs", 1),
                                          ("stop_token_ids", [258]), ("allowed_token_ids", [258]),
                                          ("allowed_token_ids", [])])
def test_what_is_not_implemented_is_a_400_naming_it_and_neutral_values_pass(live: LiveServer, field, value) -> None:
    neutral = {"use_beam_search": False, "allowed_token_ids": None, "bad_words": [],
               "prompt_logprobs": None, "stop_token_ids": []}[field]
    with live.http() as http:
        for route, body in (("/v1/completions", {"prompt": "abc"}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            r = http.post(route, json={**body, "max_tokens": 2, field: value})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
            assert http.post(route, json={**body, "max_tokens": 2, field: neutral}).status_code == 200


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(live: LiveServer) -> None:
    out = complete(live, max_tokens=2, logprobs=1, return_tokens_as_token_ids=True)
    lps = out["choices"][0]["logprobs"]
    assert lps["tokens"] == ["token_id:100", "token_id:101"] and out["choices"][0]["text"] == "de"
    assert set(lps["top_logprobs"][0]) == {"token_id:100"}
    with live.http() as http:
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                                    "logprobs": True, "top_logprobs": 2,
                                                    "return_tokens_as_token_ids": True})
    first = r.json()["choices"][0]["logprobs"]["content"][0]
    assert first["token"] == "token_id:63" and first["bytes"] == list(b"token_id:63")
    assert [t["token"] for t in first["top_logprobs"]] == ["token_id:63", "token_id:64"]


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(live: LiveServer) -> None:
    for route, body in (("/v1/completions", {"prompt": "abc"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        with live.http() as http, http.stream("POST", route, json={
                **body, "max_tokens": 4, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        counted = [e["usage"]["completion_tokens"] for e in events if e["choices"] and e["usage"]]
        assert counted == sorted(counted) and counted[-1] == 4, (route, counted)
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4
