"""Images over HTTP to a tiny random LLaVA served as the CLI builds it: a data URL's greedy reply equals transformers'
(its processor's pixels, its placeholder expansion); an http(s) URL is fetched from a local server; Anthropic's image
block and the Responses API's input_image take the same path; and each refusal is a 400 naming the field."""
from __future__ import annotations

import base64
import http.server
import io
import threading
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.models.llava_helpers import IMAGE_ROWS, IMAGE_TOKEN, build_tiny_llava, hf_greedy, hf_model
from tests.server.conftest import serve_model_dir

WORD_IDS = {f"w{i}": i for i in range(5, 255)} | {"<pad>": 0, "<eos>": 1, "<bos>": 2, "USER:": 3, "ASSISTANT:": 4}
FLAGS = ["--max-slots", "2", "--max-seq-len", "96", "--kv-cache-memory", "1MiB", "--max-num-batched-tokens", "16",
         "--quantize", "none", "--max-images-per-request", "2", "--max-image-bytes", "4000",
         "--image-fetch-timeout", "1", "--compile-cache", ""]


def _png(seed: int, size=(40, 30), noise: bool = False) -> bytes:
    """A smooth image (a few hundred bytes as PNG), or noise (several KB)."""
    rng = np.random.default_rng(seed)
    if noise:
        pixels = rng.integers(0, 256, (size[1], size[0], 3), np.uint8)
    else:
        y, x = np.mgrid[:size[1], :size[0]]
        base = rng.integers(0, 256, 3)
        pixels = ((base + 3 * x[..., None] + 5 * y[..., None]) % 256).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _chat(parts):
    return {"model": "dummy", "messages": [{"role": "user", "content": parts}], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}


@pytest.fixture(scope="module")
def llava_server(tmp_path_factory):
    path = build_tiny_llava(str(tmp_path_factory.mktemp("llava")))
    with serve_model_dir(path, FLAGS) as url:
        yield url, path


@pytest.fixture(scope="module")
def image_host():
    """A local HTTP server: /a.png an image, /slow.png one sent after 3 s, /big.png one over --max-image-bytes,
    anything else a 404."""
    image, big = _png(7), _png(8, (60, 60), noise=True)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path in ("/a.png", "/slow.png", "/big.png"):
                if self.path == "/slow.png":
                    time.sleep(3)
                body = big if self.path == "/big.png" else image
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                self.send_error(404)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", image
    server.shutdown()


def _reply_ids(body) -> list[int]:
    return [WORD_IDS[w] for w in body["choices"][0]["message"]["content"].split()]


def test_data_url_reply_equals_transformers(llava_server):
    import transformers

    url, path = llava_server
    data = _png(1)
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json=_chat([
        {"type": "image_url", "image_url": {"url": _data_url(data)}}, {"type": "text", "text": "w10 w11 w12"}]))
    assert r.status_code == 200, r.text
    body = r.json()
    # USER: <image> w10 w11 w12 ASSISTANT: with the placeholder expanded, as LlavaProcessor does
    ids = [3, *[IMAGE_TOKEN] * IMAGE_ROWS, 10, 11, 12, 4]
    assert body["usage"]["prompt_tokens"] == len(ids)
    pixels = transformers.CLIPImageProcessor.from_pretrained(path)(
        images=[Image.open(io.BytesIO(data))], return_tensors="np")["pixel_values"]
    assert _reply_ids(body) == hf_greedy(hf_model(path), ids, pixels, 6)
    # llama.cpp's clients (its web UI) offer image upload by /props
    assert httpx.get(f"{url}/props", timeout=30).json()["modalities"]["vision"] is True


def test_an_image_url_is_fetched_and_answers_as_its_data_url(llava_server, image_host):
    url, _ = llava_server
    host, data = image_host
    text = {"type": "text", "text": "w20 w21"}
    fetched = httpx.post(f"{url}/v1/chat/completions", timeout=120, json=_chat([
        {"type": "image_url", "image_url": {"url": f"{host}/a.png"}}, text]))
    inline = httpx.post(f"{url}/v1/chat/completions", timeout=120, json=_chat([
        {"type": "image_url", "image_url": {"url": _data_url(data)}}, text]))
    assert fetched.status_code == 200 and inline.status_code == 200, (fetched.text, inline.text)
    assert fetched.json()["choices"][0]["message"] == inline.json()["choices"][0]["message"]
    anthropic = httpx.post(f"{url}/v1/messages", timeout=120, json={
        "model": "dummy", "max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": f"{host}/a.png"}}, {"type": "text", "text": "w20 w21"}]}]})
    assert anthropic.status_code == 200, anthropic.text
    assert anthropic.json()["content"][0]["text"] == inline.json()["choices"][0]["message"]["content"]
    # the same pixels again: its pages came from the prefix cache
    assert inline.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_conversation_with_a_system_prompt_tools_and_an_image(llava_server):
    """Every message reaches llava-1.5's template as parts, the tools' system prompt and an earlier call too."""
    url, _ = llava_server
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={**_chat([]), "messages": [
        {"role": "system", "content": "w7 w8"},
        {"role": "user", "content": [{"type": "text", "text": "w9"},
                                     {"type": "image_url", "image_url": {"url": _data_url(_png(5))}}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "w11"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > IMAGE_ROWS


def test_anthropic_image_block_and_responses_input_image(llava_server):
    url, _ = llava_server
    data = _png(2)
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=120, json=_chat([
        {"type": "image_url", "image_url": {"url": _data_url(data)}}, {"type": "text", "text": "w30"}]))
    assert chat.status_code == 200, chat.text
    want = chat.json()["choices"][0]["message"]["content"]
    r = httpx.post(f"{url}/v1/messages", timeout=120, json={
        "model": "dummy", "max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(data).decode()}},
            {"type": "text", "text": "w30"}]}]})
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["text"] == want
    r = httpx.post(f"{url}/v1/responses", timeout=120, json={
        "model": "dummy", "max_output_tokens": 6, "temperature": 0, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": _data_url(data)}, {"type": "input_text", "text": "w30"}]}]})
    assert r.status_code == 200, r.text
    assert r.json()["output"][-1]["content"][0]["text"] == want


def _error(r) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


def test_bad_images_are_400s_naming_the_field(llava_server, image_host):
    url, _ = llava_server
    host, _ = image_host
    ok = {"type": "image_url", "image_url": {"url": _data_url(_png(3))}}
    cases = [
        ([{"type": "text", "text": "w5"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
         "messages.0.content.1.image_url.url", "not a decodable image"),
        ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}],
         "messages.0.content.0.image_url.url", "base64"),
        ([{"type": "image_url", "image_url": {"url": _data_url(_png(4, (60, 60), noise=True))}}],
         "messages.0.content.0.image_url.url", "larger than 4000 bytes"),
        ([ok, ok, ok], "messages.0.content.2", "more than 2 images"),
        ([{"type": "image_url", "image_url": {"url": f"{host}/missing.png"}}],
         "messages.0.content.0.image_url.url", "HTTP 404"),
        ([{"type": "image_url", "image_url": {"url": f"{host}/big.png"}}],
         "messages.0.content.0.image_url.url", "larger than 4000 bytes"),
        ([{"type": "image_url", "image_url": {"url": f"{host}/slow.png"}}],
         "messages.0.content.0.image_url.url", "fetching the image failed"),
        ([{"type": "image_url", "image_url": {"url": "ftp://example/a.png"}}],
         "messages.0.content.0.image_url.url", "data: or http(s) URL"),
        ([{"type": "text", "text": "w5 <image>"}, ok], "messages", "2 image placeholders for 1 images"),
        ([{"type": "text", "text": "w5 <image>"}], "messages", "1 image placeholders for 0 images"),
    ]
    for parts, param, words in cases:
        err = _error(httpx.post(f"{url}/v1/chat/completions", timeout=60, json=_chat(parts)))
        assert err["param"] == param and words in err["message"], (param, err)
    err = _error(httpx.post(f"{url}/v1/chat/completions", timeout=60, json={**_chat([ok]), "messages": [
        {"role": "user", "content": "w5"}, {"role": "assistant", "content": [ok]}]}))
    assert err["param"] == "messages.1.content.0" and "user messages" in err["message"]
    err = _error(httpx.post(f"{url}/v1/messages", timeout=60, json={
        "model": "dummy", "max_tokens": 6, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "w5"}, {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                        "data": "AAAA"}}]}]}))
    assert err["message"].startswith("messages.0.content.1.source: ") and "not a decodable image" in err["message"]
    err = _error(httpx.post(f"{url}/v1/responses", timeout=60, json={
        "model": "dummy", "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "w5"}, {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]}))
    assert err["param"] == "input[0].content[1].image_url" and "not a decodable image" in err["message"]


def test_a_processor_whose_images_the_tower_cannot_take_is_refused_at_start(tmp_path):
    import json

    from slipstream.models.config import ModelConfig
    from slipstream.server.images import ImageInputs, ImageLimits

    path = build_tiny_llava(str(tmp_path / "m"))
    cfg = ModelConfig.from_hf_json(f"{path}/config.json")
    assert ImageInputs.for_model(cfg, path, ImageLimits()).rows == IMAGE_ROWS
    with open(f"{path}/preprocessor_config.json") as f:
        raw = json.load(f)
    raw["crop_size"] = {"height": 48, "width": 48}
    with open(f"{path}/preprocessor_config.json", "w") as f:
        json.dump(raw, f)
    with pytest.raises(ValueError, match="the vision tower takes 32x32"):
        ImageInputs.for_model(cfg, path, ImageLimits())
