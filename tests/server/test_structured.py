"""Structured output and tools at the OpenAI edge, without a model: which field asks for which
grammar, how tools reach the prompt, and how replies become tool_calls (whole and streamed)."""
from __future__ import annotations

import json

import pytest

from slipstream.server.errors import ServiceError
from slipstream.server.protocol import ChatCompletionRequest, CompletionRequest
from slipstream.server.structured import request_constraint
from slipstream.server.tool_calls import CLOSE, OPEN, ToolStream, parse_reply, tool_plan, with_tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CHAT = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": CHAT, **fields})


@pytest.mark.parametrize("fields, kind, field", [
    ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                                 "schema": {"type": "object"}}}},
     "json_schema", "response_format"),
    ({"guided_json": '{"type": "integer"}'}, "json_schema", "guided_json"),
    ({"guided_regex": "[a-z]+"}, "regex", "guided_regex"),
    ({"guided_choice": ["a", "b"]}, "choice", "guided_choice"),
    ({"guided_grammar": 'start: "x"'}, "grammar", "guided_grammar"),
    ({"structured_outputs": {"choice": ["a"]}}, "choice", "structured_outputs.choice"),
    ({"structured_outputs": {"json": {"type": "object"}}}, "json_schema", "structured_outputs.json"),
])
def test_each_field_asks_for_its_grammar(fields, kind, field):
    for req in (chat(**fields), CompletionRequest.model_validate({"prompt": "p", **fields})):
        c = request_constraint(req)
        assert (c.kind, c.field) == (kind, field)
    assert request_constraint(chat(response_format={"type": "text"})) is None


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
])
def test_malformed_or_several_constraints_are_400s_naming_the_field(fields, param):
    with pytest.raises(ServiceError) as e:
        request_constraint(chat(**fields))
    assert e.value.status == 400 and e.value.param == param


def test_tool_choice_modes():
    assert tool_plan(None, None) is None and tool_plan([WEATHER], "none") is None
    assert tool_plan([WEATHER], None).mode == "auto" and tool_plan([WEATHER], "auto").constraint() is None
    named = tool_plan([WEATHER, CLOCK], {"type": "function", "function": {"name": "get_weather"}}).constraint()
    assert named.kind == "grammar" and '"const": "get_weather"' in named.source and "get_time" not in named.source
    required = tool_plan([WEATHER, CLOCK], "required").constraint().source
    assert '"const": "get_weather"' in required and '"const": "get_time"' in required
    for tools, choice, param in (([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
                                 (None, "required", "tool_choice"), ([{"type": "function"}], "auto", "tools")):
        with pytest.raises(ServiceError) as e:
            tool_plan(tools, choice)
        assert e.value.param == param


def test_tools_reach_the_system_prompt_and_history_renders_as_text():
    plan = tool_plan([WEATHER], "auto")
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    out = with_tools(history, plan)
    assert out[0]["content"].startswith("Be brief.") and '"name": "get_weather"' in out[0]["content"]
    assert out[2]["content"] == f'{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n{CLOSE}'
    assert out[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    assert with_tools(CHAT, plan)[0]["role"] == "system" and len(with_tools(CHAT, plan)) == 2


def test_auto_reply_with_calls_and_text():
    plan = tool_plan([WEATHER, CLOCK], "auto")
    text = (f'Let me check.\n{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Oslo"}}}}\n{CLOSE}\n'
            f'{OPEN}{{"name": "get_time", "arguments": {{}}}}{CLOSE}')
    content, calls = parse_reply(plan, text)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert len({c["id"] for c in calls}) == 2 and all(c["id"].startswith("call_") for c in calls)
    # an unknown function or broken JSON stays text
    assert parse_reply(plan, f'{OPEN}{{"name": "rm", "arguments": {{}}}}{CLOSE}')[1] == []
    assert parse_reply(plan, "plain answer") == ("plain answer", [])


def test_forced_replies_become_calls():
    named = tool_plan([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    forced = f'{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Rome"}}}}\n{CLOSE}'
    content, calls = parse_reply(named, forced)
    assert content is None and [c["function"] for c in calls] == [{"name": "get_weather",
                                                                   "arguments": '{"city": "Rome"}'}]
    required = tool_plan([WEATHER, CLOCK], "required")
    content, calls = parse_reply(required, f'{OPEN}\n{{"name": "get_time", "arguments": {{}}}}\n{CLOSE}')
    assert content is None and calls[0]["function"] == {"name": "get_time", "arguments": "{}"}
    assert parse_reply(required, f'{OPEN}\n{{"name": "get_ti') == (f'{OPEN}\n{{"name": "get_ti', [])  # max_tokens


@pytest.mark.parametrize("cut", [1, 3, 7])
def test_streamed_auto_reply_sends_text_then_call_deltas(cut):
    plan = tool_plan([WEATHER], "auto")
    text = f'Sure. {OPEN}{{"name": "get_weather", "arguments": {{"city": "Oslo"}}}}{CLOSE}'
    stream = ToolStream(plan)
    fed = [stream.feed(text[i:i + cut]) for i in range(0, len(text), cut)]
    sent = "".join(content for content, _ in fed)
    tail, deltas = stream.finish()
    assert sent + tail == "Sure. " and "<" not in sent and not any(calls for _, calls in fed)
    assert deltas[0]["index"] == 0 and deltas[0]["function"]["name"] == "get_weather"
    assert json.loads(deltas[0]["function"]["arguments"]) == {"city": "Oslo"}


def test_streamed_text_that_only_looks_like_a_tag_is_sent_whole():
    stream = ToolStream(tool_plan([WEATHER], "auto"))
    sent = stream.feed("a <tool")[0] + stream.feed("box> b")[0]
    tail, deltas = stream.finish()
    assert sent + tail == "a <toolbox> b" and deltas == []


def test_malformed_tool_calls_in_history_are_a_400_not_a_500(live):
    with live.http() as http:
        body = {"messages": [{"role": "assistant", "content": None, "tool_calls": [{}]}], "max_tokens": 1}
        resp = http.post("/v1/chat/completions", json=body)
        assert resp.status_code == 400 and resp.json()["error"]["param"].startswith("messages")
        # a model without a `tokenizers` tokenizer cannot take a grammar: a 400, not a crash
        resp = http.post("/v1/chat/completions", json={"messages": CHAT, "guided_choice": ["a"]})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "guided_choice"


def test_streamed_named_call_sends_id_and_name_first_then_argument_pieces():
    stream = ToolStream(tool_plan([WEATHER], {"type": "function", "function": {"name": "get_weather"}}))
    pieces = (f'{OPEN}\n{{"name": "get_weather", ', '"arguments": ', '{"city"', ': "Ro', 'me"}', "}\n", CLOSE)
    deltas = [d for piece in pieces for d in stream.feed(piece)[1]]
    assert stream.finish() == ("", [])
    assert deltas[0]["id"].startswith("call_") and deltas[0]["function"]["name"] == "get_weather"
    assert all("id" not in d and "name" not in d["function"] for d in deltas[1:])
    assert json.loads("".join(d["function"]["arguments"] for d in deltas)) == {"city": "Rome"}
    assert len(stream.calls) == 1


def test_model_text_python_cannot_read_as_json_is_content_not_a_crash():
    deep = "[" * 5000 + "]" * 5000
    plan = tool_plan([WEATHER], "auto")
    assert parse_reply(plan, f"{OPEN}{deep}{CLOSE}") == (f"{OPEN}{deep}{CLOSE}", [])
    assert parse_reply(tool_plan([WEATHER], "required"), deep) == (deep, [])
    assert parse_reply(tool_plan([WEATHER], "required"), "1" * 5000) == ("1" * 5000, [])
