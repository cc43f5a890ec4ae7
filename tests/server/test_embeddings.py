"""POST /v1/embeddings over MockEngine (a row's hidden state is (token, position, 1); ByteTokenizer puts BOS = 256
first): OpenAI's shapes through the openai client (base64 by default) and plain JSON, the pooling modes,
`dimensions`, `normalize`, requests of more inputs than a request's choices, and errors naming the field."""
from __future__ import annotations

import json

import numpy as np
import pytest

from slipstream.server.embeddings import pooling_of
from tests.server.conftest import BOS, MODEL


def hidden(text: str, pooling: str = "last") -> np.ndarray:
    ids = [BOS, *text.encode()]
    rows = np.array([[t, p, 1.0] for p, t in enumerate(ids)])
    return rows.mean(axis=0) if pooling == "mean" else rows[-1]


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def test_openai_client_gets_normalized_last_token_embeddings_in_input_order(live):
    texts = ["abc", "hello there", "x"]
    out = live.client().embeddings.create(model=MODEL, input=texts)  # the client asks for base64 and decodes it
    assert [d.index for d in out.data] == [0, 1, 2]
    for text, d in zip(texts, out.data):
        np.testing.assert_allclose(d.embedding, unit(hidden(text)), rtol=1e-6)
    tokens = sum(len(t) + 1 for t in texts)
    assert out.usage.prompt_tokens == out.usage.total_tokens == tokens
    assert out.model == MODEL


def test_responses_are_counted_under_the_route(make_live):
    live = make_live()
    with live.http() as http:
        assert http.post("/v1/embeddings", json={"input": "abc"}).status_code == 200
        assert http.post("/v1/embeddings", json={"input": ""}).status_code == 400
    assert live.metric("slipstream_http_responses_total", route="/v1/embeddings", status_class="2xx") == 1
    assert live.metric("slipstream_http_responses_total", route="/v1/embeddings", status_class="4xx",
                       code="invalid_value") == 1


def test_float_and_base64_formats_carry_the_same_vector(live):
    with live.http() as http:
        plain = http.post("/v1/embeddings", json={"input": "abc"}).json()
        packed = http.post("/v1/embeddings", json={"input": "abc", "encoding_format": "base64"}).json()
    assert plain["object"] == "list" and plain["data"][0]["object"] == "embedding"
    import base64
    decoded = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), "<f4")
    np.testing.assert_array_equal(decoded, np.float32(plain["data"][0]["embedding"]))


def test_dimensions_truncates_then_renormalizes_and_normalize_false_keeps_the_pooled_state(live):
    with live.http() as http:
        short = http.post("/v1/embeddings", json={"input": "abc", "dimensions": 2}).json()["data"][0]["embedding"]
        raw = http.post("/v1/embeddings", json={"input": [[5, 6, 7]], "normalize": False}).json()
    np.testing.assert_allclose(short, unit(hidden("abc")[:2]), rtol=1e-6)
    assert raw["data"][0]["embedding"] == [7.0, 2.0, 1.0]  # token ids as given: the last one, at position 2
    assert raw["usage"]["prompt_tokens"] == 3


def test_mean_pooling_server(make_live):
    live = make_live(pooling="mean")
    with live.http() as http:
        body = http.post("/v1/embeddings", json={"input": ["abcd", "z"], "normalize": False}).json()
    np.testing.assert_allclose(body["data"][0]["embedding"], hidden("abcd", "mean"), rtol=1e-6)
    np.testing.assert_allclose(body["data"][1]["embedding"], hidden("z", "mean"), rtol=1e-6)


def test_more_inputs_than_a_request_may_queue_go_in_groups(make_live):
    """max_choices 4 and a queue of 6 before one slot: 23 inputs go to the scheduler 4 at a time, two groups in
    flight (the second waits while the queue is full), and all come back in order."""
    live = make_live(service_config={"max_choices": 4}, max_queue=6, max_slots=1, step_sleep_s=0.002)
    texts = [f"text {i}" * (i % 3 + 1) for i in range(23)]
    out = live.client().embeddings.create(model=MODEL, input=texts)
    assert [d.index for d in out.data] == list(range(23))
    for text, d in zip(texts, out.data):
        np.testing.assert_allclose(d.embedding, unit(hidden(text)), rtol=1e-6)


@pytest.mark.parametrize("body, status, param", [
    ({"input": []}, 400, "input"),
    ({"input": ""}, 400, "input"),
    ({"input": ["ok", "y" * 200]}, 400, "input[1]"),         # past the 128-token context
    ({"input": [[1, 2, 999]]}, 400, "input[0]"),              # outside the vocabulary
    ({"input": "abc", "dimensions": 4}, 400, "dimensions"),    # the mock's hidden states have 3
    ({"input": "abc", "dimensions": 0}, 400, "dimensions"),
    ({"input": "abc", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "abc", "model": "other"}, 404, "model"),
    ({"input": ["a"] * 2049}, 400, "input"),
])
def test_bad_requests_name_the_field(live, body, status, param):
    with live.http() as http:
        r = http.post("/v1/embeddings", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_too_long_input_names_its_index_and_the_limit(live):
    with live.http() as http:
        r = http.post("/v1/embeddings", json={"input": ["ok", "y" * 200]})
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and "input[1] is 201 tokens" in error["message"]
    assert "128" in error["message"]


@pytest.mark.parametrize("modes, want", [({"pooling_mode_lasttoken": True}, "last"),
                                         ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}, "mean")])
def test_pooling_of_reads_the_sentence_transformers_config(tmp_path, modes, want):
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "modules.json").write_text(json.dumps([{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
                                                       {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 8, **modes}))
    assert pooling_of(str(tmp_path)) == want
    assert pooling_of(str(tmp_path / "config.json")) == want  # --load-format dummy's path
    assert pooling_of(str(tmp_path / "1_Pooling")) is None


def test_pooling_of_refuses_a_pooling_it_does_not_make(tmp_path):
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "modules.json").write_text(json.dumps([{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    with pytest.raises(ValueError, match="1_Pooling/config.json.*--pooling"):
        pooling_of(str(tmp_path))


def test_truncate_prompt_tokens_embeds_each_inputs_last_tokens(live):
    """vLLM's truncate_prompt_tokens: the last k tokens of each input run (positions from 0), -1 the context's worth,
    so an input longer than the context is embedded instead of refused."""
    with live.http() as http:
        r = http.post("/v1/embeddings", json={"input": ["abcdef", "xy"], "truncate_prompt_tokens": 3})
        assert r.status_code == 200, r.text
        rows = {"abcdef": [(100, 0), (101, 1), (102, 2)], "xy": [(BOS, 0), (120, 1), (121, 2)]}
        for d, text in zip(r.json()["data"], ["abcdef", "xy"]):
            np.testing.assert_allclose(d["embedding"], unit(np.array([*rows[text][-1], 1.0])), rtol=1e-6)
        assert r.json()["usage"]["prompt_tokens"] == 6
        long = http.post("/v1/embeddings", json={"input": "y" * 200, "truncate_prompt_tokens": -1})
        assert long.status_code == 200 and long.json()["usage"]["prompt_tokens"] == 128
        for k in (0, 129, -2):
            bad = http.post("/v1/embeddings", json={"input": "abc", "truncate_prompt_tokens": k})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt_tokens", (k, bad.text)
