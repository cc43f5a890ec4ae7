"""POST /tokenize and /detokenize (vLLM's shapes) against a live server: the ids a prompt or chat messages run as
(the same count the generation routes report), the text of ids, and clear errors; behind the API key like /v1/*.

The conftest tokenizer is bytes, BOS 256; its chat template renders [{"role": "user", "content": "hi"}] as
"<user>hi\\n<assistant>"."""
from __future__ import annotations

from tests.server.conftest import BOS, MODEL, LiveServer

CHAT = [{"role": "user", "content": "hi"}]
CHAT_PROMPT = "<user>hi\n<assistant>"


def test_tokenize_a_prompt_and_chat_messages(live: LiveServer) -> None:
    with live.http() as http:
        out = http.post("/tokenize", json={"model": MODEL, "prompt": "abc"}).json()
        assert out == {"count": 4, "max_model_len": live.service.max_seq_len, "tokens": [BOS, 97, 98, 99]}
        bare = http.post("/tokenize", json={"prompt": "abc", "add_special_tokens": False}).json()
        assert bare["tokens"] == [97, 98, 99]
        chat = http.post("/tokenize", json={"messages": CHAT}).json()
    assert chat["tokens"] == list(CHAT_PROMPT.encode())  # the template carries its own specials
    # the count a client plans with is the one the chat route charges
    usage = live.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens


def test_detokenize_gives_the_text_of_ids(live: LiveServer) -> None:
    def counted() -> float:  # /metrics counts it under its own route, not "other"
        return sum(v for (name, labels), v in live.metrics().items()
                   if name == "slipstream_http_responses_total" and ("route", "/detokenize") in labels)

    before = counted()
    with live.http() as http:
        out = http.post("/detokenize", json={"model": MODEL, "tokens": [104, 105, 33]})
    assert out.status_code == 200 and out.json() == {"prompt": "hi!", "content": "hi!"}  # vLLM's and llama.cpp's
    assert counted() == before + 1


def test_bad_bodies_are_400s_naming_the_field(live: LiveServer) -> None:
    cases = [
        ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt", "exactly one"),
        ("/tokenize", {}, "prompt", "exactly one"),
        ("/tokenize", {"prompt": 5}, "prompt", ""),
        ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content",
         "text"),
        ("/detokenize", {"tokens": [1, 10 ** 6]}, "tokens", "vocabulary"),
        ("/detokenize", {"tokens": [-1]}, "tokens", ""),
    ]
    with live.http() as http:
        for path, body, param, words in cases:
            r = http.post(path, json=body)
            assert r.status_code == 400, (path, body, r.text)
            err = r.json()["error"]
            assert err["param"].startswith(param) and words in err["message"], (body, err)
        r = http.post("/tokenize", json={"model": "other", "prompt": "a"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_the_api_key_guards_them(make_live) -> None:
    live = make_live(api_key="sesame")
    with live.http() as http:  # sends the key
        assert http.post("/tokenize", json={"prompt": "a"}).status_code == 200
        for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [97]})):
            r = http.post(path, json=body, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401, path
