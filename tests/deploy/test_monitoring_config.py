"""Prometheus scrape config and Grafana dashboard, checked against what the server exposes and
what the Helm chart deploys: every query names a real sample, the pod job finds the chart's pods."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from typing import Any

import pytest
import yaml

from tests.deploy.conftest import DEPLOY
from tests.deploy.exported_metrics import exposed_samples

DASHBOARD = json.loads((DEPLOY / "grafana" / "slipstream.json").read_text())
PROMETHEUS_YML = DEPLOY / "prometheus" / "prometheus.yml"
ALERTS_YML = DEPLOY / "prometheus" / "alerts.yml"
METRIC = re.compile(r"\b(?:jetstream|slipstream)_[a-zA-Z0-9_]+")


def dashboard_exprs() -> list[tuple[str, str]]:
    return [(panel["title"], target["expr"]) for panel in DASHBOARD["panels"]
            for target in panel.get("targets", [])]


def test_dashboard_queries_name_only_samples_the_server_exposes():
    samples = exposed_samples()
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    for title, expr in exprs:
        names = METRIC.findall(expr)
        assert names, f"panel {title!r}: {expr} reads no Slipstream metric"
        for name in names:
            assert name in samples, f"panel {title!r}: {name} is not on /metrics"
            # Raw counters and raw buckets only make sense through rate()/histogram_quantile().
            if samples[name] == "counter":
                assert re.search(rf"(rate|increase)\({name}\b", expr), f"panel {title!r}: counter {name} without rate()"
            if name.endswith("_bucket"):
                assert expr.startswith("histogram_quantile("), f"panel {title!r}: {name} outside histogram_quantile"


def test_dashboard_answers_the_operators_questions():
    exprs = [expr for _, expr in dashboard_exprs()]

    def shown(pattern: str) -> bool:
        return any(re.search(pattern, e) for e in exprs)

    for histogram in ("jetstream_time_to_first_token", "jetstream_time_per_output_token"):
        for q in ("0.5", "0.9", "0.99"):
            assert shown(rf"histogram_quantile\({q}, .*{histogram}_bucket"), f"no p{q} of {histogram}"
    for pattern in (r"rate\(slipstream_generated_tokens_total",    # throughput
                    r"jetstream_prefill_backlog_size",               # queue (HPA signal)
                    r"jetstream_slots_used_percentage",              # slots (HPA signal)
                    r"slipstream_kv_pages_used.*/.*slipstream_kv_pages_total",
                    r"slipstream_prefix_cache_hits_total.*/.*slipstream_prefix_cache_queries_total",
                    r"rate\(slipstream_preemptions_total",
                    r"rate\(slipstream_request_errors_total",
                    r"slipstream_rejections_total"):
        assert shown(pattern), f"no panel shows {pattern}"


def test_dashboard_layout_is_importable():
    panels = DASHBOARD["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}"
    variables = {v["name"] for v in DASHBOARD["templating"]["list"]}
    assert {"datasource", "instance"} <= variables


def _relabel(labels: dict[str, str], configs: list[dict[str, Any]]) -> dict[str, str] | None:
    """Prometheus' keep/drop/replace relabeling (regexes are anchored, $1 style references)."""
    labels = dict(labels)
    for c in configs:
        action = c.get("action", "replace")
        value = c.get("separator", ";").join(labels.get(s, "") for s in c.get("source_labels", []))
        match = re.fullmatch(c.get("regex", "(.*)"), value)
        if action == "keep" and not match or action == "drop" and match:
            return None
        if action == "replace" and match:
            replacement = re.sub(r"\$\{?(\d+)\}?", r"\\g<\1>", c.get("replacement", "$1"))
            labels[c["target_label"]] = match.expand(replacement)
        elif action not in ("keep", "drop", "replace"):
            raise NotImplementedError(action)
    return labels


def _discovered_targets(values: dict[str, Any]) -> list[dict[str, str]]:
    """What the slipstream-pods job keeps of one chart pod, as Kubernetes pod discovery sees it."""
    from tests.deploy.helm_render import render  # skips this test if helm-python-sdk is missing

    def meta(name: str) -> str:
        return re.sub(r"[^a-zA-Z0-9_]", "_", name)

    job = next(j for j in yaml.safe_load(PROMETHEUS_YML.read_text())["scrape_configs"]
               if j["job_name"] == "slipstream-pods")
    pod = render(values)["Deployment"]["spec"]["template"]
    base = {"__meta_kubernetes_namespace": "serving", "__meta_kubernetes_pod_name": "demo-slipstream-abc12",
            "__metrics_path__": job.get("metrics_path", "/metrics"), "job": job["job_name"]}
    base.update({f"__meta_kubernetes_pod_label_{meta(k)}": v for k, v in pod["metadata"]["labels"].items()})
    base.update({f"__meta_kubernetes_pod_annotation_{meta(k)}": v
                 for k, v in pod["metadata"].get("annotations", {}).items()})
    targets = []
    for port in pod["spec"]["containers"][0]["ports"]:  # discovery yields one target per port
        labels = dict(base, __address__=f"10.1.2.3:{port['containerPort']}",
                      __meta_kubernetes_pod_container_port_name=port["name"])
        kept = _relabel(labels, job["relabel_configs"])
        if kept is not None:
            targets.append(kept)
    return targets


def test_pod_discovery_job_scrapes_each_chart_pod_once_on_http():
    (target,) = _discovered_targets({})
    assert target["__address__"] == "10.1.2.3:8000"
    assert target["__metrics_path__"] == "/metrics"
    # prometheus-adapter maps series to pods through exactly these labels.
    assert (target["namespace"], target["pod"]) == ("serving", "demo-slipstream-abc12")
    assert _discovered_targets({"metrics": {"podAnnotations": False}}) == []


@pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool (Debian package 'prometheus')")
def test_prometheus_config_passes_promtool(tmp_path):
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    for job in config["scrape_configs"]:
        # Debian's Prometheus is built without Kubernetes discovery; a static target keeps every
        # other field of the job (relabel rules included) under promtool's check.
        if job.pop("kubernetes_sd_configs", None) is not None:
            job["static_configs"] = [{"targets": ["10.1.2.3:8000"]}]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    shutil.copy(ALERTS_YML, tmp_path / "alerts.yml")  # rule_files resolve next to the config
    out = subprocess.run(["promtool", "check", "config", str(path)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr
    broken = tmp_path / "broken.yml"
    config["scrape_configs"][0]["scrape_interval"] = "often"
    broken.write_text(yaml.safe_dump(config))
    assert subprocess.run(["promtool", "check", "config", str(broken)], capture_output=True).returncode != 0


def test_alert_rules_watch_the_5xx_rate_with_metrics_the_server_exposes():
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    assert config["rule_files"] == ["alerts.yml"]
    rules = [r for g in yaml.safe_load(ALERTS_YML.read_text())["groups"] for r in g["rules"]]
    samples = exposed_samples()
    for rule in rules:
        for name in METRIC.findall(rule["expr"]):
            assert name in samples, f"alert {rule['alert']}: {name} is not on /metrics"
            assert re.search(rf"rate\({name}\b", rule["expr"]), f"alert {rule['alert']}: {name} without rate()"
    assert any('status_class="5xx"' in r["expr"] for r in rules), "no alert on the HTTP 5xx rate"
    assert any(re.search(r'rate\(slipstream_http_responses_total\{[^}]*status_class="5xx"', e)
               for _, e in dashboard_exprs()), "no dashboard panel shows the 5xx rate"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool (Debian package 'prometheus')")
def test_alert_rules_pass_promtool():
    out = subprocess.run(["promtool", "check", "rules", str(ALERTS_YML)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr
