"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API) against the mock server, over raw HTTP
and SSE (the anthropic SDK is not a test dependency): the same reply as the chat route for the same conversation,
whole and as typed stream events; thinking, tool_use and tool_result blocks; stop sequences; x-api-key; errors in
Anthropic's shape naming the Messages field; disconnects and engine failures mid-stream."""
from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from slipstream.engine.grammar_cost import MAX_SCHEMA_DEPTH
from tests.server.conftest import MODEL, PieceTokenizer, wait_for
from tests.server.test_reasoning import TEMPLATE, ThinkTokenizer
# the servers (live: room for tools and a whole mock reply; think_live: ThinkTokenizer's scripted thinking;
# grammar_live: a real tokenizer, so that constraints compile) and the chat route's reply
from tests.server.test_responses import chat, grammar_live, live, think_live  # noqa: F401 - fixtures
from tests.server.test_responses import sse_events as responses_sse_events

WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                 "parameters": WEATHER["input_schema"]}}


def post(live, path: str = "/v1/messages", **body: Any) -> httpx.Response:
    with live.http() as http:
        return http.post(path, json=body)


def message(live, **body: Any) -> dict[str, Any]:
    r = post(live, model=MODEL, **body)
    assert r.status_code == 200, r.text
    return r.json()


def count(live, **body: Any) -> int:
    r = post(live, "/v1/messages/count_tokens", **body)
    assert r.status_code == 200, r.text
    return r.json()["input_tokens"]


def sse_events(live, **body: Any) -> list[dict[str, Any]]:
    return responses_sse_events(live, "/v1/messages", **body)


def built(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The message the events add up to, as a client's stream helper builds it."""
    out = dict(events[0]["message"], content=[])
    partial: dict[int, str] = {}
    for e in events[1:]:
        if e["type"] == "content_block_start":
            assert e["index"] == len(out["content"])
            out["content"].append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta":
            block, delta = out["content"][e["index"]], e["delta"]
            if delta["type"] == "input_json_delta":
                partial[e["index"]] = partial.get(e["index"], "") + delta["partial_json"]
            else:
                field = {"text_delta": "text", "thinking_delta": "thinking"}[delta["type"]]
                block[field] += delta[field]
        elif e["type"] == "content_block_stop" and e["index"] in partial:
            out["content"][e["index"]]["input"] = json.loads(partial[e["index"]])
        elif e["type"] == "message_delta":
            out.update(e["delta"])
            out["usage"] = {**out["usage"], **e["usage"]}
    return out


def same(msg: dict[str, Any]) -> dict[str, Any]:
    """A message without what differs between two runs (its id, its tool calls' ids, how much of its input a run
    before left in the prefix cache)."""
    return {**msg, "id": None, "content": [{**b, "id": None} if "id" in b else b for b in msg["content"]],
            "usage": {"input": all_input(msg), "output_tokens": msg["usage"]["output_tokens"]}}


def all_input(msg: dict[str, Any]) -> int:
    """The message's input tokens, read from the cache or not (Anthropic's input_tokens counts those not read)."""
    return msg["usage"]["input_tokens"] + msg["usage"]["cache_read_input_tokens"]


# ---- text ----------------------------------------------------------------------------------------

def test_a_text_reply_equals_the_chat_routes(live):
    out = message(live, max_tokens=9, system=[{"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}],
                  messages=[{"role": "user", "content": [{"type": "text", "text": "Name "},
                                                         {"type": "text", "text": "three colours."}]},
                            {"role": "assistant", "content": "Red."}, {"role": "user", "content": "More?"}],
                  metadata={"user_id": "u1"}, service_tier="auto")
    reply = chat(live, [{"role": "system", "content": "You are terse."},
                        {"role": "user", "content": "Name three colours."}, {"role": "assistant", "content": "Red."},
                        {"role": "user", "content": "More?"}], max_tokens=9)
    assert out["content"] == [{"type": "text", "text": reply["choices"][0]["message"]["content"]}]
    assert out["content"][0]["text"] == "?@ABCDEFG"
    assert out["id"].startswith("msg_") and (out["type"], out["role"], out["model"]) == ("message", "assistant", MODEL)
    assert (out["stop_reason"], out["stop_sequence"]) == ("max_tokens", None)
    assert all_input(out) == reply["usage"]["prompt_tokens"] and out["usage"]["output_tokens"] == 9


def test_a_reply_that_ends_is_end_turn(live):
    out = message(live, max_tokens=1000, messages=[{"role": "user", "content": "abc"}])  # the mock runs on to EOS
    reply = chat(live, [{"role": "user", "content": "abc"}], max_tokens=1000)
    assert reply["choices"][0]["finish_reason"] == "stop" and out["stop_reason"] == "end_turn"
    assert out["content"][0]["text"] == reply["choices"][0]["message"]["content"]
    assert out["usage"]["output_tokens"] == reply["usage"]["completion_tokens"]


def test_stream_events_come_in_order_and_add_up_to_the_message(make_live):
    live = make_live(step_sleep_s=0.005)
    ask = {"max_tokens": 8, "messages": [{"role": "user", "content": "abc"}]}
    events = sse_events(live, **ask)
    kinds = [e["type"] for e in events]
    deltas = [e["delta"]["text"] for e in events if e["type"] == "content_block_delta"]
    assert len(deltas) > 1  # token by token
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * len(deltas),
                     "content_block_stop", "message_delta", "message_stop"]
    start = events[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert events[1]["content_block"] == {"type": "text", "text": ""}
    assert events[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert same(built(events)) == same(message(live, **ask)) and "".join(deltas) == "?@ABCDEF"


# ---- stop sequences -------------------------------------------------------------------------------

def test_a_stop_sequence_ends_the_reply_and_is_named(live):
    ask = [{"role": "user", "content": "abc"}]
    out = message(live, max_tokens=20, messages=ask, stop_sequences=["CD", "BCD", "zz"])
    assert chat(live, ask, max_tokens=20, stop=["CD", "BCD", "zz"])["choices"][0]["message"]["content"] == "?@A"
    # the earliest match, "BCD", not cut from the text, and not the shorter "CD" it ends with
    assert (out["content"], out["stop_reason"], out["stop_sequence"]) == (
        [{"type": "text", "text": "?@A"}], "stop_sequence", "BCD")
    events = sse_events(live, max_tokens=20, messages=ask, stop_sequences=["CD", "BCD"])
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "BCD"}
    assert same(built(events)) == same(out)
    unmatched = message(live, max_tokens=3, messages=ask, stop_sequences=["zz"])
    assert (unmatched["content"][0]["text"], unmatched["stop_reason"], unmatched["stop_sequence"]) == (
        "?@A", "max_tokens", None)


def test_a_final_assistant_message_is_continued(live):
    ask = [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "xy"}]
    out = message(live, max_tokens=3, messages=ask)
    reply = chat(live, ask, max_tokens=3, add_generation_prompt=False, continue_final_message=True)
    assert out["content"][0]["text"] == reply["choices"][0]["message"]["content"] == "z{|"
    assert count(live, messages=ask) == all_input(out) == reply["usage"]["prompt_tokens"]
    empty = message(live, max_tokens=3,
                    messages=[ask[0], {"role": "assistant", "content": [{"type": "text", "text": ""}]}])
    assert same(empty) == same(message(live, max_tokens=3, messages=ask[:1]))  # an empty prefill is none


# ---- thinking --------------------------------------------------------------------------------------

def test_a_reasoning_models_thinking_is_a_thinking_block(think_live):
    ask = {"max_tokens": 50, "messages": [{"role": "user", "content": "What is 2+2?"}]}
    out = message(think_live, **ask)
    assert out["content"] == [{"type": "thinking", "thinking": "Let me see.", "signature": ""},
                              {"type": "text", "text": "The answer is 4."}]
    assert (out["stop_reason"], out["usage"]["output_tokens"]) == ("end_turn", 8)
    events = sse_events(think_live, **ask)
    blocks = [(e["index"], e["delta"]["type"]) for e in events if e["type"] == "content_block_delta"]
    assert blocks == sorted(blocks) and {b for b in blocks} == {(0, "thinking_delta"), (1, "text_delta")}
    stops = [i for i, e in enumerate(events) if e["type"] == "content_block_stop"]
    assert events[stops[0] + 1] == {"type": "content_block_start", "index": 1,
                                    "content_block": {"type": "text", "text": ""}}
    assert same(built(events)) == same(out)


def test_thinking_disabled_reaches_the_template(think_live):
    out = message(think_live, max_tokens=50, messages=[{"role": "user", "content": "What is 2+2?"}],
                  thinking={"type": "disabled"})
    assert out["content"] == [{"type": "text", "text": "The answer is 4."}]
    enabled = {"max_tokens": 50, "messages": [{"role": "user", "content": "What is 2+2?"}],
               "thinking": {"type": "enabled", "budget_tokens": 1024}}
    assert message(think_live, **enabled)["content"][0]["type"] == "thinking"


def test_earlier_thinking_blocks_reach_the_prompt_as_reasoning_content(think_live):
    turns = [{"role": "user", "content": "Hi"},
             {"role": "assistant", "content": [{"type": "thinking", "thinking": "Greet.", "signature": "sig"},
                                               {"type": "redacted_thinking", "data": "opaque"},
                                               {"type": "text", "text": "Hello."}]},
             {"role": "user", "content": "More?"}]
    reply = chat(think_live, [turns[0], {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet."},
                              turns[2]], max_tokens=1)
    assert count(think_live, messages=turns) == reply["usage"]["prompt_tokens"]
    without = [turns[0], {"role": "assistant", "content": "Hello."}, turns[2]]
    assert count(think_live, messages=without) == reply["usage"]["prompt_tokens"] - len("[Greet.]")


# ---- tools ------------------------------------------------------------------------------------------

TOOL_PIECES = {260: "<|assistant|>", 261: "<tool_call>", 262: '\n{"name": "get_weather", "arguments": ',
               263: '{"city": "Paris"}}', 264: "\n</tool_call>"}


class ToolTokenizer(PieceTokenizer):
    """The mock engine's reply to a prompt ending in <|assistant|> is one get_weather call for Paris, then EOS."""

    def __init__(self) -> None:
        super().__init__(TOOL_PIECES, 265, TEMPLATE)


def test_a_tool_call_is_a_tool_use_block(make_live):
    live = make_live(tokenizer=ToolTokenizer(), max_seq_len=1024, num_pages=512)
    ask = {"max_tokens": 50, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER]}
    out = message(live, **ask)
    reply = chat(live, ask["messages"], tools=[CHAT_WEATHER], max_tokens=50)
    [call] = reply["choices"][0]["message"]["tool_calls"]
    [block] = out["content"]
    assert block == {"type": "tool_use", "id": block["id"], "name": "get_weather", "input": {"city": "Paris"}}
    assert json.loads(call["function"]["arguments"]) == block["input"]
    assert block["id"].startswith("toolu_") and out["stop_reason"] == "tool_use"
    events = sse_events(live, **ask)
    assert events[1]["content_block"] == {**block, "id": events[1]["content_block"]["id"], "input": {}}
    assert [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"] == ["input_json_delta"]
    assert same(built(events)) == same(out) and events[-2]["delta"]["stop_reason"] == "tool_use"


def test_a_forced_tool_is_a_tool_use_block_with_the_chat_routes_arguments(grammar_live):
    ask = {"max_tokens": 6, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER],
           "tool_choice": {"type": "tool", "name": "get_weather"}}
    reply = chat(grammar_live, ask["messages"], tools=[CHAT_WEATHER], max_tokens=6,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = reply["choices"][0]["message"]["tool_calls"]
    events = sse_events(grammar_live, **ask)
    block = events[1]["content_block"]
    assert (block["type"], block["name"], block["input"]) == ("tool_use", "get_weather", {})
    assert block["id"].startswith("toolu_")
    partial = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(partial) == call["function"]["arguments"]
    out = message(grammar_live, **ask)  # cut by max_tokens inside the arguments: no whole input to show
    assert [(b["type"], b["name"], b["input"]) for b in out["content"]] == [("tool_use", "get_weather", {})]
    assert out["stop_reason"] == events[-2]["delta"]["stop_reason"] == "max_tokens"


def test_tool_use_and_tool_result_history_reaches_the_prompt(live):
    turns = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                               {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                "input": {"city": "Paris"}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                           "content": "18 C and sunny"}, {"type": "text", "text": "Thanks."}]}]
    reply = chat(live, [turns[0], {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C and sunny"},
                        {"role": "user", "content": "Thanks."}], tools=[CHAT_WEATHER], max_tokens=3)
    counted = count(live, messages=turns, tools=[WEATHER])
    out = message(live, messages=turns, tools=[WEATHER], max_tokens=3)
    assert counted == all_input(out) == reply["usage"]["prompt_tokens"]
    assert out["content"][0]["text"] == reply["choices"][0]["message"]["content"]
    blocks = [{"type": "text", "text": "18 C and sunny"}, {"type": "text", "text": "!!"}]
    longer = [*turns[:2], {"role": "user", "content": [{**turns[2]["content"][0], "content": blocks, "is_error": True},
                                                       turns[2]["content"][1]]}]
    assert count(live, messages=longer, tools=[WEATHER]) == counted + 2


# ---- errors ---------------------------------------------------------------------------------------

HI = [{"role": "user", "content": "hi"}]
TOOL = {"name": "f", "input_schema": {"type": "object"}}
DEEP: dict[str, Any] = {"type": "object"}
for _ in range(MAX_SCHEMA_DEPTH + 1):
    DEEP = {"type": "object", "properties": {"a": DEEP}}
BAD = [
    ({"messages": HI}, "max_tokens"),
    ({"messages": HI, "max_tokens": 0}, "max_tokens"),
    ({"messages": [], "max_tokens": 5}, "messages"),
    ({"messages": [{"role": "user", "content": []}], "max_tokens": 5}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}], "max_tokens": 5}, "messages.0.role"),
    ({"messages": [*HI, {"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 5},
     "messages.1.content.0.source"),
    # an image to a text-only model (tests/server/test_images.py: a vision-language model's)
    ({"messages": [*HI, {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}], "max_tokens": 5}, "messages.1.content.1"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "document"}]}],
      "max_tokens": 5}, "messages.0.content.1.type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}],
      "max_tokens": 5}, "messages.0.content.0.type"),
    ({"messages": [*HI, {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}],
      "max_tokens": 5}, "messages.1.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}], "max_tokens": 5},
     "messages.0.content.0.text"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {}}]}]}], "max_tokens": 5}, "messages.0.content.0.content.0.type"),
    ({"messages": [*HI, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                           "input": "x"}]}], "max_tokens": 5},
     "messages.1.content.0.input"),
    ({"messages": HI, "system": [{"type": "image"}], "max_tokens": 5}, "system.0.type"),
    ({"messages": HI, "max_tokens": 5, "temperature": 1.5}, "temperature"),
    ({"messages": HI, "max_tokens": 5, "stop_sequences": ["x"] * 9}, "stop_sequences"),
    ({"messages": HI, "max_tokens": 2000}, "messages"),
    ({"messages": HI, "max_tokens": 5, "tools": [TOOL, {"type": "web_search_20250305", "name": "web_search"}]},
     "tools.1.type"),
    ({"messages": HI, "max_tokens": 5, "tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ({"messages": HI, "max_tokens": 5, "tools": [TOOL, {"name": "g", "input_schema": DEEP}],
      "tool_choice": {"type": "any"}}, "tools.1.input_schema"),
    ({"messages": HI, "max_tokens": 5, "tools": [TOOL], "tool_choice": {"type": "tool", "name": "g"}},
     "tool_choice.name"),
    ({"messages": HI, "max_tokens": 5, "tools": [TOOL], "tool_choice": {"type": "some"}}, "tool_choice.type"),
    ({"messages": HI, "max_tokens": 5, "thinking": {"type": "maybe"}}, "thinking.type"),
    ({"messages": HI, "max_tokens": 5, "metadata": {"user_id": 7}}, "metadata.user_id"),
]


@pytest.mark.parametrize("body, field", BAD, ids=[f for _, f in BAD])
def test_bad_requests_are_400s_in_anthropics_shape_naming_the_field(live, body, field):
    r = post(live, **body)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error", r.text
    message = r.json()["error"]["message"]
    assert message.startswith((f"{field}: ", f"{field} ")), message
    for chat_name in ("tool_calls", "function", "max_completion_tokens", "continue_final_message", "parameters",
                      "chat_template_kwargs"):
        assert chat_name not in message, message


def test_the_openapi_document_shows_anthropics_error_shape(live):
    with live.http() as http:
        spec = http.get("/openapi.json").json()
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        responses = spec["paths"][path]["post"]["responses"]
        assert {"400", "401", "404", "413", "429", "500", "503"} <= set(responses)
        assert all(responses[s]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/"
                                                                             "AnthropicError"}
                   for s in ("400", "401", "413", "429", "503"))


def test_count_tokens_needs_no_max_tokens_and_has_the_same_errors(live):
    assert count(live, messages=HI) == chat(live, HI, max_tokens=1)["usage"]["prompt_tokens"]
    r = post(live, "/v1/messages/count_tokens", messages=[{"role": "user", "content": [{"type": "image"}]}])
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages.0.content.0.source: ")


def test_an_unknown_model_is_a_404_in_anthropics_shape(live):
    r = post(live, model="claude-sonnet-4-5", max_tokens=5, messages=HI)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert r.json()["error"]["message"].startswith("model: ")


def test_x_api_key_authenticates_and_a_wrong_key_is_a_401_in_anthropics_shape(make_live):
    live = make_live(api_key="secret", max_body_bytes=4096)
    ask = {"max_tokens": 2, "messages": HI}
    with httpx.Client(base_url=live.url, timeout=10) as http:
        assert http.post("/v1/messages", json=ask, headers={"x-api-key": "secret"}).status_code == 200
        assert http.post("/v1/messages", json=ask, headers={"Authorization": "Bearer secret"}).status_code == 200
        for headers in ({"x-api-key": "wrong"}, {}):
            r = http.post("/v1/messages", json=ask, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
        assert http.post("/v1/messages/count_tokens", json={"messages": HI},
                         headers={"x-api-key": "secret"}).status_code == 200
        # Anthropic's header is for Anthropic's routes; the others keep OpenAI's
        r = http.post("/v1/chat/completions", json={"messages": HI}, headers={"x-api-key": "secret"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = http.post("/v1/messages", json={**ask, "system": "x" * 5000}, headers={"x-api-key": "secret"})
        assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
        r = http.post("/v1/messages", content=b"{", headers={"x-api-key": "secret"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


# ---- the stream's end --------------------------------------------------------------------------------

def test_a_client_that_disconnects_mid_stream_frees_its_slot(make_live):
    live = make_live(step_sleep_s=0.01)
    body = {"max_tokens": 100, "stream": True, "messages": [{"role": "user", "content": "a"}]}
    with live.http() as http, http.stream("POST", "/v1/messages", json=body) as r:
        assert any("text_delta" in line for line in r.iter_lines())
        assert live.scheduler.stats().slots_used == 1
    assert wait_for(lambda: live.scheduler.stats().slots_used == 0, timeout=1.0)
    assert live.scheduler.stats().cancellations == 1 and live.scheduler.stats().generated_tokens < 90


def test_an_engine_failure_mid_stream_ends_it_with_an_error_event(make_live):
    live = make_live(step_sleep_s=0.01, exit_on_engine_failure=False)
    body = {"max_tokens": 100, "stream": True, "messages": [{"role": "user", "content": "a"}]}
    with live.http() as http, http.stream("POST", "/v1/messages", json=body) as r:
        lines = r.iter_lines()
        assert any("text_delta" in line for line in lines)
        live.engine.fail_after_steps = 0
        rest = [line for line in lines if line]
    assert rest[-2] == "event: error"
    error = json.loads(rest[-1].removeprefix("data: "))
    assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"
    assert "injected" not in error["error"]["message"] and "message_stop" not in "".join(rest)


def test_messages_are_counted_under_their_route(make_live):
    live = make_live()
    assert post(live, max_tokens=2, messages=HI).status_code == 200
    assert post(live, max_tokens=2, messages=[]).status_code == 400
    assert post(live, "/v1/messages/count_tokens", messages=HI).status_code == 200
    assert live.metric("slipstream_http_responses_total", route="/v1/messages", status_class="2xx") == 1
    assert live.metric("slipstream_http_responses_total", route="/v1/messages", status_class="4xx",
                       code="invalid_value") == 1
    assert live.metric("slipstream_http_responses_total", route="/v1/messages/count_tokens", status_class="2xx") == 1
