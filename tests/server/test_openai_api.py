"""The OpenAI Python client against a live server: completions and chat, streaming or not.

MockEngine continues a prompt byte by byte ("abc" -> "def..."), so every expected text is exact.
"""
from __future__ import annotations

from tests.server.conftest import BOS, MODEL, LiveServer

CHAT = [{"role": "user", "content": "hi"}]
CHAT_PROMPT = "<user>hi\n<assistant>"  # rendered by conftest's template; ends in ">" so replies start "?"


def test_completion_text_finish_reason_and_usage(live: LiveServer) -> None:
    out = live.client().completions.create(model=MODEL, prompt="abc", max_tokens=5)
    assert [c.text for c in out.choices] == ["defgh"]
    assert out.choices[0].finish_reason == "length"
    assert out.model == MODEL and out.id.startswith("cmpl-")
    # prompt: BOS + 3 bytes
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (4, 5, 9)


def test_completion_eos_finishes_with_stop(live: LiveServer) -> None:
    # MockEngine continues BOS (256) with 257, the EOS: one token, counted, never shown.
    out = live.client().completions.create(model=MODEL, prompt=[BOS], max_tokens=10)
    assert out.choices[0].text == ""
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == 1


def test_completion_stop_string_is_cut_and_reported(live: LiveServer) -> None:
    out = live.client().completions.create(model=MODEL, prompt="abc", max_tokens=10, stop=["gh", "zz"])
    assert out.choices[0].text == "def"
    assert out.choices[0].finish_reason == "stop"


def test_completion_n_and_prompt_list_index_choices(live: LiveServer) -> None:
    out = live.client().completions.create(model=MODEL, prompt=["abc", "pqr"], max_tokens=3, n=2, seed=7)
    assert [(c.index, c.text) for c in out.choices] == [(0, "def"), (1, "def"), (2, "stu"), (3, "stu")]
    assert out.usage.prompt_tokens == 8  # each prompt counted once, not once per sample
    assert out.usage.completion_tokens == 12


def test_completion_token_id_prompt(live: LiveServer) -> None:
    out = live.client().completions.create(model=MODEL, prompt=[ord("x"), ord("y")], max_tokens=2)
    assert out.choices[0].text == "z{"
    assert out.usage.prompt_tokens == 2


def test_completion_logprobs_shape(live: LiveServer) -> None:
    out = live.client().completions.create(model=MODEL, prompt="abc", max_tokens=3, logprobs=2)
    lp = out.choices[0].logprobs
    assert lp.tokens == ["d", "e", "f"]
    assert lp.token_logprobs == [0.0, 0.0, 0.0]
    assert lp.text_offset == [0, 1, 2]
    # MockEngine ranks token+1 second with logprob -1; the sampled token is always included.
    assert lp.top_logprobs == [{"d": 0.0, "e": -1.0}, {"e": 0.0, "f": -1.0}, {"f": 0.0, "g": -1.0}]


def test_completion_streaming_concatenates_to_the_full_text(live: LiveServer) -> None:
    chunks = list(live.client().completions.create(model=MODEL, prompt="abc", max_tokens=6, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "defghi"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_completion_streaming_n2_with_usage(live: LiveServer) -> None:
    chunks = list(live.client().completions.create(model=MODEL, prompt="abc", max_tokens=4, n=2, stream=True,
                                                   stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == {0: "defg", 1: "defg"}
    last = chunks[-1]
    assert last.choices == []
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (4, 8, 12)


def test_chat_completion(live: LiveServer) -> None:
    out = live.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == "?@AB"
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(CHAT_PROMPT.encode())  # the template adds no BOS
    assert out.usage.completion_tokens == 4


def test_chat_text_parts_and_max_completion_tokens(live: LiveServer) -> None:
    messages = [{"role": "system", "content": "be terse"},
                {"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    out = live.client().chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=2)
    assert out.choices[0].message.content == "?@"
    assert out.usage.prompt_tokens == len("<system>be terse\n<user>hi\n<assistant>")


def test_chat_without_max_tokens_runs_to_the_context_limit(make_live) -> None:
    live = make_live(max_seq_len=40)
    out = live.client().chat.completions.create(model=MODEL, messages=CHAT)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.total_tokens == 40


def test_chat_logprobs_shape(live: LiveServer) -> None:
    out = live.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, logprobs=True,
                                                top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert [(t.token, t.logprob, t.bytes) for t in content] == [("?", 0.0, [63]), ("@", 0.0, [64])]
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [("?", 0.0), ("@", -1.0), ("A", -2.0)]


def test_chat_streaming_role_first_then_content_then_usage(live: LiveServer) -> None:
    chunks = list(live.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, stream=True,
                                                        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "?@A"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_chat_streaming_n2(live: LiveServer) -> None:
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in live.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, n=2, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert texts == {0: "?@A", 1: "?@A"}
    assert finished == {0, 1}


def test_truncate_prompt_tokens_runs_the_prompts_last_tokens(live: LiveServer) -> None:
    """vLLM's truncate_prompt_tokens drops a prompt's start, so a prompt longer than the context still runs."""
    client = live.client()
    out = client.completions.create(model=MODEL, prompt="y" * 200, max_tokens=3,
                                    extra_body={"truncate_prompt_tokens": 100})
    assert out.usage.prompt_tokens == 100 and out.choices[0].text == "z{|"
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                         extra_body={"truncate_prompt_tokens": 4})
    assert out.usage.prompt_tokens == 4 and out.choices[0].message.content == "?@"  # "ant>" still ends in ">"
    with live.http() as http:
        for body in ({"prompt": "y" * 200, "max_tokens": 3},  # untruncated: too long
                     {"prompt": "abc", "truncate_prompt_tokens": 0},
                     {"prompt": "abc", "echo": True, "truncate_prompt_tokens": 2}):
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] == ("prompt" if "truncate_prompt_tokens" not in body
                                                  else "truncate_prompt_tokens"), r.text


def test_models_lists_the_served_model(live: LiveServer) -> None:
    client = live.client()
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
