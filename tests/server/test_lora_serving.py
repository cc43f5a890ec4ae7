"""Multi-LoRA through the HTTP API (and gRPC's request field) over the tiny Llama's real engine: the
request's `model` picks the adapter, runtime load/unload behind the API key, /v1/models, clear 400s
and 404s, per-adapter metrics, an adapter unloaded while its request runs, and no recompiles."""
from __future__ import annotations

import concurrent.futures
import os

import httpx
import pytest

pytest.importorskip("peft")

from slipstream.engine.lora_registry import LoraRegistry  # noqa: E402
from slipstream.engine.scheduler import OutputProcessor, Scheduler, SchedulerConfig  # noqa: E402
from slipstream.models.lora import load_adapter  # noqa: E402
from slipstream.server.app import create_app  # noqa: E402
from slipstream.server.grpc_service import prepare_decode  # noqa: E402
from slipstream.server.service import Service, ServiceConfig  # noqa: E402
from tests.engine.lora_helpers import make_adapter, reference_greedy  # noqa: E402
from tests.server.conftest import run_http, wait_for  # noqa: E402
from tests.server.grpc_helpers import text_request  # noqa: E402

BASE, KEY = "tiny", "sekret"
PROMPTS = [[5, 17, 33, 99, 7, 200, 3], [9, 8, 7, 6, 5, 4, 3, 21, 22]]


class IdTokenizer:
    """Text is token ids separated by spaces, both ways (the tiny model has no real tokenizer)."""

    eos_token_ids = frozenset()

    def encode(self, text, *, add_special_tokens=True):
        return [int(t) for t in text.split()]

    def decode(self, ids, *, skip_special_tokens=True):
        return "".join(f" {i}" for i in ids)

    def apply_chat_template(self, messages, *, add_generation_prompt=True):
        return " ".join(m["content"] for m in messages)


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tiny_model, tiny_lora_adapters, tiny_lora_engine):
    cfg, model = tiny_model
    root, dirs = tiny_lora_adapters
    if not os.path.isdir(os.path.join(root, "rank16")):
        make_adapter(tiny_llama_dir, os.path.join(root, "rank16"), 16, 16, ["q_proj"])
    engine = tiny_lora_engine
    registry = LoraRegistry(lambda n, p: load_adapter(n, p, engine.lora.targets, cfg.num_layers, 8), root)
    registry.load("attn", "attn")
    scheduler = Scheduler(engine, OutputProcessor(IdTokenizer()), SchedulerConfig(max_queue=64))
    scheduler.start()
    service = Service(scheduler, engine, IdTokenizer(), ServiceConfig(model_name=BASE), lora=registry)
    app = create_app(service, api_key=KEY, web_ui=False, lora_updates=True)
    url, http_server, thread = run_http(app)
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    yield tiny_llama_dir, dirs, engine, service, http
    http_server.should_exit = True
    thread.join(timeout=15)


def _complete(http, model, prompt, n=5, **extra):
    r = http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
                                           "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    return [int(t) for t in r.json()["choices"][0]["text"].split()]


def _metric(http, name, adapter):
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(f'{name}_total{{adapter="{adapter}"}}'):
            return float(line.split()[-1])
    return None


def test_runtime_load_refuses_bad_adapters_and_escapes(server):
    _, _, _, _, http = server
    assert httpx.post(str(http.base_url) + "/v1/load_lora_adapter",
                      json={"lora_name": "x", "lora_path": "mlp"}).status_code == 401
    for body, status, text in [
        ({"lora_name": "x", "lora_path": "../etc"}, 400, "outside --lora-root"),
        ({"lora_name": "x", "lora_path": "/etc"}, 400, "outside --lora-root"),
        ({"lora_name": "x", "lora_path": "rank16"}, 400, "rank16/adapter_config.json: r must be an integer in [1, 8]"),
        ({"lora_name": "x", "lora_path": "nowhere"}, 400, "nowhere: not a directory"),
        ({"lora_name": "attn", "lora_path": "attn"}, 400, "already loaded"),
        ({"lora_name": BASE, "lora_path": "attn"}, 400, "base model's name"),
        ({"lora_name": "x"}, 400, "lora_path"),
    ]:
        r = http.post("/v1/load_lora_adapter", json=body)
        assert r.status_code == status and text in r.json()["error"]["message"], (body, r.text)
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "x"}).status_code == 404
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [BASE, "attn"]


def test_requests_pick_adapters_by_model_in_one_batch(server):
    base_dir, dirs, engine, service, http = server
    for name in ("mlp", "all"):
        r = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": name})
        assert r.status_code == 200, r.text
    cards = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert cards["mlp"]["parent"] == BASE and cards[BASE]["parent"] is None
    assert http.get("/v1/models/all").json()["parent"] == BASE
    assert http.post("/v1/completions", json={"model": "nope", "prompt": "1 2"}).status_code == 404
    before = engine.compile_count
    jobs = [(model, prompt) for model in (BASE, "attn", "mlp", "all") for prompt in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:  # 3 adapters over 2 slots: swaps
        outs = list(pool.map(lambda j: _complete(http, j[0], " ".join(map(str, j[1]))), jobs))
    for (model, prompt), out in zip(jobs, outs):
        want, _ = reference_greedy(base_dir, None if model == BASE else dirs[model], prompt, 5)
        assert out == want, model
    chat = http.post("/v1/chat/completions", json={"model": "mlp", "max_tokens": 5, "temperature": 0,
                                                   "messages": [{"role": "user", "content": "5 17 33"}]})
    assert chat.status_code == 200
    assert [int(t) for t in chat.json()["choices"][0]["message"]["content"].split()] == \
        reference_greedy(base_dir, dirs["mlp"], [5, 17, 33], 5)[0]
    assert engine.compile_count == before
    assert _metric(http, "slipstream_lora_requests", "mlp") == 3
    assert _metric(http, "slipstream_lora_generated_tokens", "mlp") == 15
    assert prepare_decode(service, text_request("5 17", 3, lora_adapter_id="all"), ()).lora.name == "all"


def test_unloading_an_adapter_in_use_lets_its_requests_finish(server):
    base_dir, dirs, engine, _, http = server
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": "all"}).status_code == 200
    prompt = PROMPTS[0]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(_complete, http, "late", " ".join(map(str, prompt)), 100)
        assert wait_for(lambda: engine.lora is not None and _metric(http, "slipstream_lora_requests", "late") == 1)
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
        assert not running.done()  # unloaded while its request runs
        out = running.result(timeout=120)
    assert out == reference_greedy(base_dir, dirs["all"], prompt, 100)[0]
    assert http.post("/v1/completions", json={"model": "late", "prompt": "1 2"}).status_code == 404
    assert _metric(http, "slipstream_lora_requests", "late") is None  # labels only for loaded adapters
    assert "late" not in [m["id"] for m in http.get("/v1/models").json()["data"]]


def test_load_unload_cycles_leave_device_memory_and_programs_flat(server):
    import jax

    _, _, engine, _, http = server

    def live():
        arrays = jax.live_arrays()
        return len(arrays), sum(a.nbytes for a in arrays)

    _complete(http, "attn", "5 17 33", 2)  # every program this test runs has run once
    before, compiles = live(), engine.compile_count
    for i in range(100):
        path = ("mlp", "all", "attn")[i % 3]
        assert http.post("/v1/load_lora_adapter", json={"lora_name": "cycle", "lora_path": path}).status_code == 200
        if i % 10 == 0:  # a request puts it in a device slot (swapping another out)
            _complete(http, "cycle", "5 17 33", 2)
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "cycle"}).status_code == 200
    assert live() == before
    assert engine.compile_count == compiles
