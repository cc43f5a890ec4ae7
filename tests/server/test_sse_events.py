"""A stream's chunk events written without their pydantic models (CompletionFormat.sse, ChatFormat.sse) are the
same bytes as the model's dump (sse_event), for every kind of text and finish, with and without usage."""
from __future__ import annotations

import types

import pytest

from slipstream.engine.request_stream import Delta
from slipstream.engine.request import FinishReason, TokenLogprob
from slipstream.server.openai_formats import ChatFormat, CompletionFormat, sse_event
from slipstream.server.protocol import ChatCompletionRequest, CompletionRequest

TEXTS = ["", "Hello", " world", 'quote " and \\ backslash', "new\nline\ttab\r\x00\x1b\x7f", "é ü 中文 🙂",
         "\u2028\u2029", "</script>", "{\"json\": [1, 2]}"]
REASONS = [None, FinishReason.STOP, FinishReason.LENGTH]


def _service():
    return types.SimpleNamespace(model_name="served-model", reasoning=None, token_text=lambda token_id: f"<{token_id}>")


def _gen(choices: int = 4):
    return types.SimpleNamespace(id="cmpl-abc\"1", num_choices=choices, prompt_tokens=3, completion_tokens=5,
                                 cached_tokens=0)


def _formats():
    completion = CompletionRequest(model="m\u00e9", prompt="hi")
    chat = ChatCompletionRequest(model="chat-model", messages=[{"role": "user", "content": "hi"}])
    return [CompletionFormat(_service(), _gen(), completion), ChatFormat(_service(), _gen(), chat)]


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("fmt_index", [0, 1])
def test_direct_events_equal_the_models_dump(fmt_index, include_usage):
    fmt = _formats()[fmt_index]
    checked = 0
    for text in TEXTS:
        for reason in REASONS:
            for index in (0, 3):
                d = Delta(text=text, token_ids=[1], logprobs=None, finish_reason=reason, index=index)
                chunk = fmt.chunk(d)
                want = b"" if chunk is None else sse_event(chunk, include_usage)
                assert fmt.sse(d, include_usage) == want, (text, reason, index)
                checked += chunk is not None
    assert checked == 2 * (len(TEXTS) * len(REASONS) - 1)  # only an empty text without a finish has no event


def test_usage_flag_switches_within_a_generation():
    fmt = _formats()[0]
    d = Delta(text="x", token_ids=[1], logprobs=None, finish_reason=None)
    assert b'"usage":null' in fmt.sse(d, True)
    assert b"usage" not in fmt.sse(d, False)


def test_logprobs_take_the_models_path():
    fmt = _formats()[0]
    d = Delta(text="a", token_ids=[7], logprobs=[TokenLogprob(token_id=7, logprob=-0.5, top=[(7, -0.5), (8, -1.0)])],
              finish_reason=None)
    event = fmt.sse(d, False)
    assert event == sse_event(_formats()[0].chunk(d), False)
    assert b'"token_logprobs":[-0.5]' in event
