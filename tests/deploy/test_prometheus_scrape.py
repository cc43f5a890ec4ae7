"""A real Prometheus, configured from deploy/prometheus/prometheus.yml, scrapes a live Slipstream
server; request counts, TTFT buckets and the dashboard/adapter queries are read back through
Prometheus' HTTP query API."""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest
import yaml

from tests.deploy.conftest import DEPLOY, free_port

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="needs the prometheus binary (Debian package 'prometheus')")

SCRAPE_INTERVAL = "1s"


def scrape_config(target: str) -> dict[str, Any]:
    """The shipped config, scraping `target` every second. Only the static job is kept: Debian's
    Prometheus has no Kubernetes discovery, and there is no cluster here anyway."""
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "slipstream"]
    job["static_configs"] = [{"targets": [target]}]
    job["scrape_interval"] = SCRAPE_INTERVAL
    job["scrape_timeout"] = SCRAPE_INTERVAL
    config["scrape_configs"] = [job]
    config["global"]["evaluation_interval"] = SCRAPE_INTERVAL
    return config


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, promql: str) -> list[dict[str, Any]]:
        body = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=5).json()
        if body["status"] != "success":
            raise AssertionError(f"{promql}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]["result"]

    def value(self, promql: str) -> float | None:
        result = self.query(promql)
        return float(result[0]["value"][1]) if result else None

    def wait(self, what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError(f"Prometheus: {what} not seen within {timeout:.0f}s")
            time.sleep(0.25)


@pytest.fixture(scope="module")
def prometheus(live_server_url: str, tmp_path_factory) -> Iterator[Prometheus]:
    work: Path = tmp_path_factory.mktemp("prometheus")
    target = live_server_url.removeprefix("http://")
    (work / "prometheus.yml").write_text(yaml.safe_dump(scrape_config(target)))
    port = free_port()
    log = (work / "prometheus.log").open("wb")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={work / 'prometheus.yml'}",
                             f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                             "--log.level=warn"], stdout=log, stderr=subprocess.STDOUT)
    prom = Prometheus(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"prometheus exited {proc.returncode}:\n{(work / 'prometheus.log').read_text()}")
            try:
                if httpx.get(f"{prom.url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("prometheus not ready within 30s")
            time.sleep(0.2)
        prom.wait("the first successful scrape", lambda: prom.value('up{job="slipstream"}') == 1.0)
        yield prom
    finally:
        proc.terminate()
        proc.wait(timeout=15)
        log.close()


def complete(url: str, n: int) -> None:
    """n short completions, half of them streamed, each checked for generated text."""
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    with httpx.Client(base_url=url, timeout=120) as client:
        for i in range(n):
            body = {"model": model, "prompt": f"Count: {i}", "max_tokens": 4, "temperature": 0,
                    "stream": i % 2 == 1}
            resp = client.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            if body["stream"]:
                events = [line.removeprefix("data: ") for line in resp.text.splitlines() if line.startswith("data: ")]
                assert events[-1] == "[DONE]"
                assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
            else:
                assert resp.json()["choices"][0]["text"]


def test_request_counters_and_ttft_histogram_arrive_in_prometheus(prometheus, live_server_url):
    success = 'jetstream_request_success_count_total{job="slipstream"}'
    before = prometheus.value(success)
    assert before is not None, "the success counter is missing from the scrape"
    ttft_before = prometheus.value('jetstream_time_to_first_token_bucket{job="slipstream",le="+Inf"}') or 0.0
    complete(live_server_url, 4)
    prometheus.wait("4 more successful requests", lambda: (prometheus.value(success) or 0) >= before + 4)

    buckets = prometheus.query('jetstream_time_to_first_token_bucket{job="slipstream"}')
    counts = sorted((float(b["metric"]["le"]), float(b["value"][1])) for b in buckets)
    assert len(counts) >= 5 and counts[-1][0] == math.inf
    assert counts[-1][1] >= ttft_before + 4
    assert all(a[1] <= b[1] for a, b in zip(counts, counts[1:])), f"buckets not cumulative: {counts}"
    total = prometheus.value('jetstream_time_to_first_token_count{job="slipstream"}')
    assert total == counts[-1][1]
    # What a dashboard would plot: a finite, positive median time to first token.
    median = prometheus.value('histogram_quantile(0.5, jetstream_time_to_first_token_bucket{job="slipstream"})')
    assert median is not None and 0 < median < math.inf
    generated = prometheus.value('slipstream_generated_tokens_total{job="slipstream"}')
    assert generated is not None and generated >= 4


def _fill_dashboard_vars(expr: str) -> str:
    return expr.replace("$__rate_interval", "30s").replace("$instance", ".*")


def _fill_adapter_template(query: str, series: str) -> str:
    return (query.replace("<<.Series>>", series).replace("<<.LabelMatchers>>", 'job="slipstream"')
            .replace("<<.GroupBy>>", "instance"))


def test_dashboard_and_adapter_queries_run_and_show_live_data(prometheus, live_server_url):
    complete(live_server_url, 2)
    dashboard = json.loads((DEPLOY / "grafana" / "slipstream.json").read_text())
    exprs = {target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])}
    for expr in sorted(exprs):
        prometheus.query(_fill_dashboard_vars(expr))  # raises on a PromQL error

    throughput = _fill_dashboard_vars(next(e for e in exprs if "rate(slipstream_generated_tokens_total" in e))
    prometheus.wait("a non-zero token throughput on the dashboard",
                    lambda: (prometheus.value(throughput) or 0.0) > 0)

    rules = yaml.safe_load((DEPLOY / "prometheus" / "adapter-rules.yaml").read_text())["rules"]["custom"]
    for rule in rules:
        series = rule["seriesQuery"].split("{")[0]
        result = prometheus.query(_fill_adapter_template(rule["metricsQuery"], series))
        assert len(result) == 1 and result[0]["metric"].get("instance"), f"{series}: {result}"
