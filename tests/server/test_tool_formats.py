"""Tool calls in each model's own format: the auto choice from the vocabulary and the chat template, templates
rendering the tools themselves (or the system prompt describing them), and forced calls constrained to the model's
syntax end to end, on the chat, Anthropic and Responses routes.

The tokenizers here are real ones (models.tokenizer.Tokenizer over a `tokenizers` byte-level vocabulary plus the
markers as added tokens), so the templates render in the served sandbox and grammars compile with llguidance; MockEngine
continues a prompt's last id with id + 1, ..., so a prompt ending in the generation-prompt token gets the tokens after
it as its reply: a scripted reply."""
from __future__ import annotations

import json
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

from slipstream.models.tokenizer import Tokenizer
from slipstream.server import openai_api
from slipstream.server.tool_calls import template_input, tool_plan
from slipstream.server.tool_formats import FALLBACK, template_use, tool_format
from slipstream.server.tool_syntax import Hermes, Llama3Json, Pythonic

from tests.server.conftest import MODEL, ByteTokenizer, start_live

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
OSLO = ("get_weather", {"city": "Oslo"})


def byte_tokenizer(pieces: list[tuple[str, bool]], template: str | None, eos: str) -> Tokenizer:
    """Bytes 0..255 (byte-level BPE without merges), then each (text, special) piece as one token, in order."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    chars = {b: chr(b if b in keep else next(extra)) for b in range(256)}  # GPT-2's bytes as printable characters
    hf = HFTokenizer(models.BPE(vocab={c: b for b, c in chars.items()}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    for text, special in pieces:
        (hf.add_special_tokens if special else hf.add_tokens)([AddedToken(text, special=special, normalized=False)])
    return Tokenizer(hf, bos_token=None, eos_token=eos, add_bos=False, chat_template=template)


# ---- templates in the style of the real ones: short, each branching on `tools` --------------------------------

QWEN = """{% if tools %}<|im_start|>system
{{ messages[0].content if messages[0].role == 'system' else 'You are helpful.' }}
# Tools
<tools>{% for t in tools %}
{{ t | tojson }}{% endfor %}
</tools><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}{% for m in messages if m.role != 'system' %}{% if m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.name }}: {{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA = """{% if tools is not defined %}{% set tools = none %}{% endif %}{% set ns = namespace(told=false) %}
{% for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>
{% if tools is not none and m.role == 'user' and not ns.told %}{% set ns.told = true %}\
Respond with a JSON for a function call.
{% for t in tools %}{{ t | tojson(indent=4) }}
{% endfor %}{% endif %}{% if m.tool_calls %}{% for c in m.tool_calls %}{"name": "{{ c.function.name }}", \
"parameters": {{ c.function.arguments | tojson }}}{% endfor %}{% else %}{{ m.content }}{% endif %}<|eot_id|>
{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}"""

MISTRAL = """{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' %}\
{% set ns.last = loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}{% if m.role == 'user' %}\
{% if tools and loop.index0 == ns.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}\
[INST]{{ m.content }}[/INST]{% elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS][{% for c in m.tool_calls %}\
{% if c.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}\
{% endif %}{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}, "id": "{{ c.id }}"}\
{% endfor %}]<|end|>{% elif m.role == 'assistant' %}{{ m.content }}<|end|>{% elif m.role == 'tool' %}\
[TOOL_RESULTS]{"content": {{ m.content | tojson }}, "call_id": "{{ m.tool_call_id }}"}[/TOOL_RESULTS]{% endif %}\
{% endfor %}"""

PHI = """{% for m in messages %}{% if m.role == 'system' and 'tools' in m and m['tools'] is not none %}\
<|system|>{{ m.content }}<|tool|>{{ m['tools'] }}<|/tool|><|end|>{% else %}<|{{ m.role }}|>{{ m.content }}<|end|>\
{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}
{# the model answers functools[{"name": ..., "arguments": ...}] #}"""

PLAIN = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"

# Each family's vocabulary: its markers, then the token its generation prompt ends in, then the scripted reply's
# pieces (MockEngine's continuation of that token) and EOS.
EOS = "<|eos|>"
FAMILIES = {
    "qwen": ([("<|im_start|>", True), ("<|im_end|>", True), ("<tool_call>", False), ("</tool_call>", False),
              ("assistant\n", False), ('<tool_call>\n{"name": "get_weather", "arguments": ', False),
              ('{"city": "Oslo"}}\n</tool_call>', False)], QWEN),
    "llama": ([("<|python_tag|>", True), ("<|start_header_id|>", True), ("<|eot_id|>", True),
               ("<|end_header_id|>", True), ('{"name": "get_weather", "parameters": ', False),
               ('{"city": "Oslo"}}', False)], LLAMA),
    "mistral": ([("[INST]", True), ("[/INST]", True), ("[TOOL_CALLS]", True),
                 ('[{"name": "get_weather", "arguments": ', False), ('{"city": "Oslo"}}]', False)], MISTRAL),
}


def family(name: str) -> Tokenizer:
    pieces, template = FAMILIES[name]
    return byte_tokenizer([*pieces, (EOS, True)], template, EOS)


# ---- the auto choice and the template's use of tools ----------------------------------------------------------

def test_auto_picks_the_syntax_by_vocabulary_then_template():
    qwen, llama, mistral = family("qwen"), family("llama"), family("mistral")
    fmt = tool_format(qwen, "auto")
    assert (fmt.syntax.name, fmt.place, fmt.calls_in_template, fmt.special) == ("hermes", "template", True, {})
    fmt = tool_format(llama, "auto")
    assert (fmt.syntax.name, fmt.place, fmt.special) == ("llama3_json", "template", {"<|python_tag|>": 256})
    fmt = tool_format(mistral, "auto")
    assert (fmt.syntax.name, fmt.syntax.v11, fmt.special) == ("mistral", False, {"[TOOL_CALLS]": 258})
    v11 = byte_tokenizer([("[TOOL_CALLS]", True), ("[ARGS]", True), ("</s>", True)], MISTRAL, "</s>")
    assert tool_format(v11, "auto").syntax.v11 and tool_format(v11, "auto").special == {"[TOOL_CALLS]": 256,
                                                                                       "[ARGS]": 257}
    # a Llama 3 template without <|python_tag|> in the vocabulary
    assert tool_format(byte_tokenizer([], LLAMA, None), "auto").syntax.name == "llama3_json"
    phi = tool_format(byte_tokenizer([], PHI, None), "auto")
    assert (phi.syntax.name, phi.place) == ("phi4_mini", "system")
    phi_tools = "{% if tools %}Call as functools[...]: {{ tools | tojson }}{% endif %}{{ messages[0].content }}"
    assert tool_format(byte_tokenizer([], phi_tools, None), "auto").syntax.name == "phi4_mini"
    # a template that takes no tools: the system prompt's Hermes, whatever the rest of the vocabulary
    for tokenizer in (byte_tokenizer([], PLAIN, None), ByteTokenizer()):
        fmt = tool_format(tokenizer, "auto")
        assert (fmt.syntax.name, fmt.place) == ("hermes", "prompt")
    # named: that syntax, even against the vocabulary
    assert tool_format(qwen, "llama3_json").syntax.name == "llama3_json"
    assert tool_format(qwen, "pythonic").place == "template"
    assert tool_format(qwen, "llama4_pythonic").syntax.name == "pythonic"  # vLLM's name for it
    assert tool_format(qwen, "phi4_mini_json").syntax.name == "phi4_mini"
    with pytest.raises(ValueError, match="--tool-call-parser must be one of"):
        tool_format(qwen, "json")


def test_template_use_reads_the_jinja_tree_not_the_text():
    assert template_use(QWEN) == ("template", True)
    assert template_use(PHI) == ("system", False)
    assert template_use(PLAIN) == ("prompt", False)
    assert template_use("{# tools, tool_calls #}{{ messages }}") == ("prompt", False)
    assert template_use("{% if %}") == ("prompt", False)  # does not parse: the tokenizer reports it when rendering


HISTORY = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
           {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0123456789abcdef", "type": "function",
                                                                "function": {"name": "get_weather",
                                                                             "arguments": '{"city": "Oslo"}'}}]},
           {"role": "tool", "content": "sunny", "tool_call_id": "call_0123456789abcdef"},
           {"role": "user", "content": "And tomorrow?"}]


def render(tokenizer: Tokenizer, messages: list[dict[str, Any]], choice: Any = "auto") -> str:
    fmt = tool_format(tokenizer, "auto")
    plan = tool_plan([WEATHER], choice, fmt)
    out, variables = template_input(messages, plan, fmt)
    return tokenizer.apply_chat_template(out, **variables)


def test_a_qwen_style_template_renders_the_tools_and_the_history_itself():
    text = render(family("qwen"), HISTORY)
    assert text.startswith(f"<|im_start|>system\nBe brief.\n# Tools\n<tools>{json.dumps(WEATHER)}</tools><|im_end|>\n")
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>get_weather: sunny</tool_response>" in text and "You may call" not in text  # its call's
    assert text.endswith("<|im_start|>user\nAnd tomorrow?<|im_end|>\n<|im_start|>assistant\n")
    # tool_choice none: no tools for the template, the history as it was
    assert "<tools>" not in render(family("qwen"), HISTORY, "none")


def test_a_llama_style_template_gets_tools_and_arguments_as_objects():
    text = render(family("llama"), HISTORY)
    assert "Respond with a JSON for a function call.\n" + json.dumps(WEATHER, indent=4) in text
    assert '<|start_header_id|>assistant<|end_header_id|>\n{"name": "get_weather", "parameters": {"city": "Oslo"}}' \
        in text
    assert "<|start_header_id|>ipython<|end_header_id|>\nsunny<|eot_id|>" in text


def test_a_mistral_style_template_gets_its_nine_character_ids():
    text = render(family("mistral"), HISTORY)
    calls = json.loads(text.partition("[TOOL_CALLS]")[2].partition("<|end|>")[0])
    call_id = calls[0].pop("id")
    assert calls == [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    assert len(call_id) == 9 and call_id.isalnum() and f'"call_id": "{call_id}"' in text  # the call and its result
    assert text.endswith(f"[AVAILABLE_TOOLS]{json.dumps([WEATHER])}[/AVAILABLE_TOOLS][INST]And tomorrow?[/INST]")


def test_a_phi_style_template_gets_the_tools_in_the_system_message_and_calls_as_text():
    text = render(byte_tokenizer([], PHI, None), HISTORY)
    assert text.startswith(f"<|system|>Be brief.<|tool|>{json.dumps([WEATHER['function']])}<|/tool|><|end|>")
    assert '<|assistant|>functools[{"name": "get_weather", "arguments": {"city": "Oslo"}}]<|end|>' in text
    assert render(byte_tokenizer([], PHI, None), HISTORY[1:2]).startswith("<|system|><|tool|>[")


def test_a_template_without_tools_keeps_the_system_prompt_fallback():
    tokenizer = byte_tokenizer([], PLAIN, None)
    text = render(tokenizer, HISTORY)
    assert text.startswith("<system>Be brief.\n\n# Tools\n") and json.dumps(WEATHER) in text
    assert Hermes.how in text
    assert '<assistant><tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<user><tool_response>\nsunny\n</tool_response>" in text
    # another syntax named for such a template: the prompt describes that one, and earlier calls are written in it
    fmt = tool_format(tokenizer, "pythonic")
    out, variables = template_input(HISTORY, tool_plan([WEATHER], "auto", fmt), fmt)
    text = tokenizer.apply_chat_template(out, **variables)
    assert Pythonic.how in text and '<assistant>[get_weather(city="Oslo")]' in text and variables == {}


def test_the_fallback_format_is_hermes_in_the_system_prompt():
    assert (FALLBACK.syntax.name, FALLBACK.place, FALLBACK.special) == ("hermes", "prompt", {})


# ---- served: the forced call constrained to the model's syntax, end to end ----------------------------------------

@pytest.fixture(params=list(FAMILIES))
def served(request, monkeypatch):
    grammars = []
    compile_constraint = openai_api.compile_constraint

    def compiled(service, constraint):  # the real compile, kept for the test to check the grammar with
        grammar = compile_constraint(service, constraint)
        grammars.append(grammar)
        return grammar

    monkeypatch.setattr(openai_api, "compile_constraint", compiled)
    server = start_live(tokenizer=family(request.param), max_seq_len=1024, page_size=16, num_pages=256,
                        max_num_batched_tokens=256)
    yield request.param, server, grammars
    server.stop()


def test_a_required_call_is_constrained_to_the_models_syntax_and_comes_back_as_tool_calls(served):
    name, live, grammars = served
    tokenizer = live.service.tokenizer
    with live.http() as http:
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}, "auto"):
            reply = http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [WEATHER, CLOCK],
                "tool_choice": choice})
            assert reply.status_code == 200, reply.text
            choice_out = reply.json()["choices"][0]
            message = choice_out["message"]
            assert message["content"] is None and choice_out["finish_reason"] == "tool_calls"
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] \
                == [OSLO]
        events = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [WEATHER],
            "tool_choice": "required", "stream": True}).text
    deltas = [json.loads(line[6:])["choices"] for line in events.splitlines()
              if line.startswith("data: {")]
    calls = [c for choices in deltas for ch in choices for c in ch["delta"].get("tool_calls") or ()]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [OSLO]
    assert [ch["finish_reason"] for choices in deltas for ch in choices][-1] == "tool_calls"
    # the grammar of each forced request takes the model's own call and refuses another family's
    scripted = tokenizer.encode(live.service.tool_format.syntax.render([OSLO]), add_special_tokens=False)
    other = tokenizer.encode(Hermes().render([OSLO]) if name != "qwen" else Llama3Json().render([OSLO]),
                             add_special_tokens=False)
    assert len(grammars) == 3
    for grammar in grammars:
        matcher = grammar.matcher()
        assert all(matcher.advance(t) for t in scripted) and matcher.done
        assert not all(grammar.matcher().advance(t) for t in other)


def test_the_anthropic_and_responses_routes_take_the_same_calls(served):
    """Both front ends reuse the chat path: the model's own syntax, parsed into a tool_use block and a
    function_call item."""
    _, live, grammars = served
    schema = WEATHER["function"]["parameters"]
    with live.http() as http:
        message = http.post("/v1/messages", json={
            "model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "Weather in Oslo?"}],
            "tools": [{"name": "get_weather", "input_schema": schema}], "tool_choice": {"type": "any"}})
        response = http.post("/v1/responses", json={
            "model": MODEL, "input": "Weather in Oslo?", "tool_choice": "required",
            "tools": [{"type": "function", "name": "get_weather", "parameters": schema}]})
    assert message.status_code == 200, message.text
    assert [(b["type"], b["name"], b["input"]) for b in message.json()["content"]] == [("tool_use", *OSLO)]
    assert message.json()["stop_reason"] == "tool_use"
    assert response.status_code == 200, response.text
    assert [(i["type"], i["name"], json.loads(i["arguments"])) for i in response.json()["output"]] == \
        [("function_call", *OSLO)]
    assert len(grammars) == 2  # each forced
