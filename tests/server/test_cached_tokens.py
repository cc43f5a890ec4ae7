"""A request's prompt tokens the prefix cache held are reported in each API's usage: OpenAI's
`prompt_tokens_details.cached_tokens` (completions, chat), the Responses API's `input_tokens_details.cached_tokens`,
Anthropic's `cache_read_input_tokens` (its `input_tokens` then counts the rest), llama.cpp's `tokens_cached`.

MockEngine's pages hold 4 tokens: a prompt seen before is held in whole pages, up to the page before its last token."""
from __future__ import annotations

PROMPT = "The same long prompt, sent twice: "  # 34 bytes, 35 tokens with BOS


def test_a_repeated_prompt_reports_the_tokens_the_cache_held(live):
    with live.http() as http:
        first = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).json()["usage"]
        again = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).json()["usage"]
        assert first["prompt_tokens"] == again["prompt_tokens"] == 35
        assert first["prompt_tokens_details"] == {"cached_tokens": 0}
        assert again["prompt_tokens_details"] == {"cached_tokens": 32}  # 8 whole pages before the last token

        # streamed usage, and n > 1: the prompt counted once
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "n": 2, "stream": True,
                                                "stream_options": {"include_usage": True}})
        assert '"prompt_tokens":35,' in r.text and '"prompt_tokens_details":{"cached_tokens":32}' in r.text

        chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}
        http.post("/v1/chat/completions", json=chat)
        usage = http.post("/v1/chat/completions", json=chat).json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == (usage["prompt_tokens"] - 1) // 4 * 4

        usage = http.post("/v1/responses", json={"input": PROMPT, "max_output_tokens": 2}).json()["usage"]
        assert usage["input_tokens_details"]["cached_tokens"] > 0

        body = {"model": "mock-model", "max_tokens": 2, "messages": [{"role": "user", "content": PROMPT}]}
        usage = http.post("/v1/messages", json=body).json()["usage"]
        assert usage["cache_read_input_tokens"] > 0
        count = http.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == count

        assert http.post("/completion", json={"prompt": PROMPT, "n_predict": 2}).json()["tokens_cached"] == 32
