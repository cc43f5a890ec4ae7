"""Images for a tiny random Idefics3 (SmolVLM's architecture) served as the CLI builds it: the prompt and tiles a chat
request makes equal transformers' Idefics3Processor's (image splitting on and off), its greedy reply equals
transformers', Anthropic's image block and the Responses API's input_image answer the same, and the limits hold."""
from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.models.idefics3_helpers import (IMAGE_ROWS, IMAGE_TOKEN, build_tiny_idefics3, hf_greedy, hf_model,
                                           hf_processor, save_processor_files)
from tests.server.conftest import serve_model_dir

FLAGS = ["--max-slots", "2", "--max-seq-len", "128", "--kv-cache-memory", "1MiB", "--max-num-batched-tokens", "16",
         "--quantize", "none", "--max-images-per-request", "2", "--compile-cache", ""]


def _image(seed: int, size=(40, 30)) -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[:size[1], :size[0]]
    pixels = (rng.integers(0, 256, 3) + 5 * x[..., None] + 3 * y[..., None] + rng.integers(0, 60, (*size[::-1], 3)))
    return Image.fromarray((pixels % 256).astype(np.uint8))


def _data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _chat(parts, max_tokens: int = 6):
    return {"model": "dummy", "messages": [{"role": "user", "content": parts}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "logprobs": True, "return_tokens_as_token_ids": True}


def _reply_ids(body) -> list[int]:
    return [int(t["token"].removeprefix("token_id:")) for t in body["choices"][0]["logprobs"]["content"]]


def _hf_inputs(path: str, images: list[Image.Image], text: str) -> tuple[list[int], np.ndarray]:
    processor = hf_processor(path)
    messages = [{"role": "user", "content": [*({"type": "image"} for _ in images), {"type": "text", "text": text}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    out = processor(text=prompt, images=images, return_tensors="np")
    return out["input_ids"][0].tolist(), out["pixel_values"][0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_processor_files(build_tiny_idefics3(str(tmp_path_factory.mktemp("idefics3"))))


@pytest.mark.parametrize("splitting", [True, False])
def test_expanded_prompt_and_tiles_equal_transformers_processor(tmp_path, splitting):
    from slipstream.models.config import ModelConfig
    from slipstream.models.tokenizer import Tokenizer
    from slipstream.server.images import ImageInputs, ImageLimits

    path = save_processor_files(build_tiny_idefics3(str(tmp_path / "m")), splitting=splitting)
    tokenizer = Tokenizer.from_hf_dir(path)
    images = ImageInputs.for_model(ModelConfig.from_hf_json(f"{path}/config.json"), path, ImageLimits(), tokenizer)
    pictures = [_image(1), _image(2, (20, 50))]
    want_ids, want_pixels = _hf_inputs(path, pictures, "w10 w11")
    loaded = [images.from_url(_data_url(p), f"messages.0.content.{i}") for i, p in enumerate(pictures)]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                             {"type": "text", "text": "w10 w11"}]}]
    rendered = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    ids, inputs = images.expand(rendered, loaded, "messages")
    assert ids == want_ids
    assert len(inputs) == len(want_pixels) == (8 if splitting else 2)  # 2x2 and 2x1 tiles, each with its global
    np.testing.assert_allclose(np.stack([i.pixels for i in inputs]), want_pixels, atol=1e-6, rtol=0)
    for image in inputs:
        assert ids[image.offset:image.end] == [IMAGE_TOKEN] * IMAGE_ROWS
        assert ids[image.offset - 1] != IMAGE_TOKEN and ids[image.end] != IMAGE_TOKEN
    assert ids.count(IMAGE_TOKEN) == IMAGE_ROWS * len(inputs)


@pytest.fixture(scope="module")
def idefics3_server(model_dir):
    with serve_model_dir(model_dir, FLAGS) as url:
        yield url


def test_chat_reply_equals_transformers_and_other_apis_answer_the_same(idefics3_server, model_dir):
    url = idefics3_server
    picture = _image(3)
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json=_chat([
        {"type": "image_url", "image_url": {"url": _data_url(picture)}}, {"type": "text", "text": "w20 w21 w22"}]))
    assert r.status_code == 200, r.text
    ids, pixels = _hf_inputs(model_dir, [picture], "w20 w21 w22")
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    want = hf_greedy(hf_model(model_dir), ids, pixels, 6)
    assert _reply_ids(r.json()) == want
    text = r.json()["choices"][0]["message"]["content"]
    source = {"type": "base64", "media_type": "image/png", "data": _data_url(picture).partition(",")[2]}
    anthropic = httpx.post(f"{url}/v1/messages", timeout=120, json={
        "model": "dummy", "max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "image", "source": source}, {"type": "text", "text": "w20 w21 w22"}]}]})
    assert anthropic.status_code == 200, anthropic.text
    assert anthropic.json()["content"][0]["text"] == text
    responses = httpx.post(f"{url}/v1/responses", timeout=120, json={
        "model": "dummy", "max_output_tokens": 6, "temperature": 0, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": _data_url(picture)}, {"type": "input_text", "text": "w20 w21 w22"}]}]})
    assert responses.status_code == 200, responses.text
    assert responses.json()["output"][-1]["content"][0]["text"] == text


def test_limits_and_placeholders_are_400s(idefics3_server):
    url = idefics3_server
    ok = {"type": "image_url", "image_url": {"url": _data_url(_image(4))}}
    for parts, param, words in [
            ([ok, ok, ok], "messages.0.content.2", "more than 2 images"),
            ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
             "messages.0.content.0.image_url.url", "not a decodable image"),
            ([{"type": "text", "text": "w5 <image>"}, ok], "messages", "2 image placeholders for 1 images")]:
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json=_chat(parts))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], (param, err)


def test_a_processor_whose_tiles_the_tower_cannot_take_is_refused_at_start(model_dir, tmp_path):
    import json
    import shutil

    from slipstream.models.config import ModelConfig
    from slipstream.models.tokenizer import Tokenizer
    from slipstream.server.images import ImageInputs, ImageLimits

    path = shutil.copytree(model_dir, tmp_path / "m")
    cfg = ModelConfig.from_hf_json(f"{path}/config.json")
    with pytest.raises(ValueError, match="need its tokenizer"):
        ImageInputs.for_model(cfg, str(path), ImageLimits())
    raw = json.loads((path / "preprocessor_config.json").read_text())
    (path / "preprocessor_config.json").write_text(json.dumps({**raw, "max_image_size": {"longest_edge": 48}}))
    with pytest.raises(ValueError, match="tiles of 48x48 pixels; the vision tower takes 32x32"):
        ImageInputs.for_model(cfg, str(path), ImageLimits(), Tokenizer.from_hf_dir(str(path)))
