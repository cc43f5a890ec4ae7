"""`slipstream serve --model DIR` on tiny random checkpoints saved by transformers (Gemma 3 with both
layer kinds, Qwen3): the server starts, and greedy completions over HTTP are the tokens
transformers picks."""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from tests.conftest import build_tiny_hf

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORDS = [f"w{i}" for i in range(3, 256)]


def _save_word_tokenizer(path: str) -> None:
    """A word-level tokenizer over the tiny models' 256 ids: <pad> 0, <eos> 1, <bos> 2, then w3..w255."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{w: i for i, w in enumerate(WORDS, start=3)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(f"{path}/tokenizer.json")
    with open(f"{path}/tokenizer_config.json", "w") as f:
        json.dump({"eos_token": "<eos>", "bos_token": "<bos>", "add_bos_token": False}, f)


def _hf_greedy(path: str, ids: list[int], n: int) -> list[int]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# one slot and 2-token steps: 3 programs to compile before the server is ready; the prompt prefills in
# 6 chunks, the last two past Gemma 3's window
FLAGS = ["--max-slots", "1", "--max-seq-len", "64", "--kv-cache-memory", "1MiB", "--max-num-batched-tokens", "2",
         "--quantize", "none"]


@contextlib.contextmanager
def _cli_server(path: str):
    """`slipstream serve` in its own process, polled until /ready: its base URL."""
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "slipstream.server.cli", "serve", "--model", path,
                               "--port", str(port), *FLAGS,
                               "--compile-cache", os.environ.get("SLIPSTREAM_TEST_COMPILE_CACHE", "")],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, server.stdout.read()[-3000:]
            try:
                if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server not ready in 240 s"
            time.sleep(0.5)
        yield base
    finally:
        server.terminate()
        server.wait(timeout=60)


@contextlib.contextmanager
def _thread_server(path: str):
    """The same engine builder and HTTP app in this process (no second process's imports; the process's
    compile cache, as the pytest run set it)."""
    from slipstream.server.cli import build_parser
    from tests.models.test_presets_serve import serve_in_thread

    url, server, thread, _ = serve_in_thread(build_parser().parse_args(["serve", "--model", path, *FLAGS,
                                                                          "--compile-cache", ""]))
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=15)


# the CLI's process start (argument parsing, load, compile, /ready) does not depend on the family: Gemma 3
# starts one, Qwen3's checkpoint is served in this process
@pytest.mark.parametrize("family, serve", [("gemma3", _cli_server), ("qwen3", _thread_server)])
def test_serve_hf_checkpoint_answers_with_transformers_tokens(tmp_path, family, serve):
    path = build_tiny_hf(str(tmp_path / family), family)
    _save_word_tokenizer(path)
    prompt_ids = list(np.random.default_rng(5).integers(3, 256, 11))  # past Gemma 3's window of 8
    want = _hf_greedy(path, prompt_ids, 8)
    with serve(path) as base:
        prompt = " ".join(WORDS[i - 3] for i in prompt_ids)
        r = httpx.post(f"{base}/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(prompt_ids) and body["usage"]["completion_tokens"] == 8
    assert body["choices"][0]["text"].split() == [
        "<eos>" if i == 1 else "<pad>" if i == 0 else "<bos>" if i == 2 else WORDS[i - 3] for i in want]
