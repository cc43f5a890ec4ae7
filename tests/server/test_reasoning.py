"""A reasoning model's thinking, apart from its answer: `reasoning_content` / `reasoning` on chat replies, whole and
streamed, `chat_template_kwargs`, `include_reasoning`, and the structured-output grammar behind the thinking.

ThinkTokenizer scripts the mock engine's reply (it continues a prompt's last id with id + 1, ...): a prompt
ending in <|assistant|> gets "<think>\\nLet me see.\\n</think>\\n\\nThe answer is 4." and then EOS."""
from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from slipstream.engine.structured import Reasoning
from slipstream.server import openai_api
from slipstream.server.reasoning import ReasoningFormat, ReasoningStream, reasoning_format

from tests.server.conftest import ByteTokenizer, PieceTokenizer

# ids from 258 up: text a single token stands for (258/259 are spare)
PIECES = {260: "<|assistant|>", 261: "<think>", 262: "\nLet me", 263: " see.\n", 264: "</think>", 265: "\n\n",
          266: "The answer", 267: " is 4."}
END = 268  # the reply's EOS
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}"
            "{% if m.reasoning_content %}[{{ m.reasoning_content }}]{% endif %}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% if think_first %}<think>"
            "{% elif enable_thinking is defined and not enable_thinking %}<think></think>\n\n{% endif %}{% endif %}")


class ThinkTokenizer(PieceTokenizer):
    """Bytes plus the PIECES, as a reasoning model's tokenizer holds <think> and </think>."""

    def __init__(self) -> None:
        super().__init__(PIECES, END, TEMPLATE)


ASK = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def think_live():
    from tests.server.conftest import start_live

    server = start_live(tokenizer=ThinkTokenizer())
    yield server
    server.stop()


def chat(live, **body: Any) -> httpx.Response:
    with live.http() as http:
        return http.post("/v1/chat/completions", json={"messages": ASK, **body})


# ---- the split ---------------------------------------------------------------------------------

FMT = ReasoningFormat(open_id=261, close_id=264)
REPLIES = [  # (prompt opened the thinking, reply text, (reasoning, content))
    (False, "<think>\nLet me see.\n</think>\n\nThe answer is 4.", ("Let me see.", "The answer is 4.")),
    (True, "Let me see.\n</think>\n\nThe answer is 4.", ("Let me see.", "The answer is 4.")),
    (False, "\n<think>a < b, and </thin is no tag</think>yes", ("a < b, and </thin is no tag", "yes")),
    (False, "No thinking here.\n", ("", "No thinking here.\n")),
    (False, "<thinking> is not the tag", ("", "<thinking> is not the tag")),
    (True, "cut short before the tag </thi", ("cut short before the tag </thi", "")),
    (True, "</think>", ("", "")),
    (False, "  \n", ("", "  \n")),
]


@pytest.mark.parametrize("inside, text, expected", REPLIES)
def test_stream_deltas_add_up_to_the_whole_split_at_any_piece_sizes(inside, text, expected):
    assert FMT.split(text, inside) == expected
    for size in (1, 2, 3, 7, len(text) or 1):
        stream, reasoning, content = ReasoningStream(FMT, inside), "", ""
        for i in range(0, len(text), size):
            r, c = stream.feed(text[i:i + size])
            assert not (r and content), "thinking after the answer began"
            reasoning, content = reasoning + r, content + c
        r, c = stream.finish()
        assert (reasoning + r, content + c) == expected, size


def test_a_tag_split_across_pieces_never_reaches_the_client_as_text():
    stream = ReasoningStream(FMT, inside=True)
    pieces = [stream.feed(p) for p in ["Hm", "m </", "thi", "nk>", "\n", "Yes"]]
    assert pieces == [("Hm", ""), ("m ", ""), ("", ""), ("", ""), ("", ""), ("", "Yes")]


def test_the_prompts_last_tag_decides_where_the_reply_starts():
    assert FMT.starts_inside([1, 261])
    assert FMT.starts_inside([261, 5, 6])
    assert not FMT.starts_inside([261, 7, 264, 8])
    assert not FMT.starts_inside([1, 2, 3])
    assert FMT.starts_inside([261, 264, 261])


def test_auto_parses_only_where_the_tags_are_tokens_and_a_named_parser_says_what_is_missing():
    assert reasoning_format(ThinkTokenizer(), "auto") == FMT
    assert reasoning_format(ThinkTokenizer(), "deepseek_r1") == FMT
    assert reasoning_format(ThinkTokenizer(), "none") is None
    assert reasoning_format(ByteTokenizer(), "auto") is None  # "<think>" is seven byte tokens there
    with pytest.raises(ValueError, match="no <think> or </think> token"):
        reasoning_format(ByteTokenizer(), "qwen3")
    with pytest.raises(ValueError, match="--reasoning-parser must be one of"):
        reasoning_format(ThinkTokenizer(), "r1")


# ---- over HTTP -----------------------------------------------------------------------------------

def test_reply_returns_thinking_and_answer_apart(think_live):
    r = chat(think_live)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "The answer is 4.", "reasoning_content": "Let me see.",
                       "reasoning": "Let me see."}
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert r.json()["usage"]["completion_tokens"] == 8  # the thinking counts: 7 pieces and EOS


def test_openai_client_reads_both_fields(think_live):
    reply = think_live.client().chat.completions.create(model="mock-model", messages=ASK)
    message = reply.choices[0].message
    assert message.content == "The answer is 4."
    assert message.reasoning_content == "Let me see." and message.reasoning == "Let me see."


def test_a_prompt_that_opens_the_thinking_starts_the_reply_inside_it(think_live):
    r = chat(think_live, chat_template_kwargs={"think_first": True})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Let me see.", "The answer is 4.")
    assert r.json()["usage"]["completion_tokens"] == 7


def test_thinking_turned_off_in_the_template_gives_the_answer_alone(think_live):
    r = chat(think_live, chat_template_kwargs={"enable_thinking": False})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "The answer is 4."}


def test_a_reply_cut_while_thinking_is_all_reasoning(think_live):
    r = chat(think_live, max_tokens=3, n=2)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["message"] == {"role": "assistant", "content": None, "reasoning_content": "Let me see.",
                                     "reasoning": "Let me see."}
        assert choice["finish_reason"] == "length"


def test_include_reasoning_false_drops_the_thinking(think_live):
    r = chat(think_live, include_reasoning=False)
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "The answer is 4."}
    events = stream_deltas(think_live, include_reasoning=False)
    assert all("reasoning" not in d and "reasoning_content" not in d for d in events)
    assert "".join(d.get("content") or "" for d in events) == "The answer is 4."


def stream_deltas(live, **body: Any) -> list[dict]:
    with live.http() as http, http.stream("POST", "/v1/chat/completions",
                                          json={"messages": ASK, "stream": True, **body}) as r:
        assert r.status_code == 200
        return [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines()
                if line.startswith("data: {") and json.loads(line[6:])["choices"]]


@pytest.mark.parametrize("kwargs", [{}, {"think_first": True}])
def test_stream_sends_the_thinking_then_the_answer(think_live, kwargs):
    deltas = stream_deltas(think_live, chat_template_kwargs=kwargs)
    assert deltas[0] == {"role": "assistant", "content": ""}
    kinds = ["reasoning" if "reasoning_content" in d else "content" for d in deltas[1:] if len(d)]
    assert kinds == sorted(kinds, key=lambda k: k == "content") and "reasoning" in kinds  # all thinking first
    for d in deltas:
        assert d.get("reasoning") == d.get("reasoning_content")
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Let me see."
    assert "".join(d.get("content") or "" for d in deltas) == "The answer is 4."
    assert all("</think>" not in (d.get("content") or "") + (d.get("reasoning") or "") for d in deltas)


def test_earlier_thinking_reaches_the_template_and_bad_template_kwargs_are_400s(think_live):
    turns = [*ASK, {"role": "assistant", "content": "4", "reasoning": "2 and 2"}, {"role": "user", "content": "Sure?"}]
    r = chat(think_live, messages=turns)
    rendered = ThinkTokenizer().apply_chat_template(
        [*ASK, {"role": "assistant", "content": "4", "reasoning_content": "2 and 2"}, turns[2]])
    assert "[2 and 2]" in rendered
    assert r.json()["usage"]["prompt_tokens"] == len(ThinkTokenizer().encode(rendered))
    for bad, param in [({"messages": []}, "chat_template_kwargs.messages"),
                       ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
                       ([1, 2], "chat_template_kwargs")]:
        r = chat(think_live, chat_template_kwargs=bad)
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == param


def test_a_model_without_tags_keeps_its_replies_whole(live):
    r = chat(live)
    message = r.json()["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"].startswith("?@AB")


def test_the_grammar_of_a_constrained_reply_lets_the_thinking_through_first(think_live, monkeypatch):
    """Which thinking the grammar allows (tests/engine/test_structured.py checks the masks) follows the
    prompt: after <think> in it, the reply must close the thinking first."""
    seen: list = []

    def capture(service, constraint):
        seen.append(constraint)
        raise openai_api.ServiceError(400, "captured", param="response_format")

    monkeypatch.setattr(openai_api, "compile_constraint", capture)
    for kwargs, inside in [({}, False), ({"think_first": True}, True), ({"enable_thinking": False}, False)]:
        chat(think_live, response_format={"type": "json_object"}, chat_template_kwargs=kwargs)
        assert seen[-1].reasoning == Reasoning(open_id=261, close_id=264, inside=inside)


def test_a_tool_call_after_the_thinking_is_parsed_from_the_answer_whole_and_streamed():
    """Tool calls come from the answer only: a <tool_call> the model wrote while thinking stays in the reasoning."""
    import types

    from slipstream.engine.request import FinishReason
    from slipstream.engine.request_stream import Delta
    from slipstream.server.openai_formats import ChatFormat
    from slipstream.server.protocol import ChatCompletionRequest
    from slipstream.server.tool_formats import FALLBACK

    reply = ('<think>\nMaybe <tool_call>{"name": "weather", "arguments": {}}</tool_call>? No, ask properly.\n</think>'
             '\n\nChecking.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    service = types.SimpleNamespace(model_name="m", reasoning=FMT, token_text=str, tool_format=FALLBACK)
    gen = types.SimpleNamespace(id="chatcmpl-1", num_choices=1, prompt_tokens=3, completion_tokens=9, cached_tokens=0,
                                prompt_ids=lambda index: [1, 260])
    body = ChatCompletionRequest(messages=ASK, tools=[{"type": "function", "function": {
        "name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])
    whole = ChatFormat(service, gen, body).response([Delta(reply, [], None, FinishReason.STOP)])
    message = whole.choices[0].message
    assert message.reasoning_content == 'Maybe <tool_call>{"name": "weather", "arguments": {}}</tool_call>? No, ' \
                                        'ask properly.'
    assert message.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == \
        [("weather", {"city": "Oslo"})]
    assert whole.choices[0].finish_reason == "tool_calls"
    fmt = ChatFormat(service, gen, body)
    pieces = [reply[i:i + 5] for i in range(0, len(reply), 5)]
    chunks = [fmt.chunk(Delta(p, [], None, FinishReason.STOP if i == len(pieces) - 1 else None))
              for i, p in enumerate(pieces)]
    deltas = [c.choices[0].delta for c in chunks if c is not None]
    assert "".join(d.reasoning_content or "" for d in deltas) == message.reasoning_content
    assert "".join(d.content or "" for d in deltas).strip() == "Checking."
    calls = [call for d in deltas for call in d.tool_calls or ()]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("weather", {"city": "Oslo"})]
    assert [c for c in chunks if c is not None][-1].choices[0].finish_reason == "tool_calls"
