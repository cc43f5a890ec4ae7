"""Structured output and tool calling end to end on the default model (SmolLM2-135M-Instruct): the
unmodified openai client's .parse() with pydantic models, tools streaming and not, and the 400s."""
from __future__ import annotations

import enum
import json

import jsonschema
import openai
import pydantic
import pytest

from slipstream.engine.device.runner import EngineConfig, JaxEngine
from slipstream.engine.scheduler import OutputProcessor, Scheduler, SchedulerConfig
from slipstream.server.app import create_app
from slipstream.server.service import Service, ServiceConfig
from tests.server.conftest import run_http

MODEL = "smollm2"


@pytest.fixture(scope="module")
def served(default_model, default_tokenizer):
    cfg, params = default_model
    tokenizer = default_tokenizer
    engine = JaxEngine(cfg, params, EngineConfig(max_slots=4, page_size=16, max_seq_len=1024, num_pages=256,
                                                 max_num_batched_tokens=256), precompile=False)
    scheduler = Scheduler(engine, OutputProcessor(tokenizer), SchedulerConfig(max_queue=32))
    service = Service(scheduler, engine, tokenizer, ServiceConfig(model_name=MODEL))
    scheduler.start()
    url, server, thread = run_http(create_app(service, api_key=None))
    yield url, service
    server.should_exit = True
    thread.join(timeout=15)


@pytest.fixture(scope="module")
def url(served):
    return served[0]


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


class Color(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=40)
    zip_code: str = pydantic.Field(pattern=r"^[0-9]{5}$")


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=40)
    age: int = pydantic.Field(ge=0, le=120)
    address: Address


class Palette(pydantic.BaseModel):
    favorite: Color
    others: list[Color] = pydantic.Field(max_length=3)


class Reading(pydantic.BaseModel):
    temperature_c: float = pydantic.Field(ge=-50, le=60)
    humidity: int = pydantic.Field(ge=0, le=100)
    ok: bool


class Team(pydantic.BaseModel):
    members: list[Person] = pydantic.Field(min_length=1, max_length=2)


@pytest.mark.parametrize("model, question", [
    (Person, "Describe a person who lives in Paris as JSON."),
    (Palette, "Pick a favorite color and a few others."),
    (Reading, "Report the weather reading in Oslo."),
    (Team, "List a team of two people."),
], ids=["nested", "enum-array", "bounded-numbers", "array-of-nested"])
def test_openai_parse_returns_a_validated_object(client, model, question):
    completion = client.beta.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": question}], response_format=model, temperature=0,
        max_tokens=300)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, model)  # the client validated it with pydantic
    jsonschema.validate(json.loads(choice.message.content), model.model_json_schema())


def test_completions_endpoint_takes_response_format_and_guided_fields(client):
    text = client.completions.create(model=MODEL, prompt="The answer is", max_tokens=20, temperature=0,
                                     extra_body={"guided_choice": ["yes", "no"]}).choices[0].text
    assert text in ("yes", "no")
    out = client.completions.create(model=MODEL, prompt="A date:", max_tokens=20, temperature=0,
                                    extra_body={"guided_regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"}).choices[0].text
    assert len(out) == 10 and out[4] == out[7] == "-"
    obj = client.completions.create(model=MODEL, prompt='The user {"name": "Ann", "age": 31} as JSON:',
                                    max_tokens=60, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}}).choices[0]
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.text), dict), obj.text


WEATHER = openai.pydantic_function_tool(
    type("get_weather", (pydantic.BaseModel,), {"__annotations__": {"city": str, "unit": Color},
                                                "__doc__": "Current weather in a city"}))


def test_named_tool_call_round_trips(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0,
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                          max_tokens=80)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and call.id.startswith("call_") and set(args) == {"city", "unit"}
    chunks = [c for c in client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], temperature=0, max_tokens=80, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}) if c.choices]
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert len(deltas) > 1 and deltas[0].id and deltas[0].function.name == "get_weather"  # arguments stream
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=30,
                                            temperature=0)
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls


def test_required_tool_call_streams_as_tool_call_deltas(client):
    clock = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}}, "required": ["timezone"],
        # closed: with extra properties allowed, the default model (bf16 K/V) goes on adding them past max_tokens
        "additionalProperties": False}}}
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
                  tools=[WEATHER, clock], tool_choice="required", temperature=0, max_tokens=80)
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or []) if c.choices]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    name = "".join(d.function.name or "" for d in deltas)
    args = "".join(d.function.arguments or "" for d in deltas)
    assert deltas[0].id.startswith("call_") and deltas[0].index == 0
    assert (name, json.loads(args)) == (whole.message.tool_calls[0].function.name,
                                        json.loads(whole.message.tool_calls[0].function.arguments))
    # the openai client's own stream helper accumulates the deltas into a call
    with client.beta.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.name == name


def test_invalid_schema_is_a_400_naming_the_problem(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "x", "schema": {"type": "object", "properties": {
                                               "a": {"type": "strng"}}}}})
    assert e.value.body["param"] == "response_format" and "strng" in e.value.body["message"]


def test_schema_over_the_limit_is_a_400_with_the_limit(client):
    schema = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(3000)}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": schema}})
    assert "the limit is 65536" in e.value.body["message"]


def test_constrained_reply_cut_by_max_tokens_finishes_with_length(client):
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Describe a person"}],
                                          max_tokens=5, temperature=0, response_format={
                                              "type": "json_schema", "json_schema": {
                                                  "name": "p", "schema": Person.model_json_schema()}})
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 5
    with pytest.raises(openai.LengthFinishReasonError):
        client.beta.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "A person"}],
                                           response_format=Person, max_tokens=5, temperature=0)


def test_grpc_json_schema_field_constrains_every_sample(served):
    import grpc

    from slipstream.server.proto import jetstream_pb2 as pb
    from tests.server.grpc_helpers import start_grpc, text_request

    live = start_grpc(served[1])
    try:
        schema = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}}, "required": ["color"],
                  "additionalProperties": False}
        request = text_request("Favorite color as JSON:", 30, num_samples=2, sampling=pb.SlipstreamSampling(
            temperature=1.0, seed=7, json_schema=json.dumps(schema)))
        texts = ["", ""]
        for response in live.stub.Decode(request, timeout=120):
            for i, sample in enumerate(response.stream_content.samples):
                texts[i] += sample.text
        for text in texts:
            jsonschema.validate(json.loads(text), schema)
        bad = text_request("x", 5, sampling=pb.SlipstreamSampling(json_schema="{nope"))
        with pytest.raises(grpc.RpcError) as e:
            list(live.stub.Decode(bad, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.json_schema" in e.value.details()
    finally:
        live.stop()
