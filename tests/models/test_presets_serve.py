"""Every shipped model family, at a reduced size, serves with `--load-format dummy` through the CLI's
engine builder, in the CPU's default weights or the TPU's int8 mode, and answers chat and completion
requests over HTTP; `slipstream generate` runs a preset end to end in a subprocess;
SLIPSTREAM_LOAD_FORMAT sets the flag."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import httpx
import pytest

from slipstream.engine.scheduler import OutputProcessor, Scheduler, SchedulerConfig
from slipstream.server.app import create_app
from slipstream.server.cli import build_engine, build_parser, image_inputs
from slipstream.server.service import Service, ServiceConfig
from tests.server.conftest import run_http
from tests.models.test_presets import PUBLIC, shrunk_dir

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _png_url() -> str:
    """A 40x30 PNG as a data URL."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (30, 40, 3), np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# one slot (the requests come one at a time) and 2-token steps: 2 token buckets to compile; a chat
# prompt prefills in many chunks
SMALL = ["--max-slots", "1", "--max-seq-len", "64", "--kv-cache-memory", "2MiB", "--max-num-batched-tokens", "2"]
# --quantize int8 (the TPU's default): weights drawn already int8, a layer at a time, and served in float32
TPU_INT8 = ("--quantize", "int8", "--dtype", "float32")
# One preset per distinct serving path, in the CPU's default weights or the TPU's int8 mode; the presets
# left out differ from one of these only in sizes, vocabulary or token ids (tests/models/test_presets.py
# checks every preset's config and weight shapes, and draws int8 and q8_0-a16 weights of tied and untied
# llamas): llama-3.1-8b is llama-3.2-1b's llama3 RoPE with mistral-7b's untied head, gemma-3-1b is
# gemma-3-4b without the linear RoPE scaling.
SERVED = {
    "llama-3.2-1b": ("llama, tied embedding (an int8 head of the int8 table), llama3 RoPE scaling, one KV head",
                     TPU_INT8),
    "mistral-7b": ("model_type mistral, untied LM head, plain RoPE, one int eos id", ()),
    "qwen3-0.6b": ("qwen3 (q/k norms), tied embedding, two KV heads", ()),
    "qwen3-8b": ("qwen3, untied LM head, one KV head", TPU_INT8),
    "gemma-3-4b": ("gemma3: sliding and global layers, linear RoPE scaling, two KV heads", ()),
    "olmoe-1b-7b": ("olmoe: 64 experts top-8, q/k norms over the whole projection", ()),
    "llava-1.5-7b": ("llava: a CLIP tower and projector over llama, an image in a chat request", ()),
    "smolvlm-256m": ("idefics3: a SigLIP tower, pixel shuffle and linear over llama, an image's tiles in a chat", ()),
    "qwen3-30b-a3b": ("qwen3_moe: 128 experts top-8, renormalised", TPU_INT8),
    "mixtral-8x7b": ("mixtral: 8 experts top-2, no q/k norms", ()),
    "phi-4-mini": ("phi3: q/k/v and gate/up split from fused tensors, RoPE on 3/4 of head_dim, LongRoPE, tied", ()),
}


def serve_in_thread(args):
    """The CLI's engine and HTTP app for parsed `serve` args, served on a thread: (url, server, thread, tokenizer)."""
    engine, tokenizer, path = build_engine(args)
    scheduler = Scheduler(engine, OutputProcessor(tokenizer), SchedulerConfig(max_queue=8))
    service = Service(scheduler, engine, tokenizer, ServiceConfig(model_name="dummy"),
                      images=image_inputs(args, engine, path, tokenizer))
    scheduler.start()
    url, server, thread = run_http(create_app(service, api_key=None))
    return url, server, thread, tokenizer


def test_served_presets_cover_every_family():
    assert {PUBLIC[name][0] for name in SERVED} == {arch for arch, *_ in PUBLIC.values()}
    assert {mode for _, mode in SERVED.values()} == {(), TPU_INT8}


@pytest.mark.parametrize("name", sorted(SERVED))
def test_dummy_preset_serves_chat_and_completions(tmp_path, name):
    path = shrunk_dir(tmp_path, name)
    if name.startswith("smolvlm"):  # its processor's config beside it: images to 128 pixels, tiles of 64
        (tmp_path / name / "preprocessor_config.json").write_text(json.dumps({
            "image_processor_type": "Idefics3ImageProcessor", "size": {"longest_edge": 128},
            "max_image_size": {"longest_edge": 64}}))
    args = build_parser().parse_args(["serve", "--model", path, "--load-format", "dummy", *SERVED[name][1], *SMALL,
                                      "--compile-cache", ""])
    url, server, thread, tokenizer = serve_in_thread(args)
    try:
        assert tokenizer.vocab_size == PUBLIC[name][7]
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": "dummy", "messages": [{"role": "user", "content": "Say something, anything."}],
            "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["prompt_tokens"] > 8 and body["choices"][0]["finish_reason"] in ("length", "stop")
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": "dummy", "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8 and r.json()["choices"][0]["text"]
        if name.startswith("llava"):  # 28x28 pixels in 14x14 patches: 4 image positions
            r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                "model": "dummy", "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": _png_url()}}, {"type": "text", "text": "What is it?"}]}]})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == len(tokenizer.encode(
                "<|im_start|>user\n<image>What is it?<|im_end|>\n<|im_start|>assistant\n",
                add_special_tokens=False)) + 3
        if name.startswith("smolvlm"):  # 40x30 pixels -> 128x96 -> 128x128: 2x2 tiles of 64x64 and the global one
            from slipstream.models.idefics3_processor import image_prompt

            r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                "model": "dummy", "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": _png_url()}}, {"type": "text", "text": "What is it?"}]}]})
            assert r.status_code == 200, r.text
            tile_tokens = len(tokenizer.encode(image_prompt(2, 2, 1), add_special_tokens=False))
            # per tile <fake_token_around_image>, <row_r_col_c> and its one row; 3 newlines (bytes); the global image's 4
            assert tile_tokens == 4 * 3 + 3 + 4
            assert r.json()["usage"]["prompt_tokens"] == len(tokenizer.encode(
                "<|im_start|>user\n<image>What is it?<|im_end|>\n<|im_start|>assistant\n",
                add_special_tokens=False)) - 1 + tile_tokens
    finally:
        server.should_exit = True
        thread.join(timeout=15)


def test_load_format_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_LOAD_FORMAT", "dummy")
    assert build_parser().parse_args(["serve", "--model", "qwen3-0.6b"]).load_format == "dummy"
    monkeypatch.delenv("SLIPSTREAM_LOAD_FORMAT")
    assert build_parser().parse_args(["generate", "--prompt", "x"]).load_format == "auto"


def test_generate_runs_a_dummy_preset_directory(tmp_path):
    path = shrunk_dir(tmp_path, "mistral-7b")
    # the run's compile cache: the programs of mistral-7b's one-slot engine served above, loaded
    cache = os.environ.get("SLIPSTREAM_TEST_COMPILE_CACHE", "")
    out = subprocess.run([sys.executable, "-m", "slipstream.server.cli", "generate", "--model", path, "--load-format", "dummy",
                          "--prompt", "Hello", "--max-tokens", "6", *SMALL, "--compile-cache", cache],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip(), out.stderr[-3000:]
    assert "random: --load-format dummy" in out.stderr
    assert "device: 1 x cpu (cpu backend" in out.stderr and "kernels on cpu: " in out.stderr
