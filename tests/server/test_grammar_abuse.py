"""Grammar abuse under load, on the default model (SmolLM2-135M, real llguidance masks): a small
completion keeps its idle latency (within 2x) while 8 grammars whose masks would cost 36-200 ms a
token are submitted; they are refused at admission with a 400 naming the limit."""
from __future__ import annotations

import concurrent.futures
import statistics
import time

import httpx
import pytest

from slipstream.engine.grammar_cost import MAX_REGEX_SIZE
from slipstream.engine.device.runner import EngineConfig, JaxEngine
from slipstream.engine.scheduler import OutputProcessor, Scheduler, SchedulerConfig
from slipstream.server.app import create_app
from slipstream.server.service import Service, ServiceConfig
from tests.server.conftest import run_http

NESTED = "((a{50}){50}){50}"  # 16 bytes; unrolled, 125,000 positions
ABUSE = [{"prompt": "a", "max_tokens": 32, "guided_regex": NESTED},
         {"prompt": "a", "max_tokens": 32, "response_format": {"type": "json_schema", "json_schema": {
             "name": "s", "schema": {"type": "string", "pattern": f"^{NESTED}$"}}}}]
SMALL = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def url(default_model, default_tokenizer):
    cfg, params = default_model
    tokenizer = default_tokenizer
    engine = JaxEngine(cfg, params, EngineConfig(max_slots=8, page_size=16, max_seq_len=512, num_pages=128,
                                                 max_num_batched_tokens=128), precompile=False)
    scheduler = Scheduler(engine, OutputProcessor(tokenizer), SchedulerConfig(max_queue=32))
    service = Service(scheduler, engine, tokenizer, ServiceConfig(model_name="smollm2"))
    scheduler.start()
    url, server, thread = run_http(create_app(service, api_key=None))
    yield url
    server.should_exit = True
    thread.join(timeout=15)


def _latency(http: httpx.Client) -> float:
    start = time.perf_counter()
    response = http.post("/v1/completions", json=SMALL)
    assert response.status_code == 200, response.text
    return time.perf_counter() - start


def test_small_completion_keeps_its_latency_while_abusive_grammars_arrive(url: str) -> None:
    with httpx.Client(base_url=url, timeout=120) as http:
        for _ in range(3):  # compile the programs this request shape uses
            _latency(http)
        idle = statistics.median(_latency(http) for _ in range(7))
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            abusive = [pool.submit(httpx.post, f"{url}/v1/completions", json=ABUSE[i % 2], timeout=120)
                       for i in range(8)]
            time.sleep(0.05)  # they are in (or through) admission before the small ones start
            loaded = statistics.median(_latency(http) for _ in range(7))
            replies = [f.result() for f in abusive]
    print(f"\nsmall completion p50: idle {idle * 1000:.1f} ms, under grammar abuse {loaded * 1000:.1f} ms; "
          f"abusive replies {[r.status_code for r in replies]}")
    assert loaded <= 2 * idle, f"p50 {idle * 1000:.1f} ms idle -> {loaded * 1000:.1f} ms under grammar abuse"
    for reply in replies:  # refused at admission, naming the limit
        assert reply.status_code == 400, reply.text
        assert str(MAX_REGEX_SIZE) in reply.json()["error"]["message"]
