"""The Helm chart, rendered by Helm's own engine (helm-python-sdk) and checked against Kubernetes'
JSON schemas (kubernetes-validate, offline), the server's real metric names and its CLI flags."""
from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from typing import Any

import jsonschema
import pytest
import yaml

from tests.deploy.conftest import CHART, DEPLOY, REPO_ROOT
from tests.deploy.exported_metrics import exposed_families
from tests.deploy.helm_render import container, env, helm, render

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")

# The chart's kubeVersion floor and a current release.
KUBE_VERSIONS = ("1.25.0", "1.37.0")
PODMONITOR_SCHEMA = json.loads((REPO_ROOT / "tests/deploy/schemas/podmonitor-v1.json").read_text())

SCENARIOS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "everything-on": {
        "metrics": {"podMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}},
        "apiKey": {"existingSecret": "slipstream-api", "key": "token"},
        "model": {"name": "/models/llama-3.2-1b", "volume": {"persistentVolumeClaim": {"claimName": "models"}}},
        "compileCache": {"volume": {"persistentVolumeClaim": {"claimName": "jax-cache"}}},
        "server": {"quantize": "q8_0", "kvCacheDtype": "int8", "extraArgs": ["--max-queue", "64"],
                   "extraEnv": [{"name": "XLA_FLAGS", "value": "--xla_cpu_enable_fast_math=false"}]},
        "podAnnotations": {"team": "inference"},
        "tolerations": [{"key": "accelerator", "operator": "Exists", "effect": "NoSchedule"}],
    },
    "minimal": {
        "autoscaling": {"enabled": False}, "podDisruptionBudget": {"enabled": False},
        "grpc": {"enabled": False}, "metrics": {"podAnnotations": False}, "replicaCount": 3,
    },
}
EXPECTED_KINDS = {
    "defaults": {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget"},
    "everything-on": {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "PodMonitor"},
    "minimal": {"Deployment", "Service"},
}


def test_chart_lints_without_warnings():
    result = helm.lint(str(CHART))
    assert result["errors"] == []
    # Severity 1 is informational (e.g. "icon is recommended"); 2 and up are warnings/errors.
    assert [m for m in result["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_manifest_validates_against_kubernetes_schemas(scenario):
    manifests = render(SCENARIOS[scenario])
    assert set(manifests) == EXPECTED_KINDS[scenario]
    for kind, doc in manifests.items():
        if kind == "PodMonitor":  # a CRD: kubernetes-validate has no schema for it
            jsonschema.validate(doc, PODMONITOR_SCHEMA)
            continue
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_schema_checks_can_fail():
    manifests = render(SCENARIOS["everything-on"])
    deployment = copy.deepcopy(manifests["Deployment"])
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] = ["http"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSIONS[-1], strict=True)
    monitor = copy.deepcopy(manifests["PodMonitor"])
    monitor["spec"]["podMetricsEndpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(monitor, PODMONITOR_SCHEMA)


def test_invalid_values_are_refused_before_anything_is_applied():
    with pytest.raises(helm.HelmValuesError, match="quantize"):
        render({"server": {"quantize": "int4"}})
    with pytest.raises(helm.HelmValuesError, match="kvCacheMemory"):
        render({"server": {"kvCacheMemory": "lots"}})


def test_server_settings_become_env_vars():
    manifests = render(SCENARIOS["everything-on"])
    e = env(manifests)
    assert e["SLIPSTREAM_MODEL"] == "/models/llama-3.2-1b"
    assert e["SLIPSTREAM_QUANTIZE"] == "q8_0"
    assert e["SLIPSTREAM_KV_CACHE_DTYPE"] == "int8"
    assert e["SLIPSTREAM_MAX_SLOTS"] == "32"
    assert e["SLIPSTREAM_KV_CACHE_MEMORY"] == "768MiB"
    assert e["SLIPSTREAM_GRPC_PORT"] == "9000"
    # The key arrives as a file from the Secret, never as an environment variable.
    assert "SLIPSTREAM_API_KEY" not in e
    volumes = {v["name"]: v for v in manifests["Deployment"]["spec"]["template"]["spec"]["volumes"]}
    assert volumes["api-key"]["secret"] == {"secretName": "slipstream-api", "items": [{"key": "token", "path": "key"}]}
    assert e["XLA_FLAGS"] == "--xla_cpu_enable_fast_math=false"
    assert container(manifests)["args"] == ["--max-queue", "64"]
    mounts = {m["name"]: m for m in container(manifests)["volumeMounts"]}
    assert mounts["models"] == {"name": "models", "mountPath": "/models", "readOnly": True}
    assert e["SLIPSTREAM_COMPILE_CACHE"] == mounts["compile-cache"]["mountPath"]
    assert e["SLIPSTREAM_API_KEY_FILE"] == mounts["api-key"]["mountPath"] + "/key" and mounts["api-key"]["readOnly"]
    # Without a Secret the key is absent, not empty (an empty key would mean "no auth" by accident).
    assert "SLIPSTREAM_API_KEY" not in env(render({})) and "SLIPSTREAM_API_KEY_FILE" not in env(render({}))
    assert env(render({"grpc": {"enabled": False}}))["SLIPSTREAM_GRPC_PORT"] == "0"


def test_grace_period_outlasts_the_server_drain():
    manifests = render({"server": {"shutdownTimeout": 50}})
    assert env(manifests)["SLIPSTREAM_SHUTDOWN_TIMEOUT"] == "50"
    assert manifests["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 55


def test_probes_wait_for_compilation_and_restart_only_dead_servers():
    c = container(render({}))
    assert c["startupProbe"]["httpGet"]["path"] == "/ready"
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 15 * 60
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8000, "grpc": 9000}
    assert {"name": "SLIPSTREAM_PORT", "value": "8000"} in c["env"]


def test_selectors_tie_service_pdb_and_monitor_to_the_pods():
    manifests = render(SCENARIOS["everything-on"])
    pod = manifests["Deployment"]["spec"]["template"]
    pod_labels = pod["metadata"]["labels"]
    port_names = {p["name"] for p in container(manifests)["ports"]}
    service = manifests["Service"]["spec"]
    assert service["selector"].items() <= pod_labels.items()
    assert {p["targetPort"] for p in service["ports"]} == {"http", "grpc"}
    assert {p["targetPort"] for p in service["ports"]} <= port_names
    for kind in ("PodDisruptionBudget", "PodMonitor"):
        assert manifests[kind]["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert manifests["PodMonitor"]["spec"]["podMetricsEndpoints"][0]["port"] in port_names
    assert manifests["PodMonitor"]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True


def test_hpa_scales_on_gauges_the_server_exports_and_the_adapter_serves():
    manifests = render({"autoscaling": {"minReplicas": 2, "maxReplicas": 6}})
    hpa = manifests["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                     "name": manifests["Deployment"]["metadata"]["name"]}
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 6)
    assert "replicas" not in manifests["Deployment"]["spec"]  # the HPA owns the count
    names = {m["pods"]["metric"]["name"] for m in hpa["metrics"] if m["type"] == "Pods"}
    assert names == {"jetstream_prefill_backlog_size", "jetstream_slots_used_percentage"}
    families = exposed_families()
    for name in names:
        assert families.get(name) == "gauge", f"{name} is not a gauge on /metrics"

    rules = yaml.safe_load((DEPLOY / "prometheus" / "adapter-rules.yaml").read_text())["rules"]["custom"]
    served = {}
    for rule in rules:
        series = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["seriesQuery"]).group(0)
        assert families.get(series) == "gauge", f"adapter rule reads {series}, not a gauge on /metrics"
        assert re.fullmatch(rule["name"]["matches"], series)
        assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
        served[re.sub(rule["name"]["matches"], rule["name"]["as"], series)] = rule
    assert names <= served.keys()


def test_env_vars_name_real_cli_flags():
    pytest.importorskip("slipstream.server.cli", reason="server/cli.py (the `slipstream serve` CLI) is not written yet")
    out = subprocess.run([sys.executable, "-c", "from slipstream.server.cli import main; main()", "serve", "--help"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    flags = set(re.findall(r"--([a-z][a-z0-9-]+)", out.stdout))
    for name in env(render(SCENARIOS["everything-on"])):
        if name.startswith("SLIPSTREAM_"):
            flag = name.removeprefix("SLIPSTREAM_").lower().replace("_", "-")
            assert flag in flags, f"{name} has no --{flag} in `slipstream serve --help`"
