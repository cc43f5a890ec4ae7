"""/metrics: JetStream names for autoscaling plus slipstream_* values that match what was served."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL, wait_for

JETSTREAM = ["jetstream_prefill_backlog_size", "jetstream_slots_used_percentage", "jetstream_time_to_first_token",
             "jetstream_time_per_output_token", "jetstream_request_success_count", "jetstream_request_input_length",
             "jetstream_request_output_length", "jetstream_queue_duration", "jetstream_server_startup_latency"]
SLIPSTREAM = ["slipstream_kv_pages_used", "slipstream_kv_pages_cached", "slipstream_kv_pages_total", "slipstream_prefix_cache_queries",
              "slipstream_prefix_cache_hits", "slipstream_preemptions", "slipstream_rejections",
              "slipstream_cancellations", "slipstream_compiles", "slipstream_generated_tokens",
              "slipstream_prompt_tokens", "slipstream_requests_running", "slipstream_requests_waiting",
              "slipstream_request_errors"]


def test_every_metric_is_exported_with_prometheus_content_type(make_live) -> None:
    live = make_live()
    response = httpx.get(f"{live.url}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    names = {family.name for family in text_string_to_metric_families(response.text)}
    assert set(JETSTREAM + SLIPSTREAM) <= names, set(JETSTREAM + SLIPSTREAM) - names


def test_values_follow_the_requests_served(make_live) -> None:
    live = make_live(num_pages=64)
    client = live.client()
    client.completions.create(model=MODEL, prompt="abc", max_tokens=5)          # 4 prompt tokens
    client.completions.create(model=MODEL, prompt="abc", max_tokens=3, n=2)     # 2 x (4 + 3)
    # No waiting: a request is counted before its client sees it end (issue 12's read-after-callback race).
    m = live.metrics()

    def value(name: str, **labels: str) -> float:
        (found,) = [v for (n, have), v in m.items() if n == name and set(labels.items()) <= set(have)]
        return found

    # scheduler values carry their replica (one shape for dashboards); histograms and compiles do not
    assert m[("slipstream_generated_tokens_total", (("replica", "0"),))] == 11
    assert m[("slipstream_rejections_total", (("reason", "too_long"), ("replica", "0")))] == 0
    assert ("jetstream_time_to_first_token_count", ()) in m and ("slipstream_compiles_total", ()) in m

    assert value("jetstream_request_success_count_total") == 3
    assert value("slipstream_generated_tokens_total") == 5 + 3 + 3
    assert value("slipstream_prompt_tokens_total") == 4 * 3
    assert value("jetstream_request_input_length_sum") == 12
    assert value("jetstream_request_output_length_sum") == 11
    assert value("jetstream_time_to_first_token_count") == 3
    assert value("jetstream_time_per_output_token_count") == (5 - 1) + 2 * (3 - 1)
    assert value("jetstream_queue_duration_count") == 3
    assert value("slipstream_kv_pages_total") == 63  # page 0 is padding
    # Idle: no page is held by a request; the full page of BOS + "abc" stays in the prefix cache.
    assert value("slipstream_kv_pages_used") == 0
    assert value("slipstream_kv_pages_cached") >= 1
    assert value("slipstream_compiles_total") == 0
    assert value("slipstream_requests_running") == 0 and value("jetstream_prefill_backlog_size") == 0
    assert value("slipstream_rejections_total", reason="overloaded") == 0
    assert value("jetstream_server_startup_latency") >= 0
    # The n=2 siblings share the prompt's pages through the prefix cache.
    assert value("slipstream_prefix_cache_queries_total") >= 1


def test_slot_and_backlog_gauges_while_busy(make_live) -> None:
    live = make_live(max_slots=2, step_sleep_s=0.01)
    with live.http() as a, live.http() as b, live.http() as c:
        body = {"prompt": "a", "max_tokens": 120, "stream": True}
        streams = [h.send(h.build_request("POST", "/v1/completions", json=body), stream=True) for h in (a, b, c)]
        assert wait_for(lambda: live.scheduler.stats().waiting == 1 and live.scheduler.stats().slots_used == 2)
        assert live.metric("jetstream_slots_used_percentage") == 1.0
        assert live.metric("jetstream_prefill_backlog_size") == 1
        assert live.metric("slipstream_requests_waiting") == 1
        assert live.metric("slipstream_requests_running") == 2
        assert live.metric("slipstream_kv_pages_used") >= 2
        for s in streams:
            s.close()
    assert wait_for(lambda: live.metric("slipstream_requests_running") == 0, timeout=1.0)
    assert live.metric("slipstream_cancellations_total") == 3


def test_each_app_has_its_own_registry(make_live) -> None:
    first, second = make_live(), make_live()
    first.client().completions.create(model=MODEL, prompt="abc", max_tokens=2)
    assert first.metric("slipstream_generated_tokens_total") == 2
    assert second.metric("slipstream_generated_tokens_total") == 0


def test_data_parallel_replicas_share_the_load_and_are_labelled(make_live) -> None:
    """Two replicas behind one server: concurrent requests all complete, both replicas serve some,
    and each scheduler value is exported once per replica (histograms over both, unlabelled)."""
    live = make_live(replicas=2, step_sleep_s=0.002)
    client = live.client()
    prompts = [f"q{i}:" for i in range(8)]  # distinct, no shared full page: routed by load alone
    with ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(lambda p: client.completions.create(model=MODEL, prompt=p, max_tokens=6)
                              .choices[0].text, prompts))
    assert texts == [";<=>?@"] * len(prompts)  # MockEngine: each token is the previous byte + 1
    assert httpx.get(f"{live.url}/ready").status_code == 200
    m = live.metrics()
    generated = {r: m[("slipstream_generated_tokens_total", (("replica", r),))] for r in ("0", "1")}
    assert generated["0"] + generated["1"] == 6 * len(prompts)
    assert generated["0"] > 0 and generated["1"] > 0
    assert all(engine.steps for engine in live.engines)
    assert sum(m[("jetstream_request_success_count_total", (("replica", r),))] for r in "01") == len(prompts)
    assert m[("slipstream_kv_pages_total", (("replica", "1"),))] == 127
    assert {labels for name, labels in m if name == "jetstream_slots_used_percentage"} == {
        (("replica", "0"),), (("replica", "1"),)}
    assert m[("jetstream_time_to_first_token_count", ())] == len(prompts)


def test_a_failed_replica_fails_its_request_and_ready_while_the_other_finishes(make_live) -> None:
    live = make_live(replicas=2, step_sleep_s=0.005, exit_on_engine_failure=False)
    live.engines[1].fail_after_steps = 2

    def complete(prompt: str) -> httpx.Response:
        return httpx.post(f"{live.url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 20},
                          timeout=10)

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(complete, "a")  # replica 0 (the first turn)
        assert wait_for(lambda: live.scheduler.replica_stats()[0].running == 1)
        second = pool.submit(complete, "b")  # replica 1, the less loaded: its engine fails at its third step
        failed = second.result()
        assert failed.status_code == 503 and failed.json()["error"]["code"] == "engine_error"
        assert httpx.get(f"{live.url}/ready").status_code == 503
        served = first.result()
    assert served.status_code == 200 and served.json()["choices"][0]["text"] == "bcdefghijklmnopqrstu"
    assert live.metric("slipstream_request_errors_total", replica="1") == 1
    assert live.metric("slipstream_request_errors_total", replica="0") == 0
    assert live.metric("jetstream_request_success_count_total", replica="0") == 1
