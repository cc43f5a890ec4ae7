"""End to end with the real JAX engine: a tiny random model with SmolLM2's vocabulary, the real
tokenizer and chat template, the official openai client, a raw SSE stream, `echo` with logprobs
(scoring a prompt), and embeddings."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
import pytest

from slipstream.engine.device.runner import EngineConfig, JaxEngine
from slipstream.engine.scheduler import OutputProcessor, Scheduler, SchedulerConfig
from slipstream.models.loader import load_hf_dir
from slipstream.server.app import create_app
from slipstream.server.http_server import make_server
from slipstream.server.service import Service, ServiceConfig
from tests.conftest import build_tiny_hf


@pytest.fixture(scope="module")
def tiny_smol_dir(tmp_path_factory) -> str:
    """A tiny random Llama with SmolLM2's vocabulary, saved by transformers."""
    import transformers

    path = str(tmp_path_factory.mktemp("tiny-smol-vocab"))
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def real_server(tiny_smol_dir, default_tokenizer):
    cfg, params = load_hf_dir(tiny_smol_dir)
    tokenizer = default_tokenizer
    engine = JaxEngine(cfg, params, EngineConfig(max_slots=4, page_size=16, max_seq_len=256, num_pages=64,
                                                 max_num_batched_tokens=64), eos_token_ids=tuple(tokenizer.eos_token_ids))
    scheduler = Scheduler(engine, OutputProcessor(tokenizer), SchedulerConfig(max_queue=32))
    service = Service(scheduler, engine, tokenizer, ServiceConfig(model_name="tiny"))
    app = create_app(service, api_key=None)
    scheduler.start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = make_server(app, "127.0.0.1", port, log_level="warning", shutdown_timeout_s=5)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", scheduler
    server.should_exit = True
    thread.join(timeout=15)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_completion_stream_equals_non_stream(real_server):
    url, _ = real_server
    c = client(url)
    full = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0)
    assert full.choices[0].finish_reason in ("length", "stop")
    assert full.usage.prompt_tokens == 4
    assert full.usage.completion_tokens == (12 if full.choices[0].finish_reason == "length" else
                                            full.usage.completion_tokens)
    pieces = [chunk.choices[0].text for chunk in c.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0, stream=True) if chunk.choices]
    assert "".join(pieces) == full.choices[0].text


def test_chat_n2_seeded_and_logprobs(real_server):
    url, _ = real_server
    c = client(url)
    resp = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi there 🙂"}],
                                     max_tokens=8, n=2, temperature=1.0, seed=42, logprobs=True, top_logprobs=2)
    assert len(resp.choices) == 2
    for choice in resp.choices:
        assert len(choice.logprobs.content) >= 1
        assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    again = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi there 🙂"}],
                                      max_tokens=8, n=2, temperature=1.0, seed=42)
    assert [ch.message.content for ch in again.choices] == [ch.message.content for ch in resp.choices]


def test_raw_sse_framing(real_server):
    url, _ = real_server
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 3, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 3


def test_disconnect_mid_stream_frees_the_slot(real_server):
    url, scheduler = real_server
    body = {"model": "tiny", "prompt": "a long story", "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert scheduler.stats().slots_used == 1
    deadline = time.monotonic() + 1.0
    while scheduler.stats().slots_used and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scheduler.stats().slots_used == 0
    assert scheduler.stats().cancellations >= 1


def test_issue_12_repro_top_k_past_int32_is_400_and_the_stream_in_flight_finishes(real_server):
    """The issue's reproduction on the real engine: a stream in flight, then top_k=2**31. It used
    to overflow np.int32 on the engine thread, failing the engine, the stream and the process."""
    url, scheduler = real_server
    body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=url, timeout=60) as http, http.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        bad = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "top_k": 2147483648})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_k"
        events = [first, *(line for line in lines if line.startswith("data: "))]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all("error" not in c for c in chunks) and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert scheduler.ready and httpx.get(f"{url}/ready").status_code == 200


def test_metrics_say_which_path_each_kernel_takes(real_server):
    """A failed kernel build must be visible to operators: /metrics names the path of every hot op."""
    import os

    import httpx

    url, _ = real_server
    text = httpx.get(f"{url}/metrics").text
    want = "reference" if os.environ.get("SLIPSTREAM_KERNELS") == "reference" else "native"
    assert f'slipstream_kernel_path{{kernel="ragged_paged_attention",path="{want}"}} 1.0' in text
    assert f'slipstream_kernel_path{{kernel="q8_matmul",path="{want}"}} 1.0' in text  # the CPU default mode
    if want == "native":  # and which instruction set it runs: the best this CPU has (AMX where granted)
        import slipstream.kernels._q8_matmul as ext
        assert f'slipstream_kernel_isa{{isa="{ext.isa()}",kernel="q8_matmul"}} 1.0' in text


# ---- /v1/completions with echo: the prompt before the output, with logprobs the prompt tokens' too (what
# evaluation harnesses send to score a continuation: token-id prompts, echo, logprobs, max_tokens 0 or 1) ----------

def _prompt(default_tokenizer, text: str) -> list[int]:
    return list(default_tokenizer.encode(text, add_special_tokens=False))


def test_echoed_prompt_logprobs_equal_each_prefix_s_next_token_logprob(real_server, default_tokenizer):
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


def test_max_tokens_zero_echo_scores_the_prompt_alone(real_server, default_tokenizer):
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


def test_streamed_echo_equals_the_response(real_server):
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


def test_each_of_n_choices_and_prompts_echoes_its_own_prompt(real_server):
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


def test_embeddings_equal_transformers_while_a_stream_runs(real_server, tiny_smol_dir):
    """The openai client's embeddings (base64 on the wire) of texts short and several steps long, taken while a
    completion streams: each is transformers' last hidden state of the text's ids, normalized; the stream is
    unchanged by them."""
    import numpy as np
    import torch
    import transformers

    url, _ = real_server
    c = client(url)
    args = dict(model="tiny", prompt="Once upon a time", max_tokens=24, temperature=0)
    alone = c.completions.create(**args).choices[0].text
    texts = ["Paris is the capital of France.", "word " * 150, "x"]
    stream = c.completions.create(**args, stream=True)
    first = next(stream).choices[0].text  # the stream has begun before the embeddings are asked for
    out = c.embeddings.create(model="tiny", input=texts)
    assert first + "".join(ch.choices[0].text for ch in stream if ch.choices) == alone
    hf = transformers.AutoModel.from_pretrained(tiny_smol_dir, torch_dtype=torch.float32).eval()
    want = []
    for text in texts:
        ids = httpx.post(f"{url}/tokenize", json={"prompt": text}, timeout=60).json()["tokens"]
        with torch.no_grad():
            last = hf(torch.tensor([ids])).last_hidden_state[0, -1].numpy()
        want.append(last / np.linalg.norm(last))
    got = np.array([d.embedding for d in out.data])
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    cosine = got @ np.array(want).T  # the server's weights are int8 (q8_0-a16) and its K/V bf16: not f32's digits
    assert np.diag(cosine).min() > 0.9999 and (cosine - np.eye(3)).max() < 0.9  # each its own text's, not another's
    assert out.usage.prompt_tokens == sum(len(httpx.post(f"{url}/tokenize", json={"prompt": t}, timeout=60)
                                              .json()["tokens"]) for t in texts)
