"""--max-requests-per-client: one client's queued plus running requests are capped (429 beyond),
others are not held back by it; off (0) by default."""
from __future__ import annotations

import httpx

from tests.server.conftest import LiveServer, wait_for


def _stream(http: httpx.Client, user: str | None) -> httpx.Response:
    body = {"prompt": "a", "max_tokens": 100, "stream": True, **({"user": user} if user else {})}
    return http.send(http.build_request("POST", "/v1/completions", json=body), stream=True)


def _small(live: LiveServer, user: str | None) -> httpx.Response:
    body = {"prompt": "abc", "max_tokens": 1, **({"user": user} if user else {})}
    return httpx.post(f"{live.url}/v1/completions", json=body, timeout=10)


def test_a_client_past_its_cap_gets_429_and_others_still_run(make_live) -> None:
    live = make_live(step_sleep_s=0.02, service_config={"max_requests_per_client": 2})
    with live.http() as a1, live.http() as a2:
        held = [_stream(a1, "alice"), _stream(a2, "alice")]
        assert all(r.status_code == 200 for r in held)
        refused = _small(live, "alice")
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["code"] == "too_many_requests" and "the limit is 2" in error["message"]
        assert _small(live, "bob").status_code == 200
        held[0].close()  # alice's first request ends: her place comes back
        assert wait_for(lambda: _small(live, "alice").status_code == 200)
        held[1].close()
    assert live.metric("slipstream_http_responses_total", route="/v1/completions", status_class="4xx",
                       code="too_many_requests") >= 1


def test_off_by_default(make_live) -> None:
    live = make_live(step_sleep_s=0.02)
    clients = [live.http() for _ in range(3)]
    try:
        held = [_stream(c, "alice") for c in clients]
        assert all(r.status_code == 200 for r in held) and _small(live, "alice").status_code == 200
        for r in held:
            r.close()
    finally:
        for c in clients:
            c.close()
