"""/openapi.json says what the server does (issue 12): the error statuses it really sends, in
OpenAI's error shape, 429 with Retry-After, no 422 (validation errors are 400s), /metrics as text."""
from __future__ import annotations

import httpx

from tests.server.conftest import LiveServer


def _spec(live: LiveServer) -> dict:
    response = httpx.get(f"{live.url}/openapi.json")
    assert response.status_code == 200
    return response.json()


def test_generation_routes_list_every_status_they_send(live: LiveServer) -> None:
    spec = _spec(live)
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = spec["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "408", "413", "415", "429", "500", "503"} == set(responses), path
        for status in ("400", "401", "413", "429", "503"):
            schema = responses[status]["content"]["application/json"]["schema"]
            assert schema == {"$ref": "#/components/schemas/ErrorResponse"}
        assert "Retry-After" in responses["429"]["headers"]
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}


def test_no_route_documents_a_422(live: LiveServer) -> None:
    spec = _spec(live)
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            assert "422" not in operation["responses"], (method, path)
    assert "HTTPValidationError" not in spec["components"]["schemas"]
    # What the server does instead:
    assert httpx.post(f"{live.url}/v1/completions", json={"prompt": "a", "n": "x"}).status_code == 400


def test_metrics_is_documented_as_text(live: LiveServer) -> None:
    responses = _spec(live)["paths"]["/metrics"]["get"]["responses"]
    assert set(responses["200"]["content"]) == {"text/plain"}
    assert httpx.get(f"{live.url}/metrics").headers["content-type"].startswith("text/plain")
    assert "503" in _spec(live)["paths"]["/ready"]["get"]["responses"]
