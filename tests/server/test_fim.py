"""Fill in the middle: /v1/completions with a `suffix` on a model with fill-in-the-middle tags (server/fim.py) runs
`<|fim_prefix|>prompt<|fim_suffix|>suffix<|fim_middle|>` and returns the middle; a model without them, echo, or
token-id prompts get a 400 naming the field.

FimTokenizer holds the tags as single tokens; MockEngine continues the prompt's last id (the middle tag) with the
pieces after it, a scripted middle."""
from __future__ import annotations

import pytest

from slipstream.server.fim import FimFormat, fim_format

from tests.server.conftest import ByteTokenizer, PieceTokenizer

PIECES = {260: "<|fim_prefix|>", 261: "<|fim_suffix|>", 262: "<|fim_middle|>", 263: "a + b", 264: "\n"}
END = 265


@pytest.fixture(scope="module")
def fim_live():
    from tests.server.conftest import start_live

    server = start_live(tokenizer=PieceTokenizer(PIECES, END))
    yield server
    server.stop()


def test_the_tags_are_found_in_the_vocabulary_or_not_at_all():
    assert fim_format(PieceTokenizer(PIECES, END)) == FimFormat("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
    starcoder = PieceTokenizer({260: "<fim_prefix>", 261: "<fim_suffix>", 262: "<fim_middle>"}, 263)
    assert fim_format(starcoder) == FimFormat("<fim_prefix>", "<fim_suffix>", "<fim_middle>")
    assert fim_format(ByteTokenizer()) is None
    assert fim_format(PieceTokenizer({260: "<|fim_prefix|>", 261: "<|fim_suffix|>"}, 262)) is None  # no middle


def test_a_suffix_fills_the_middle(fim_live):
    prompt, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
    with fim_live.http() as http:
        r = http.post("/v1/completions", json={"prompt": [prompt, "x = "], "suffix": suffix, "max_tokens": 8})
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == ["a + b\n", "a + b\n"]
    assert [c["finish_reason"] for c in r.json()["choices"]] == ["stop", "stop"]
    # prefix tag + prompt bytes + suffix tag + suffix bytes + middle tag, for both prompts
    assert r.json()["usage"]["prompt_tokens"] == 2 * 3 + len(prompt) + len("x = ") + 2 * len(suffix)
    tokenizer = PieceTokenizer(PIECES, END)
    assert tokenizer.encode(fim_format(tokenizer).text("p", "s")) == [260, ord("p"), 261, ord("s"), 262]


def test_what_cannot_fill_is_a_400_naming_it(fim_live, live):
    with fim_live.http() as http:
        for body, param in [({"prompt": "a", "suffix": "b", "echo": True}, "suffix"),
                            ({"prompt": [97, 98], "suffix": "b"}, "prompt")]:
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    with live.http() as http:  # ByteTokenizer's model has no tags
        r = http.post("/v1/completions", json={"prompt": "a", "suffix": "b"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix" and "fill-in-the-middle" in r.text
