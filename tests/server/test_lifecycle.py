"""Readiness, engine failure, client disconnects, overload and graceful shutdown on a live server."""
from __future__ import annotations

import concurrent.futures
import json
import socket
import time

import httpx
import openai
import pytest

from tests.server.conftest import MODEL, wait_for


class _Events:
    """The `data:` payloads of one SSE response, read incrementally."""

    def __init__(self, response: httpx.Response) -> None:
        self._lines = response.iter_lines()

    def first(self) -> dict:
        for line in self._lines:
            if line.startswith("data: "):
                return json.loads(line[len("data: "):])
        raise AssertionError("stream ended before its first event")

    def rest(self) -> list[str]:
        return [line[len("data: "):] for line in self._lines if line.startswith("data: ")]


def test_ready_only_after_start_health_always(make_live) -> None:
    live = make_live(start=False)
    assert httpx.get(f"{live.url}/health").status_code == 200
    assert httpx.get(f"{live.url}/ready").status_code == 503
    live.scheduler.start()
    assert httpx.get(f"{live.url}/ready").status_code == 200
    assert live.client().completions.create(model=MODEL, prompt="abc", max_tokens=2).choices[0].text == "de"


def test_engine_failure_fails_in_flight_flips_ready_and_refuses_new(make_live) -> None:
    live = make_live(step_sleep_s=0.01, exit_on_engine_failure=False)
    with live.http() as http, http.stream("POST", "/v1/completions",
                                          json={"prompt": "a", "max_tokens": 100, "stream": True}) as stream:
        events = _Events(stream)
        assert events.first()["choices"][0]["text"]
        live.engine.fail_after_steps = 0  # the next decode step raises
        events = events.rest()
    # The stream ends with an OpenAI error event, then the [DONE] sentinel.
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "engine_error"
    # issue 12: the exception text stays in the log (it read "engine failed: OverflowError(...)")
    assert "injected" not in error["message"] and "MockEngineError" not in error["message"]
    assert httpx.get(f"{live.url}/ready").status_code == 503
    assert httpx.get(f"{live.url}/health").status_code == 200  # alive, just not ready
    with pytest.raises(openai.APIStatusError) as info:
        live.client().completions.create(model=MODEL, prompt="abc", max_tokens=2)
    assert info.value.status_code == 503
    assert live.metric("slipstream_request_errors_total") == 1


def test_engine_failure_during_a_non_streaming_request_is_503(make_live) -> None:
    live = make_live(step_sleep_s=0.01, exit_on_engine_failure=False)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(lambda: httpx.post(f"{live.url}/v1/completions", json={"prompt": "a", "max_tokens": 100},
                                                 timeout=10))
        assert wait_for(lambda: live.scheduler.stats().generated_tokens > 0)
        live.engine.fail_after_steps = 0
        response = pending.result()
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "engine_error"


def test_engine_failure_stops_the_server_so_the_process_can_exit_nonzero(make_live) -> None:
    live = make_live()
    assert live.client().completions.create(model=MODEL, prompt="abc", max_tokens=1).choices[0].text == "d"
    live.engine.fail_after_steps = 0
    with pytest.raises(openai.APIStatusError):
        live.client().completions.create(model=MODEL, prompt="abc", max_tokens=1)
    live.thread.join(timeout=5)
    assert not live.thread.is_alive() and live.server.engine_failed


def test_a_server_started_before_its_scheduler_keeps_running(make_live) -> None:
    live = make_live(start=False)
    assert not wait_for(lambda: not live.thread.is_alive(), timeout=0.5)
    assert httpx.get(f"{live.url}/health").status_code == 200


def test_stream_disconnect_frees_the_slot_within_a_second(make_live) -> None:
    live = make_live(step_sleep_s=0.01)
    with live.http() as http, http.stream("POST", "/v1/completions",
                                          json={"prompt": "a", "max_tokens": 120, "stream": True}) as stream:
        events = _Events(stream)  # kept alive: dropping its line iterator would close the connection
        events.first()
        assert live.scheduler.stats().slots_used == 1
        assert live.metric("slipstream_requests_running") == 1
    # Leaving the block closes the connection mid-stream (the request would run ~1.2 s more).
    assert wait_for(lambda: live.scheduler.stats().slots_used == 0, timeout=1.0)
    stats = live.scheduler.stats()
    assert (stats.running, stats.cancellations) == (0, 1)
    assert stats.generated_tokens < 100
    assert live.metric("jetstream_slots_used_percentage") == 0
    assert live.metric("slipstream_requests_running") == 0
    assert live.metric("slipstream_cancellations_total") == 1


def test_non_streaming_disconnect_frees_the_slot(make_live) -> None:
    live = make_live(step_sleep_s=0.01)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after 0.3 s and hangs up
        httpx.post(f"{live.url}/v1/completions", json={"prompt": "a", "max_tokens": 120}, timeout=0.3)
    assert wait_for(lambda: live.scheduler.stats().slots_used == 0, timeout=1.0)
    assert live.scheduler.stats().cancellations == 1
    assert live.metric("slipstream_cancellations_total") == 1


def test_overload_rejects_the_excess_and_completes_the_admitted(make_live) -> None:
    live = make_live(max_slots=2, max_queue=2, step_sleep_s=0.01)
    client = live.client()

    def call(_: int) -> tuple[int, str | None, str | None]:
        try:
            out = client.completions.create(model=MODEL, prompt="abc", max_tokens=20)
            return 200, out.choices[0].text, None
        except openai.RateLimitError as exc:
            return 429, None, exc.response.headers.get("retry-after")

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, range(8)))
    ok = [text for status, text, _ in results if status == 200]
    rejected = [retry for status, _, retry in results if status == 429]
    assert len(ok) + len(rejected) == 8
    assert len(ok) >= 2 and len(rejected) >= 1  # 2 slots + 2 queued; 8 arrive together
    expected = "".join(chr(ord("d") + i) for i in range(20))  # "defg...w"
    assert all(text == expected for text in ok)
    assert all(retry is not None and int(retry) >= 1 for retry in rejected)
    assert live.metric("jetstream_request_success_count_total") == len(ok)
    assert live.metric("slipstream_rejections_total", reason="overloaded") == len(rejected)


def test_graceful_shutdown_finishes_in_flight_streams(make_live) -> None:
    live = make_live(step_sleep_s=0.01, shutdown_timeout_s=5)
    with live.http() as http, http.stream("POST", "/v1/completions",
                                          json={"prompt": "a", "max_tokens": 40, "stream": True}) as stream:
        events = _Events(stream)
        text = events.first()["choices"][0]["text"]
        live.server.should_exit = True  # what SIGTERM does
        assert wait_for(lambda: not live.service.ready)  # stop admitting first
        events = events.rest()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text += "".join(c["choices"][0]["text"] for c in chunks)
    assert len(text) == 40 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    live.thread.join(timeout=10)
    assert not live.thread.is_alive()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{live.url}/health")


def test_shutdown_deadline_ends_long_streams_with_an_error(make_live) -> None:
    live = make_live(step_sleep_s=0.01, shutdown_timeout_s=0.3)
    with live.http() as http, http.stream("POST", "/v1/completions",
                                          json={"prompt": "a", "max_tokens": 120, "stream": True}) as stream:
        events = _Events(stream)
        events.first()
        live.server.should_exit = True
        events = events.rest()
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "engine_error"
    live.thread.join(timeout=10)
    assert not live.thread.is_alive()


# ---- issue 12: drain with the listener open, read timeouts, connection limit ---------------------


def test_drain_answers_503_on_ready_while_the_listener_stays_open(make_live) -> None:
    live = make_live(step_sleep_s=0.01, shutdown_timeout_s=5)
    with live.http() as http, http.stream("POST", "/v1/completions",
                                          json={"prompt": "a", "max_tokens": 60, "stream": True}) as stream:
        events = _Events(stream)
        text = events.first()["choices"][0]["text"]
        live.server.should_exit = True  # what SIGTERM does
        assert wait_for(lambda: live.service.draining)
        # Kubernetes reads /ready during the drain: it must get 503, not a refused connection.
        ready = httpx.get(f"{live.url}/ready")
        assert ready.status_code == 503
        refused = httpx.post(f"{live.url}/v1/completions", json={"prompt": "abc", "max_tokens": 1})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        events = events.rest()
    text += "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert len(text) == 60 and events[-1] == "[DONE]"
    live.thread.join(timeout=10)
    assert not live.thread.is_alive() and live.server.drain_seconds is not None
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{live.url}/health")


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    return sock


def _closed_by_server(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return True
    except (socket.timeout, TimeoutError):
        return False
    except ConnectionResetError:
        return True


def test_half_sent_headers_are_dropped_after_the_header_timeout(make_live) -> None:
    live = make_live(header_timeout_s=0.5)
    socks = [_connect(live.url) for _ in range(20)]
    for sock in socks:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # and never the rest
    start = time.monotonic()
    assert all(_closed_by_server(s, within_s=3.0) for s in socks)  # slowloris held them for good
    assert time.monotonic() - start < 3.0
    # A keep-alive connection that trickles its second request's head is dropped too.
    sock = _connect(live.url)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b"200 OK" in sock.recv(4096)
    sock.sendall(b"GET /health HTTP/1.1\r\n")
    assert _closed_by_server(sock, within_s=3.0)
    for s in [*socks, sock]:
        s.close()
    # A normal client is unaffected.
    assert httpx.get(f"{live.url}/health").status_code == 200


def test_a_body_that_stops_arriving_is_408(make_live) -> None:
    live = make_live(body_timeout_s=0.5)
    sock = _connect(live.url)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"prompt\": ")
    sock.settimeout(5)
    start = time.monotonic()
    response = b""
    while chunk := sock.recv(4096):  # the server closes the connection after the 408
        response += chunk
    assert response.startswith(b"HTTP/1.1 408") and b"request_timeout" in response
    assert time.monotonic() - start < 3.0
    sock.close()


def test_connections_past_the_limit_get_503(make_live) -> None:
    live = make_live(max_connections=3)
    idle = [_connect(live.url) for _ in range(3)]
    time.sleep(0.2)
    assert httpx.get(f"{live.url}/health").status_code == 503
    for s in idle:
        s.close()
    assert wait_for(lambda: httpx.get(f"{live.url}/health").status_code == 200)
