"""/v1/completions with `echo`: the prompt before the output, and with `logprobs` the prompt tokens' log-probabilities
(what evaluation harnesses send to score a continuation: token-id prompts, echo, logprobs, max_tokens 0 or 1), on the
real engine through the openai client and raw HTTP."""
from __future__ import annotations

import httpx
import pytest

from tests.server.test_real_engine import client, real_server  # noqa: F401 - the module's server fixture


def _prompt(default_tokenizer, text: str) -> list[int]:
    return list(default_tokenizer.encode(text, add_special_tokens=False))


def test_echoed_prompt_logprobs_equal_each_prefix_s_next_token_logprob(real_server, default_tokenizer):  # noqa: F811
    """A harness's scoring request (ids, echo, logprobs=1, max_tokens=1): one entry per prompt token and one for the
    output, the first null; each prompt token's log-probability equals the one the server reports when that token is
    sampled after its prefix (forced with logit_bias, which leaves reported logprobs raw); a prompt longer than a
    step's budget (several chunks) included."""
    url, _ = real_server
    c = client(url)
    short = _prompt(default_tokenizer, "The quick brown fox jumps over the lazy dog")
    long = _prompt(default_tokenizer, " ".join(["Once upon a time there was a small village by the sea."] * 8))
    assert len(long) > 64  # the engine's step budget
    resp = c.completions.create(model="tiny", prompt=[short, long], echo=True, logprobs=1, max_tokens=1,
                                temperature=0)
    for choice, prompt in zip(resp.choices, [short, long]):
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(prompt) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.tokens[:len(prompt)] == [default_tokenizer.decode([t], skip_special_tokens=False) for t in prompt]
        assert choice.text.startswith(default_tokenizer.decode(prompt))
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
        for i in list(range(1, len(prompt)))[:12]:
            forced = c.completions.create(model="tiny", prompt=prompt[:i], max_tokens=1, logprobs=0, temperature=0,
                                          logit_bias={str(prompt[i]): 100})
            assert forced.choices[0].logprobs.tokens[0] == lp.tokens[i]
            assert forced.choices[0].logprobs.token_logprobs[0] == pytest.approx(lp.token_logprobs[i], abs=1e-4)
        for top, token, value in zip(lp.top_logprobs[1:], lp.tokens[1:], lp.token_logprobs[1:]):
            assert top[token] == value and max(top.values()) >= value and len(top) in (1, 2)
    assert resp.usage.completion_tokens == 2


def test_max_tokens_zero_echo_scores_the_prompt_alone(real_server, default_tokenizer):  # noqa: F811
    url, _ = real_server
    prompt = "Paris is the capital of France"
    body = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "echo": True, "logprobs": 3, "max_tokens": 0},
                      timeout=60).json()
    choice = body["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(choice["logprobs"]["tokens"])
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert all(len(top) in (3, 4) for top in choice["logprobs"]["top_logprobs"][1:])  # 3, and the token if not in them
    no_echo = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 0}, timeout=60)
    assert no_echo.status_code == 400 and no_echo.json()["error"]["param"] == "max_tokens"


def test_streamed_echo_equals_the_response(real_server):  # noqa: F811
    """Streamed, the first chunk carries the prompt (and its logprobs); the chunks add up to the response."""
    url, _ = real_server
    c = client(url)
    args = dict(model="tiny", prompt="Once upon a time", echo=True, logprobs=2, max_tokens=6, temperature=0)
    whole = c.completions.create(**args).choices[0]
    chunks = [ch.choices[0] for ch in c.completions.create(**args, stream=True) if ch.choices]
    assert chunks[0].text.startswith("Once upon a time")
    assert "".join(ch.text for ch in chunks) == whole.text
    streamed = [t for ch in chunks if ch.logprobs for t in ch.logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-5)
    assert [t for ch in chunks if ch.logprobs for t in ch.logprobs.text_offset] == whole.logprobs.text_offset
    plain = c.completions.create(model="tiny", prompt="Once upon a time", echo=True, max_tokens=6, temperature=0)
    assert plain.choices[0].text == whole.text and plain.choices[0].logprobs is None  # echo alone: text only


def test_each_of_n_choices_and_prompts_echoes_its_own_prompt(real_server):  # noqa: F811
    """n = 2 over two prompts, streamed: four choices, each opening with its prompt and that prompt's logprobs
    (equal between a prompt's two choices), then its own output."""
    url, _ = real_server
    c = client(url)
    prompts = ["The sky is", "Rivers flow into the"]
    chunks = [ch.choices[0] for ch in c.completions.create(model="tiny", prompt=prompts, n=2, echo=True, logprobs=1,
                                                             max_tokens=3, temperature=1.0, seed=7, stream=True)
              if ch.choices]
    firsts = {}
    for ch in chunks:
        firsts.setdefault(ch.index, ch)
    assert sorted(firsts) == [0, 1, 2, 3]
    for index, first in firsts.items():
        assert first.text.startswith(prompts[index // 2])
    for a, b in ((0, 1), (2, 3)):
        n = httpx.post(f"{url}/tokenize", json={"prompt": prompts[a // 2]}, timeout=60).json()["count"]
        assert firsts[a].logprobs.token_logprobs[0] is None and firsts[b].logprobs.token_logprobs[0] is None
        assert firsts[a].logprobs.token_logprobs[1:n] == pytest.approx(firsts[b].logprobs.token_logprobs[1:n], abs=1e-5)
