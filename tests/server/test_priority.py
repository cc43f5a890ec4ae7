"""--scheduling-policy priority: a request's `priority` (vLLM's field, lower first) lets an interactive request
run at once beside long batch jobs holding every slot, which resume afterwards with their text intact; under the
default first come, first served policy a priority other than 0 is a 400 naming it."""
from __future__ import annotations

import json

import httpx

from tests.server.conftest import wait_for


def _continuation(prompt: str, n: int) -> str:
    """MockEngine's reply to a completion prompt: each byte the last one + 1."""
    return "".join(chr(ord(prompt[-1]) + 1 + i) for i in range(n))


def test_an_urgent_request_runs_beside_batch_jobs_holding_every_slot(make_live) -> None:
    live = make_live(max_slots=2, step_sleep_s=0.01, max_seq_len=256, num_pages=128,
                     service_config={"priority_scheduling": True})
    with live.http() as http:
        jobs = [http.send(http.build_request("POST", "/v1/completions", json={
            "prompt": p, "max_tokens": 60, "priority": 10, "stream": True}), stream=True) for p in ("A", "!")]
        assert wait_for(lambda: live.metric("slipstream_requests_running") == 2)
        urgent = httpx.post(f"{live.url}/v1/chat/completions", timeout=10, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "priority": -1})
        assert urgent.status_code == 200 and urgent.json()["choices"][0]["message"]["content"] == "?@A"
        assert live.metric("slipstream_preemptions_total") >= 1
        for prompt, job in zip(("A", "!"), jobs):  # the preempted job's text is whole
            assert job.status_code == 200
            events = [json.loads(line[6:]) for line in job.iter_lines() if line.startswith("data: {")]
            job.close()
            assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == _continuation(prompt, 60)


def test_first_come_first_served_by_default_refuses_a_priority(live) -> None:
    with live.http() as http:
        for route, body in (("/v1/completions", {"prompt": "a"}), ("/v1/embeddings", {"input": "a"}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]})):
            r = http.post(route, json={**body, "priority": 3})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "priority" and "--scheduling-policy priority" in r.text
            assert http.post(route, json={**body, "priority": 0}).status_code == 200
