"""llama.cpp's own API (server/llamacpp*.py): /completion and /infill with llama.cpp's fields and reply shapes,
its code-completion stops (n_indent, t_max_predict_ms), and its spellings of /tokenize, /detokenize, /apply-template
and /props.

MockEngine continues a prompt's last id with the ids after it: "abc" goes on "defgh..."; with PieceTokenizer a prompt
ending in the middle tag gets the pieces after it, a scripted middle."""
from __future__ import annotations

import json

import pytest

from slipstream.engine.request import FinishReason
from slipstream.engine.request_stream import Delta
from slipstream.server import llamacpp_output
from slipstream.server.llamacpp import LlamaCompletionRequest
from slipstream.server.llamacpp_output import LlamaFormat

from tests.server.conftest import PieceTokenizer, start_live

PIECES = {258: "<|repo_name|>", 259: "<|file_sep|>", 260: "<|fim_prefix|>", 261: "<|fim_suffix|>",
          262: "<|fim_middle|>", 263: "    x = 1\n", 264: "    y = 2\n", 265: "z = 3\n"}
END = 266


@pytest.fixture(scope="module")
def code_live():
    server = start_live(tokenizer=PieceTokenizer(PIECES, END))
    yield server
    server.stop()


def _events(response) -> list[dict]:
    lines = [line for line in response.text.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines), response.text
    return [json.loads(line[len("data: "):]) for line in lines]


def test_completion_answers_in_llama_cpp_shape(live):
    with live.http() as http:
        r = http.post("/completion", json={"prompt": "abc", "n_predict": 5, "return_tokens": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["content"] == "defgh" and body["tokens"] == [100, 101, 102, 103, 104]
        assert body["stop"] is True and body["stop_type"] == "limit" and body["stopping_word"] == ""
        assert body["tokens_predicted"] == 5 and body["tokens_evaluated"] == 4  # BOS + "abc"
        assert body["generation_settings"]["n_predict"] == 5 and body["generation_settings"]["temperature"] == 0.8
        assert body["timings"]["predicted_n"] == 5 and body["timings"]["prompt_n"] == 4
        assert body["timings"]["prompt_ms"] > 0 and body["prompt"] == "<s>abc"

        # a stop word ends the text before it and is named; token ids and text mixed (no BOS before an id)
        body = http.post("/completions", json={"prompt": [97, "bc"], "n_predict": 10, "stop": ["fg"]}).json()
        assert (body["content"], body["stop_type"], body["stopping_word"]) == ("de", "word", "fg")
        assert body["tokens_evaluated"] == 3 and body["tokens"] == []  # return_tokens off
        # EOS: 255, then 256 (BOS, no text) and 257 (EOS)
        body = http.post("/completion", json={"prompt": [97, 254], "n_predict": 10}).json()
        assert body["stop_type"] == "eos" and body["tokens_predicted"] == 3

        # several prompts: a list of results
        r = http.post("/completion", json={"prompt": ["abc", "xy"], "n_predict": 3})
        assert [(b["index"], b["content"]) for b in r.json()] == [(0, "def"), (1, "z{|")]

        # response_fields picks fields, a nested one moved to the top
        body = http.post("/completion", json={"prompt": "abc", "n_predict": 2,
                                              "response_fields": ["content", "timings/predicted_n", "nope"]}).json()
        assert body == {"content": "de", "predicted_n": 2}

        # n_probs: each token with its alternatives
        probs = http.post("/completion", json={"prompt": "abc", "n_predict": 2, "n_probs": 2}).json()[
            "completion_probabilities"]
        assert [p["id"] for p in probs] == [100, 101] and [p["token"] for p in probs] == ["d", "e"]
        assert [t["id"] for t in probs[0]["top_logprobs"]] == [100, 101] and probs[0]["bytes"] == [100]


def test_completion_streams_partial_results_then_the_final_one(live):
    with live.http() as http:
        r = http.post("/completion", json={"prompt": "abc", "n_predict": 6, "stream": True, "stop": ["hi"]})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r)
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == "defg"
    assert [t for e in events for t in e["tokens"]] == [100, 101, 102, 103, 104, 105]  # "defghi": the stop word's too
    assert events[-1]["stop_type"] == "word" and events[-1]["stopping_word"] == "hi"
    assert "[DONE]" not in r.text


def test_llama_cpp_fields_this_server_lacks_are_400s_naming_them(live):
    with live.http() as http:
        for body, param in [({"prompt": "a", "mirostat": 2}, "mirostat"), ({"prompt": "a", "id_slot": 1}, "id_slot"),
                            ({"prompt": "a", "typical_p": 0.5}, "typical_p"),
                            ({"prompt": "a", "logit_bias": [[999999, 1.0]]}, "logit_bias"),
                            ({"prompt": "a", "grammar": "root ::= (("}, "grammar"), ({"prompt": ""}, "prompt"),
                            ({"input_prefix": "a", "input_suffix": "b"}, "input_prefix")]:  # no FIM tags here
            path = "/infill" if "input_prefix" in body else "/completion"
            r = http.post(path, json=body)
            assert r.status_code == 400, (body, r.text)
            assert param in (r.json()["error"]["param"] or "") + r.json()["error"]["message"], (body, r.text)
        # token texts and false (banned) are llama.cpp's logit_bias forms
        r = http.post("/completion", json={"prompt": "abc", "n_predict": 1, "logit_bias": [["d", -1.0], [101, False]]})
        assert r.status_code == 200, r.text


def test_infill_fills_between_prefix_and_suffix(code_live):
    with code_live.http() as http:
        r = http.post("/infill", json={"input_prefix": "def f():\n", "input_suffix": "\nreturn", "n_predict": 8})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["content"] == "    x = 1\n    y = 2\nz = 3\n" and body["stop_type"] == "eos"
        assert body["prompt"] == "<|fim_prefix|>def f():\n<|fim_suffix|>\nreturn<|fim_middle|>"

        # n_indent: the line indented less than 4 ends the reply before its text
        body = http.post("/infill", json={"input_prefix": "def f():\n", "input_suffix": "", "n_indent": 4}).json()
        assert body["content"] == "    x = 1\n    y = 2\n" and body["stop_type"] == "limit"
        events = _events(http.post("/infill", json={"input_prefix": "p", "input_suffix": "", "n_indent": 4,
                                                    "stream": True}))
        assert "".join(e["content"] for e in events) == "    x = 1\n    y = 2\n" and events[-1]["stop_type"] == "limit"

        # input_extra: other files before the fill, in the repository-level layout (the model has its tags); the
        # latest files that fit the context beside the fill and n_predict are kept
        files = [{"filename": f"{name}.py", "text": name * 30 + "\n"} for name in "abc"]
        body = http.post("/infill", json={"input_prefix": "p", "input_suffix": "s", "input_extra": files[2:],
                                          "n_predict": 4}).json()
        assert body["prompt"] == ("<|repo_name|>myproject\n<|file_sep|>c.py\n" + "c" * 30 + "\n<|file_sep|>filename\n"
                                  "<|fim_prefix|>p<|fim_suffix|>s<|fim_middle|>")
        prompt = http.post("/infill", json={"input_prefix": "p", "input_suffix": "s", "input_extra": files,
                                            "n_predict": 20}).json()["prompt"]
        assert "c.py" in prompt and "b.py" in prompt and "a.py" not in prompt  # 128-token context

        r = http.post("/infill", json={"input_prefix": "p", "prompt": [1, 2]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


class _Gen:
    num_choices = 1

    def __init__(self) -> None:
        self.cut_choices: list[int] = []

    def cut(self, index: int) -> None:
        self.cut_choices.append(index)

    def prompt_ids(self, index: int) -> list[int]:
        return [1, 2]

    def cached_in(self, index: int) -> int:
        return 0


def test_t_max_predict_ms_ends_the_reply_at_a_newline_past_the_time(live, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(llamacpp_output.time, "monotonic", lambda: now[0])
    gen = _Gen()
    fmt = LlamaFormat(live.service, gen, LlamaCompletionRequest(prompt="p", t_max_predict_ms=50), started=99.9)
    assert fmt.feed(Delta("a\nb", [1, 2, 3], None, None)) == ("a\nb", False)  # a newline, but within the time
    now[0] += 0.1
    assert fmt.feed(Delta("cd", [4, 5], None, None)) == ("cd", False)        # past the time, but no newline
    assert fmt.feed(Delta("e\n", [6, 7], None, None)) == ("e\n", True) and gen.cut_choices == [0]
    result = fmt.result(0)
    assert result["content"] == "a\nbcde\n" and result["stop_type"] == "limit"
    assert result["timings"]["prompt_ms"] == pytest.approx(100.0) and result["timings"]["predicted_ms"] == (
        pytest.approx(100.0))
    fmt = LlamaFormat(live.service, _Gen(), LlamaCompletionRequest(prompt="p"), started=99.9)
    assert fmt.feed(Delta("x", [1], None, FinishReason.LENGTH)) == ("x", True)


def test_tokenize_detokenize_apply_template_and_props_in_llama_cpp_spellings(live):
    with live.http() as http:
        assert http.post("/tokenize", json={"content": "ab"}).json()["tokens"] == [97, 98]
        assert http.post("/tokenize", json={"content": "ab", "add_special": True}).json()["tokens"] == [256, 97, 98]
        assert http.post("/tokenize", json={"content": "a", "with_pieces": True}).json()["tokens"] == [
            {"id": 97, "piece": "a"}]
        assert http.post("/tokenize", json={"prompt": "a", "content": "b"}).status_code == 400
        assert http.post("/detokenize", json={"tokens": [97, 98]}).json() == {"prompt": "ab", "content": "ab"}
        assert http.post("/apply-template", json={"messages": [{"role": "user", "content": "hi"}]}).json() == {
            "prompt": "<user>hi\n<assistant>"}
        props = http.get("/props").json()
    assert props["default_generation_settings"]["n_ctx"] == live.service.max_seq_len
    assert props["total_slots"] == 4 and props["infill"] is False and props["modalities"]["vision"] is False
