"""Each model family's tool-call syntax: replies parsed into calls (the text before them kept as content, malformed
calls left as content, nothing lost), streamed as OpenAI deltas, a forced call's arguments as they come, and the
grammar of a forced call, compiled against the default model's tokenizer."""
from __future__ import annotations

import json

import pytest

from slipstream.server.tool_calls import ToolStream, parse_reply, tool_plan
from slipstream.server.tool_formats import ToolFormat
from slipstream.server.tool_syntax import Hermes, Llama3Json, Mistral, Phi4Mini, Pythonic

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
NAMES = {"get_weather", "get_time"}
OSLO = ("get_weather", {"city": "Oslo"})


CALLS = [  # (syntax, reply, its content, its calls)
    (Hermes(), 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
               '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
     "Let me check.", [OSLO, ("get_time", {})]),
    (Llama3Json(), '{"name": "get_weather", "parameters": {"city": "Oslo"}}', None, [OSLO]),
    (Llama3Json(), 'Sure. <|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                   '{"name": "get_time", "parameters": {}}', "Sure.", [OSLO, ("get_time", {})]),
    (Mistral(), '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", '
                '"arguments": {}}]', None, [OSLO, ("get_time", {})]),
    (Mistral(v11=True), 'On it.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}',
     "On it.", [OSLO, ("get_time", {})]),
    (Phi4Mini(), 'functools[{"name": "get_weather", "arguments": {"city": "Oslo"}}]', None, [OSLO]),
    (Pythonic(), 'Checking: [get_weather(city="Oslo"), get_time()]', "Checking:", [OSLO, ("get_time", {})]),
    (Pythonic(), "[get_weather(city='Oslo', days=-2, extra={'a': [True, null]})]", None,
     [("get_weather", {"city": "Oslo", "days": -2, "extra": {"a": [True, None]}})]),
]


@pytest.mark.parametrize("syntax, reply, content, calls", CALLS, ids=lambda v: getattr(v, "name", None))
def test_each_syntax_parses_its_calls_and_keeps_the_text_before_them(syntax, reply, content, calls):
    plan = tool_plan([WEATHER, CLOCK], "auto", ToolFormat(syntax))
    got_content, got = parse_reply(plan, reply)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    # rendered (earlier turns, the fallback prompt) and parsed back, the calls are the same
    content, parsed = syntax.parse(syntax.render(calls), NAMES)
    assert (content.strip(), parsed) == ("", calls)


def test_parallel_tool_calls_false_keeps_the_first_call_whole_and_streamed():
    """OpenAI's parallel_tool_calls: false (and Anthropic's disable_parallel_tool_use): a reply of two calls comes
    back as its first, as vLLM returns it."""
    syntax, reply = Hermes(), CALLS[0][1]
    plan = tool_plan([WEATHER, CLOCK], "auto", ToolFormat(syntax), parallel_tool_calls=False)
    content, calls = parse_reply(plan, reply)
    assert content == "Let me check." and [c["function"]["name"] for c in calls] == ["get_weather"]
    stream = ToolStream(plan)
    text = "".join(stream.feed(reply[i:i + 7])[0] for i in range(0, len(reply), 7))
    rest, deltas = stream.finish()
    assert (text + rest).strip() == "Let me check."
    assert [(d["index"], d["function"]["name"]) for d in deltas] == [(0, "get_weather")]
    both = tool_plan([WEATHER, CLOCK], "auto", ToolFormat(syntax), parallel_tool_calls=True)
    assert len(parse_reply(both, reply)[1]) == 2


MALFORMED = [  # (syntax, text that holds no complete call of the tools)
    (Hermes(), '<tool_call>{"name": "rm", "arguments": {}}</tool_call>'),
    (Hermes(), '<tool_call>{"name": "get_weather", "arguments": {"city": "Os'),
    (Hermes(), '<tool_call>{"name": "get_weather"} trailing</tool_call>'),
    (Llama3Json(), 'The user JSON: {"name": "Bob", "parameters": {}} as asked.'),
    (Llama3Json(), '{"name": "get_weather", "parameters": {"city": '),
    (Mistral(), '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "nope"}]'),
    (Mistral(), "[TOOL_CALLS]get_weather{no args marker}"),
    (Phi4Mini(), "functools[not json]"),
    (Pythonic(), '[get_weather(city=os.environ["X"])]'),
    (Pythonic(), "[get_weather(city='Oslo')"),
    (Pythonic(), "[get_weather('Oslo')]"),
    (Hermes(), "<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>"),
    (Pythonic(), "[get_weather(city=" + "[" * 5000 + "]" * 5000 + ")]"),
]


@pytest.mark.parametrize("syntax, text", MALFORMED, ids=lambda v: getattr(v, "name", None))
def test_malformed_calls_stay_content_whole_and_streamed(syntax, text):
    for mode in ("auto", "required"):
        plan = tool_plan([WEATHER, CLOCK], mode, ToolFormat(syntax))
        assert parse_reply(plan, text) == (text, [])
        stream = ToolStream(plan)
        sent = "".join(stream.feed(text[i:i + 7])[0] for i in range(0, len(text), 7))
        tail, deltas = stream.finish()
        assert (sent + tail, deltas) == (text, [])


STREAMED = [  # (syntax, reply, the content streamed before the call)
    (Hermes(), 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', "Sure. "),
    (Llama3Json(), 'Sure. <|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}', "Sure. "),
    (Llama3Json(), 'a {"b": 1} then {"name": "get_weather", "parameters": {"city": "Oslo"}}', 'a {"b": 1} then '),
    (Mistral(), 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]', "Sure. "),
    (Phi4Mini(), 'Sure. functools[{"name": "get_weather", "arguments": {"city": "Oslo"}}]', "Sure. "),
    (Pythonic(), 'Sure [x] [get_weather(city="Oslo")]', "Sure [x] "),
]


@pytest.mark.parametrize("cut", [1, 3, 8])
@pytest.mark.parametrize("syntax, reply, before", STREAMED, ids=lambda v: getattr(v, "name", None))
def test_streamed_text_goes_out_before_the_call_and_the_call_as_deltas(syntax, reply, before, cut):
    stream = ToolStream(tool_plan([WEATHER], "auto", ToolFormat(syntax)))
    fed = [stream.feed(reply[i:i + cut]) for i in range(0, len(reply), cut)]
    sent = "".join(content for content, _ in fed)
    tail, deltas = stream.finish()
    assert sent == before and tail == "" and not any(calls for _, calls in fed)
    assert [(d["index"], d["function"]["name"], json.loads(d["function"]["arguments"])) for d in deltas] == \
        [(0, "get_weather", {"city": "Oslo"})]
    assert deltas[0]["id"].startswith("call_")


@pytest.mark.parametrize("syntax", [Hermes(), Llama3Json(), Mistral(), Mistral(v11=True), Phi4Mini(), Pythonic()],
                         ids=lambda s: s.name + ("_v11" if getattr(s, "v11", False) else ""))
def test_a_named_call_streams_its_arguments_in_pieces_where_they_are_json(syntax):
    plan = tool_plan([WEATHER, CLOCK], {"type": "function", "function": {"name": "get_weather"}}, ToolFormat(syntax))
    reply = syntax.render([("get_weather", {"city": "Oslo", "days": 2})])
    stream = ToolStream(plan)
    deltas = [d for i in range(0, len(reply), 4) for d in stream.feed(reply[i:i + 4])[1]]
    content, more = stream.finish()
    deltas += more
    assert content == "" and deltas[0]["function"]["name"] == "get_weather" and deltas[0]["id"].startswith("call_")
    assert all("id" not in d for d in deltas[1:])
    assert json.loads("".join(d["function"]["arguments"] for d in deltas)) == {"city": "Oslo", "days": 2}
    assert len(deltas) > 2 if syntax.frame("get_weather") is not None else len(deltas) == 1  # pythonic: whole
    assert [c["function"]["name"] for c in parse_reply(plan, reply)[1]] == ["get_weather"]


@pytest.mark.parametrize("syntax", [Hermes(), Llama3Json(), Mistral(), Pythonic()], ids=lambda s: s.name)
def test_a_named_call_cut_short_is_still_the_call_with_the_arguments_so_far(syntax):
    plan = tool_plan([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, ToolFormat(syntax))
    whole = syntax.render([("get_weather", {"city": "Oslo"})])
    json_args = syntax.frame("get_weather") is not None
    for text, arguments in [(whole[:6], ""),  # inside the head
                            (whole[:whole.index("Oslo") + 2], '{"city": "Os'),  # inside the arguments
                            (whole[:whole.index("Oslo") + 6], '{"city": "Oslo"}'), (whole, '{"city": "Oslo"}')]:
        arguments = arguments if json_args else "" if text != whole else '{"city": "Oslo"}'
        content, calls = parse_reply(plan, text)
        assert content is None and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
            [("get_weather", arguments)], text
        stream = ToolStream(plan)
        deltas = [d for i in range(0, len(text), 3) for d in stream.feed(text[i:i + 3])[1]]
        content, more = stream.finish()
        deltas += more
        assert content == "" and deltas[0]["function"]["name"] == "get_weather"
        assert "".join(d["function"]["arguments"] for d in deltas) == arguments, text


def test_forced_calls_keep_their_schemas_references_and_checks(default_tokenizer):
    """A function's $defs (or definitions) still resolve inside the call's grammar; a costly regex in its
    parameters is a 400 naming them, though the grammar holds the schema as Lark text."""
    from slipstream.engine.structured import GrammarCompiler
    from slipstream.server.errors import ServiceError

    compiler = GrammarCompiler(default_tokenizer, 49152, {2})
    unit = {"type": "function", "function": {"name": "convert", "parameters": {
        "type": "object", "properties": {"unit": {"$ref": "#/definitions/unit"}}, "required": ["unit"],
        "definitions": {"unit": {"enum": ["C", "F"]}}}}}
    for syntax in (Hermes(), Llama3Json(), Mistral(), Mistral(v11=True), Phi4Mini(), Pythonic()):
        grammar = compiler.compile(tool_plan([unit, CLOCK], "required", ToolFormat(syntax)).constraint())
        for args, ok in (({"unit": "F"}, True), ({"unit": "K"}, False)):
            matcher = grammar.matcher()
            ids = default_tokenizer.encode(syntax.render([("convert", args)]), add_special_tokens=False)
            assert (all(matcher.advance(t) for t in ids) and matcher.done) == ok, (syntax.name, args)
    costly = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(a{50}){50}"}}}}}
    with pytest.raises(ServiceError) as e:
        tool_plan([CLOCK, costly], "required").constraint()
    assert e.value.param == "tools.1.function.parameters" and "unrolls" in e.value.message
