"""POST /v1/responses (OpenAI's Responses API) against the mock server, with the `openai` client: the same reply as
the chat route for the same conversation, whole and as typed stream events; reasoning, function-call and
structured-output translation; errors naming the Responses field; disconnects and engine failures mid-stream."""
from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from slipstream.server import openai_api
from slipstream.server.errors import ServiceError
from slipstream.server.response_store import ResponseStore
from tests.server.conftest import MODEL, start_live, wait_for
from tests.server.test_reasoning import ThinkTokenizer

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}


def chat(live, messages: list[dict[str, Any]], **body: Any) -> dict[str, Any]:
    with live.http() as http:
        r = http.post("/v1/chat/completions", json={"messages": messages, **body})
    assert r.status_code == 200, r.text
    return r.json()


def post(live, **body: Any) -> httpx.Response:
    with live.http() as http:
        return http.post("/v1/responses", json=body)


def sse_events(live, path: str = "/v1/responses", **body: Any) -> list[dict[str, Any]]:
    """The stream's events as sent: each `event:` line names its data's type."""
    with live.http() as http, http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        blocks = [b for b in r.read().decode().split("\n\n") if b]
    events = []
    for block in blocks:
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        events.append(json.loads(data[6:]))
        assert events[-1]["type"] == name[7:]
    return events


@pytest.fixture(scope="module")
def live():
    server = start_live(max_seq_len=1024, num_pages=512)  # room for tools and a whole mock reply up to EOS
    yield server
    server.stop()


@pytest.fixture(scope="module")
def think_live():
    server = start_live(tokenizer=ThinkTokenizer())
    yield server
    server.stop()


# ---- text ----------------------------------------------------------------------------------------

def test_text_output_equals_the_chat_routes_reply(live):
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name "},
                                                            {"type": "input_text", "text": "three colours."}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Red."}]},
             {"role": "user", "content": "More?"}]
    out = live.client().responses.create(model=MODEL, instructions="You are terse.", input=items,
                                         max_output_tokens=9, metadata={"run": "7"})
    reply = chat(live, [{"role": "system", "content": "You are terse."}, {"role": "developer", "content": "Be brief."},
                        {"role": "user", "content": "Name three colours."}, {"role": "assistant", "content": "Red."},
                        {"role": "user", "content": "More?"}], max_tokens=9)
    assert out.output_text == reply["choices"][0]["message"]["content"] == "?@ABCDEFG"
    assert out.id.startswith("resp_") and out.object == "response" and out.model == MODEL
    assert (out.status, out.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    [message] = out.output
    assert (message.type, message.role, message.status) == ("message", "assistant", "incomplete")
    assert message.id.startswith("msg_") and message.content[0].annotations == []
    usage = out.usage
    assert (usage.input_tokens, usage.output_tokens) == (reply["usage"]["prompt_tokens"], 9)
    assert usage.total_tokens == usage.input_tokens + 9 and usage.output_tokens_details.reasoning_tokens == 0
    assert (out.instructions, out.max_output_tokens, out.metadata, out.tools) == ("You are terse.", 9, {"run": "7"}, [])


def test_a_reply_that_ends_is_completed(live):
    out = live.client().responses.create(model=MODEL, input="abc")  # the mock runs on to EOS
    reply = chat(live, [{"role": "user", "content": "abc"}])
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert (out.status, out.incomplete_details, out.output[0].status) == ("completed", None, "completed")
    assert out.output_text == reply["choices"][0]["message"]["content"]
    assert out.usage.output_tokens == reply["usage"]["completion_tokens"]


def test_stream_events_come_in_order_and_add_up_to_the_response(make_live):
    live = make_live(step_sleep_s=0.005)
    with live.client().responses.create(model=MODEL, input="abc", max_output_tokens=8, stream=True) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1  # token by token
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events if hasattr(e, "item_id"))
    done = events[-1].response
    text = live.client().responses.create(model=MODEL, input="abc", max_output_tokens=8).output_text
    assert "".join(deltas) == events[-4].text == done.output_text == text == "?@ABCDEF"
    assert done.output[0].id == item_id and done.usage.output_tokens == 8


# ---- reasoning -----------------------------------------------------------------------------------

def test_a_reasoning_models_thinking_is_a_reasoning_item(think_live):
    out = think_live.client().responses.create(model=MODEL, input="What is 2+2?")
    assert [item.type for item in out.output] == ["reasoning", "message"]
    thinking = out.output[0]
    assert thinking.id.startswith("rs_") and thinking.summary == []
    assert [(c.type, c.text) for c in thinking.content] == [("reasoning_text", "Let me see.")]
    assert out.output_text == "The answer is 4." and out.status == "completed"
    # <think>, two pieces of thought and </think>, of 8 tokens (the answer's two and EOS)
    assert (out.usage.output_tokens, out.usage.output_tokens_details.reasoning_tokens) == (8, 4)


def test_a_streamed_reasoning_item_comes_before_the_answer(think_live):
    events = sse_events(think_live, input="What is 2+2?")
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert events[2]["item"]["type"] == "reasoning" and events[3]["part"] == {"type": "reasoning_text", "text": ""}
    thinking_done = kinds.index("response.reasoning_text.done")
    assert kinds.index("response.output_text.delta") > thinking_done
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "Let me see."
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "The answer is 4."
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1]
    final = events[-1]["response"]
    whole = post(think_live, input="What is 2+2?").json()
    same = lambda items: [{k: v for k, v in item.items() if k != "id"} for item in items]  # noqa: E731
    assert same(final["output"]) == same(whole["output"]) and final["usage"] == whole["usage"]
    # the openai client's stream helper builds the response from the events alone
    with think_live.client().responses.stream(model=MODEL, input="What is 2+2?") as stream:
        built = stream.get_final_response()
    assert [item.type for item in built.output] == ["reasoning", "message"]
    assert (built.output[0].content[0].text, built.output_text) == ("Let me see.", "The answer is 4.")


# ---- function calls --------------------------------------------------------------------------------

def test_function_calls_and_their_outputs_reach_the_prompt(live):
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": "Let me look."}, call,
             {"type": "reasoning", "id": "rs_1", "summary": []},  # accepted, not shown again
             {"type": "function_call_output", "call_id": "call_1", "output": "18 C and sunny"}]
    out = live.client().responses.create(model=MODEL, input=items, tools=[WEATHER], max_output_tokens=3)
    reply = chat(live, [{"role": "user", "content": "Weather in Paris?"},
                        {"role": "assistant", "content": "Let me look.", "tool_calls": [
                            {"id": "call_1", "type": "function",
                             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}],
                 tools=[CHAT_WEATHER], max_tokens=3)
    assert out.usage.input_tokens == reply["usage"]["prompt_tokens"]
    assert out.output_text == reply["choices"][0]["message"]["content"]
    longer = [*items[:-1], {**items[-1], "output": [{"type": "input_text", "text": "18 C and sunny!!"}]}]
    again = live.client().responses.create(model=MODEL, input=longer, tools=[WEATHER], max_output_tokens=3)
    assert again.usage.input_tokens == out.usage.input_tokens + 2


@pytest.fixture(scope="module")
def grammar_live(default_tokenizer):
    """The mock engine under a real tokenizer, so that constraints compile (the mock does not follow them)."""
    server = start_live(tokenizer=default_tokenizer, max_seq_len=512, num_pages=256)
    yield server
    server.stop()


def test_a_forced_function_call_is_a_function_call_item(grammar_live):
    ask = "Weather in Paris?"
    out = grammar_live.client().responses.create(model=MODEL, input=ask, tools=[WEATHER], max_output_tokens=6,
                                                 tool_choice={"type": "function", "name": "get_weather"})
    reply = chat(grammar_live, [{"role": "user", "content": ask}], tools=[CHAT_WEATHER], max_tokens=6,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [expected] = reply["choices"][0]["message"]["tool_calls"]
    [item] = out.output
    assert (item.type, item.name, item.arguments) == ("function_call", "get_weather",
                                                      expected["function"]["arguments"])
    assert item.id.startswith("fc_") and item.call_id.startswith("call_") and out.output_text == ""
    assert out.tools[0].name == "get_weather" and out.tool_choice.name == "get_weather"
    events = sse_events(grammar_live, input=ask, tools=[WEATHER], max_output_tokens=6,
                        tool_choice={"type": "function", "name": "get_weather"})
    kinds = [e["type"] for e in events]
    assert kinds[2] == "response.output_item.added" and events[2]["item"]["name"] == "get_weather"
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert "".join(deltas) == done["arguments"] == item.arguments
    assert kinds[-2:] == ["response.output_item.done", "response.incomplete"]


def test_text_format_json_schema_reaches_the_constraint(grammar_live, monkeypatch):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    r = post(grammar_live, input="hi", max_output_tokens=4,
             text={"format": {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}})
    assert r.status_code == 200, r.text
    assert r.json()["text"]["format"]["name"] == "thing"
    r = post(grammar_live, input="hi", text={"format": {"type": "json_schema", "name": "t", "schema": {"type": 7}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format", r.text
    assert "response_format" not in r.json()["error"]["message"]
    seen = []

    def capture(service, constraint):
        seen.append(constraint)
        raise ServiceError(400, "captured", param="response_format")

    monkeypatch.setattr(openai_api, "compile_constraint", capture)
    assert post(grammar_live, input="hi", text={"format": {"type": "json_schema", "name": "t", "schema": schema}}
                ).json()["error"]["param"] == "text.format"
    assert post(grammar_live, input="hi", text={"format": {"type": "json_object"}}).status_code == 400
    assert [(c.kind, c.source) for c in seen] == [("json_schema", schema), ("json_object", None)]


# ---- errors --------------------------------------------------------------------------------------

TOOL = {"type": "function", "name": "f"}
BAD = [
    ({"input": []}, "input", "invalid_value"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type", "unsupported"),
    ({"input": ["hi"]}, "input[0]", "invalid_value"),
    # an image to a text-only model (tests/server/test_images.py: a vision-language model's)
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]",
     "unsupported"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input[0].content[0].text",
     "invalid_value"),
    ({"input": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "hi"}]}, "input[1].role",
     "invalid_value"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments", "invalid_value"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c", "name": "f",
                                                     "arguments": "[" * 100_000}]}, "input[1].arguments",
     "invalid_value"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
    ({"input": "hi", "max_output_tokens": 2000}, "input", "context_length_exceeded"),
    ({"input": "x" * 1200}, "input", "context_length_exceeded"),
    ({"input": "hi", "temperature": 3}, "temperature", "invalid_value"),
    ({"input": "hi", "tools": [TOOL, {"type": "web_search"}]}, "tools[1].type", "unsupported"),
    ({"input": "hi", "tools": [TOOL, TOOL, {"type": "function"}]}, "tools[2].name", "invalid_value"),
    ({"input": "hi", "tools": [{**TOOL, "parameters": [1]}]}, "tools[0].parameters", "invalid_value"),
    ({"input": "hi", "tools": [TOOL], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice",
     "invalid_value"),
    ({"input": "hi", "tools": [TOOL], "tool_choice": {"type": "file_search"}}, "tool_choice", "invalid_value"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "invalid_value"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format", "invalid_value"),
    ({"input": "hi", "tools": [TOOL], "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
     "text.format", "invalid_value"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation", "unsupported"),
    ({"input": "hi", "truncation": "auto"}, "truncation", "unsupported"),
    ({"input": "hi", "background": True}, "background", "unsupported"),
]


@pytest.mark.parametrize("body, param, code", BAD, ids=[p for _, p, _ in BAD])
def test_bad_requests_are_400s_naming_the_responses_field(live, body, param, code):
    r = post(live, **body)
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code), r.text
    for chat_name in ("messages", "max_tokens", "max_completion_tokens", "response_format", "function."):
        assert chat_name not in r.json()["error"]["message"], r.text


def test_an_unknown_model_or_previous_response_is_a_404(live):
    with pytest.raises(openai.NotFoundError) as info:
        live.client().responses.create(model=MODEL, input="hi", previous_response_id="resp_123")
    assert info.value.body["param"] == "previous_response_id" and "in memory" in info.value.message
    with pytest.raises(openai.NotFoundError):
        live.client().responses.create(model="other-model", input="hi")


# ---- stored responses ----------------------------------------------------------------------------

def test_previous_response_id_continues_the_conversation(live):
    client = live.client()
    first = client.responses.create(model=MODEL, instructions="Be terse.", input="Hi", max_output_tokens=3)
    second = client.responses.create(model=MODEL, input=[{"role": "user", "content": "More?"}],
                                     previous_response_id=first.id, max_output_tokens=4)
    # the earlier turns, without the earlier instructions (as on OpenAI)
    reply = chat(live, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.output_text},
                        {"role": "user", "content": "More?"}], max_tokens=4)
    assert second.usage.input_tokens == reply["usage"]["prompt_tokens"]
    assert second.output_text == reply["choices"][0]["message"]["content"]
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id) == first and client.responses.retrieve(second.id) == second


def test_a_streamed_response_is_kept_too(live):
    events = sse_events(live, input="abc", max_output_tokens=3)
    final = events[-1]["response"]
    with live.http() as http:
        assert http.get(f"/v1/responses/{final['id']}").json() == final


def test_store_false_keeps_nothing_and_a_deleted_response_is_gone(live):
    client = live.client()
    unkept = client.responses.create(model=MODEL, input="abc", max_output_tokens=2, store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    kept = client.responses.create(model=MODEL, input="abc", max_output_tokens=2)
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="more", previous_response_id=kept.id)


def test_the_store_forgets_the_least_recently_used_first():
    store = ResponseStore(max_responses=2, max_bytes=1000)
    for name in ("a", "b"):
        store.put(name, b"x" * 50, [], new=[])
    store.get("a")  # now more recent than b
    store.put("c", b"x" * 50, [], new=[])
    assert [name for name in "abc" if _kept(store, name)] == ["a", "c"]
    store.put("big", b"x" * 950, [], new=[{"role": "user", "content": "y" * 10}])  # leaves room for no other
    assert [name for name in ("a", "c", "big") if _kept(store, name)] == ["big"]
    store.put("huge", b"x" * 1001, [], new=[])  # larger than the whole store: not kept, nothing evicted
    assert not _kept(store, "huge") and _kept(store, "big")


def _kept(store: ResponseStore, name: str) -> bool:
    try:
        store.get(name)
    except ServiceError:
        return False
    return True


# ---- the stream's end --------------------------------------------------------------------------------

def test_a_client_that_disconnects_mid_stream_frees_its_slot(make_live):
    live = make_live(step_sleep_s=0.01)
    with live.http() as http, http.stream("POST", "/v1/responses",
                                          json={"input": "a", "max_output_tokens": 100, "stream": True}) as r:
        lines = r.iter_lines()
        assert any("response.output_text.delta" in line for line in lines)
        assert live.scheduler.stats().slots_used == 1
    assert wait_for(lambda: live.scheduler.stats().slots_used == 0, timeout=1.0)
    stats = live.scheduler.stats()
    assert stats.cancellations == 1 and stats.generated_tokens < 90


def test_an_engine_failure_mid_stream_ends_it_with_error_then_response_failed(make_live):
    live = make_live(step_sleep_s=0.01, exit_on_engine_failure=False)
    with live.http() as http, http.stream("POST", "/v1/responses",
                                          json={"input": "a", "max_output_tokens": 100, "stream": True}) as r:
        lines = r.iter_lines()
        assert any("response.output_text.delta" in line for line in lines)
        live.engine.fail_after_steps = 0
        rest = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    error, failed = rest[-2:]
    assert (error["type"], error["code"]) == ("error", "engine_error")
    assert "injected" not in error["message"] and "MockEngineError" not in error["message"]
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["message"] == error["message"]
    assert failed["sequence_number"] == error["sequence_number"] + 1


def test_responses_are_counted_under_their_route(make_live):
    live = make_live()
    assert post(live, input="abc", max_output_tokens=2).status_code == 200
    assert post(live, input=[]).status_code == 400
    assert live.metric("slipstream_http_responses_total", route="/v1/responses", status_class="2xx") == 1
    assert live.metric("slipstream_http_responses_total", route="/v1/responses", status_class="4xx",
                       code="invalid_value") == 1
