"""The Helm chart's multi-host mode (issue 18): one server over several pods, as a LeaderWorkerSet or
as an Indexed Job plus a headless Service, rendered by Helm's own engine and checked against the
Kubernetes and LeaderWorkerSet schemas; and the single-host Deployment it leaves unchanged."""
from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from typing import Any

import jsonschema
import pytest
import yaml

from tests.deploy.conftest import CHART, REPO_ROOT, free_port
from tests.deploy.helm_render import helm, render, render_docs
from tests.deploy.test_helm_chart import KUBE_VERSIONS, PODMONITOR_SCHEMA, SCENARIOS

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")

GOLDEN = REPO_ROOT / "tests/deploy/golden/single-host.yaml"
LWS_SCHEMA = json.loads((REPO_ROOT / "tests/deploy/schemas/leaderworkerset-v1.json").read_text())
SELECTOR = {"app.kubernetes.io/name": "slipstream", "app.kubernetes.io/instance": "demo"}
LEADER_LABEL = ("leaderworkerset.sigs.k8s.io/worker-index", "0")   # set by the LWS controller
INDEX_LABEL = ("batch.kubernetes.io/job-completion-index", "0")     # set by the Job controller

# 4 hosts x 2 devices, one 8-way tensor-parallel model; 2 hosts x 4 devices, TP=8.
MODES: dict[str, dict[str, Any]] = {
    "leaderWorkerSet": {
        "multiHost": {"enabled": True, "processes": 4},
        "server": {"tensorParallel": 8},
        "metrics": {"podMonitor": {"enabled": True}},
    },
    "indexedJob": {
        "multiHost": {"enabled": True, "processes": 2, "mode": "indexedJob", "coordinatorPort": 7000,
                      "controlPort": 7001},
        "server": {"tensorParallel": 8},
        "autoscaling": {"enabled": False},
        "metrics": {"podMonitor": {"enabled": True}},
    },
}


def manifests(values: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in render_docs(values)}


def one(docs: dict[tuple[str, str], dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = [d for (k, _), d in docs.items() if k == kind]
    return doc


def env_list(pod_template: dict[str, Any]) -> list[dict[str, Any]]:
    (container,) = pod_template["spec"]["containers"]
    return container["env"]


def env(pod_template: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in env_list(pod_template)}


def process_0_pod(mode: str) -> dict[str, Any]:
    docs = manifests(MODES[mode])
    if mode == "leaderWorkerSet":
        return one(docs, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    return one(docs, "Job")["spec"]["template"]


def golden() -> dict[str, list[dict[str, Any]]]:
    return yaml.safe_load(GOLDEN.read_text())


def single_host(values: dict[str, Any]) -> list[dict[str, Any]]:
    by_kind = render(values)
    return [by_kind[kind] for kind in sorted(by_kind)]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_single_host_release_renders_the_same_objects_as_before_multi_host(scenario):
    values = SCENARIOS[scenario]
    assert single_host(values) == golden()[scenario]
    # Multi-host settings, and parallelism left at 1, change nothing while multiHost is off.
    configured = copy.deepcopy(values)
    configured["multiHost"] = {"enabled": False, "processes": 8, "mode": "indexedJob", "coordinatorPort": 7000,
                               "controlPort": 7001}
    configured.setdefault("server", {}).update(tensorParallel=1, dataParallel=1)
    assert single_host(configured) == golden()[scenario]


def test_single_host_parallelism_reaches_the_server():
    e = {x["name"]: x["value"] for x in render({"server": {"tensorParallel": 4, "dataParallel": 2}})
         ["Deployment"]["spec"]["template"]["spec"]["containers"][0]["env"] if "value" in x}
    assert (e["SLIPSTREAM_TENSOR_PARALLEL"], e["SLIPSTREAM_DATA_PARALLEL"]) == ("4", "2")
    assert "SLIPSTREAM_NUM_PROCESSES" not in e


@pytest.mark.parametrize("mode", MODES)
def test_multi_host_manifests_validate(mode):
    docs = manifests(MODES[mode])
    expected = {"leaderWorkerSet": ["HorizontalPodAutoscaler", "LeaderWorkerSet", "PodDisruptionBudget",
                                    "PodMonitor", "Service"],
                "indexedJob": ["Job", "PodDisruptionBudget", "PodMonitor", "Service", "Service"]}[mode]
    assert sorted(kind for kind, _ in docs) == expected
    for (kind, _), doc in docs.items():
        if kind == "PodMonitor":
            jsonschema.validate(doc, PODMONITOR_SCHEMA)
            continue
        if kind == "LeaderWorkerSet":  # a CRD: its spec by the CRD's schema, its pods by Kubernetes'
            jsonschema.validate(doc, LWS_SCHEMA)
            lwt = doc["spec"]["leaderWorkerTemplate"]
            checked = [{"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role}, "template": lwt[role]}
                       for role in ("leaderTemplate", "workerTemplate")]
        else:
            checked = [doc]
        for manifest in checked:
            for version in KUBE_VERSIONS:
                kubernetes_validate.validate(manifest, version, strict=True)
    result = helm.lint(str(CHART), MODES[mode])
    assert result["errors"] == []
    assert [m for m in result["messages"] if m["severity"] >= 2] == []


def test_leader_worker_set_schema_check_can_fail():
    lws = one(manifests(MODES["leaderWorkerSet"]), "LeaderWorkerSet")
    for path, bad in ((("restartPolicy",), "RecreateGroupOnRestart"), (("groupSize",), 4)):
        broken = copy.deepcopy(lws)
        broken["spec"]["leaderWorkerTemplate"][path[0]] = bad
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, LWS_SCHEMA)


def test_leader_worker_set_is_one_server_per_group_restarted_together():
    docs = manifests(MODES["leaderWorkerSet"])
    lws = one(docs, "LeaderWorkerSet")
    spec = lws["spec"]
    lwt = spec["leaderWorkerTemplate"]
    assert lwt["size"] == 4
    assert lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
    # The leader only gets ready once every process has joined: workers must not wait for it.
    assert spec.get("startupPolicy", "LeaderCreated") == "LeaderCreated"
    assert "replicas" not in spec  # the HPA owns the number of groups
    assert render({**MODES["leaderWorkerSet"], "autoscaling": {"enabled": False}, "replicaCount": 3}
                  )["LeaderWorkerSet"]["spec"]["replicas"] == 3

    leader, worker = lwt["leaderTemplate"], lwt["workerTemplate"]
    e = env(leader)
    assert e["SLIPSTREAM_COORDINATOR_ADDRESS"] == "$(LWS_LEADER_ADDRESS):8476"
    assert e["SLIPSTREAM_PROCESS_ID"] == "$(LWS_WORKER_INDEX)"
    assert e["SLIPSTREAM_NUM_PROCESSES"] == "4"
    assert e["SLIPSTREAM_CONTROL_PORT"] == "8477"
    assert (e["SLIPSTREAM_TENSOR_PARALLEL"], e["SLIPSTREAM_DATA_PARALLEL"]) == ("8", "1")
    # Every process gets the same engine settings, or their steps would not line up.
    assert env_list(worker) == env_list(leader)

    # Process 0 serves and is probed; the workers serve nothing, so they have no probes and no ports.
    (lc,) = leader["spec"]["containers"]
    (wc,) = worker["spec"]["containers"]
    assert [lc[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")] == \
        ["/ready", "/ready", "/health"]
    assert {p["name"]: p["containerPort"] for p in lc["ports"]} == {"http": 8000, "grpc": 9000, "coordinator": 8476,
                                                                   "control": 8477}
    assert not {"startupProbe", "readinessProbe", "livenessProbe", "ports"} & wc.keys()
    assert leader["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert "prometheus.io/scrape" not in worker["metadata"].get("annotations", {})

    # LWS makes a headless Service named after the LeaderWorkerSet for the pods' DNS names:
    # sharing the chart Service's name would leave LWS_LEADER_ADDRESS unresolvable.
    service = one(docs, "Service")
    assert lws["metadata"]["name"] != service["metadata"]["name"]
    hpa = one(docs, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    assert hpa == {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
                   "name": lws["metadata"]["name"]}


def test_indexed_job_is_one_server_found_through_its_headless_service():
    docs = manifests(MODES["indexedJob"])
    job = one(docs, "Job")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == 2
    pod = spec["template"]
    assert pod["spec"]["restartPolicy"] == "OnFailure"
    assert "HorizontalPodAutoscaler" not in {kind for kind, _ in docs}

    hosts = [d for (k, _), d in docs.items() if k == "Service" and d["spec"].get("clusterIP") == "None"]
    (headless,) = hosts
    assert headless["spec"]["publishNotReadyAddresses"] is True  # processes meet before any is ready
    assert headless["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["subdomain"] == headless["metadata"]["name"]

    e = env(pod)
    # Pod i of an Indexed Job has hostname <job>-i: pod 0 is process 0, the coordinator.
    assert e["SLIPSTREAM_COORDINATOR_ADDRESS"] == \
        f"{job['metadata']['name']}-0.{headless['metadata']['name']}.serving.svc:7000"
    assert e["SLIPSTREAM_NUM_PROCESSES"] == "2"
    assert e["SLIPSTREAM_CONTROL_PORT"] == "7001"
    assert (e["SLIPSTREAM_TENSOR_PARALLEL"], e["SLIPSTREAM_DATA_PARALLEL"]) == ("8", "1")
    assert e["JOB_COMPLETION_INDEX"] == {
        "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    assert e["SLIPSTREAM_PROCESS_ID"] == "$(JOB_COMPLETION_INDEX)"
    # $(VAR) only expands variables defined earlier in the list.
    names = [x["name"] for x in env_list(pod)]
    assert names.index("JOB_COMPLETION_INDEX") < names.index("SLIPSTREAM_PROCESS_ID")
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (ports["coordinator"], ports["control"]) == (7000, 7001)
    assert {p["targetPort"] for p in headless["spec"]["ports"]} <= ports.keys()


@pytest.mark.parametrize("mode", MODES)
def test_traffic_and_scrapes_reach_process_0_only(mode):
    docs = manifests(MODES[mode])
    key, value = LEADER_LABEL if mode == "leaderWorkerSet" else INDEX_LABEL
    (service,) = [d for (k, name), d in docs.items() if k == "Service" and name == "demo-slipstream"]
    assert service["spec"]["selector"] == {**SELECTOR, key: value}
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {"http", "grpc"}
    assert one(docs, "PodMonitor")["spec"]["selector"]["matchLabels"] == {**SELECTOR, key: value}


def probe_command(path: str) -> list[str]:
    pod = process_0_pod("indexedJob")
    (container,) = pod["spec"]["containers"]
    probe = {"/ready": container["readinessProbe"], "/health": container["livenessProbe"]}[path]
    assert (container["startupProbe"]["exec"] if path == "/ready" else probe["exec"]) == probe["exec"]
    command = probe["exec"]["command"]
    assert command[0] == "python3"  # the image's interpreter; here, the test's
    return [sys.executable, *command[1:]]


def run_probe(path: str, process_id: str, port: int) -> int:
    environ = {**os.environ, "SLIPSTREAM_PROCESS_ID": process_id, "SLIPSTREAM_PORT": str(port)}
    return subprocess.run(probe_command(path), env=environ, capture_output=True, timeout=30).returncode


def test_indexed_job_probes_watch_process_0s_server_and_pass_the_workers():
    from tests.server.conftest import start_live

    live = start_live()
    port = int(live.url.rsplit(":", 1)[1])
    try:
        assert run_probe("/ready", "0", port) == 0
        assert run_probe("/health", "0", port) == 0
        live.service.begin_drain()  # /ready answers 503: process 0 leaves the Service
        assert run_probe("/ready", "0", port) != 0
        assert run_probe("/health", "0", port) == 0
    finally:
        live.stop()
    closed = free_port()
    assert run_probe("/health", "0", closed) != 0   # no server: process 0 is restarted
    assert run_probe("/ready", "1", closed) == 0    # workers serve nothing and stay Ready
    assert run_probe("/health", "1", closed) == 0


@pytest.mark.parametrize("values, field", [
    ({"multiHost": {"enabled": True, "processes": 1}}, "/multiHost/processes"),
    ({"multiHost": {"processes": "4"}}, "/multiHost/processes"),
    ({"multiHost": {"enabled": True, "mode": "statefulSet"}}, "/multiHost/mode"),
    ({"multiHost": {"enabled": "yes"}}, "/multiHost/enabled"),
    ({"multiHost": {"proceses": 4}}, "/multiHost"),
    ({"multiHost": {"coordinatorPort": 70000}}, "/multiHost/coordinatorPort"),
    ({"multiHost": {"controlPort": 0}}, "/multiHost/controlPort"),
    ({"multiHost": {"indexedJob": {"backoffLimit": -1}}}, "/multiHost/indexedJob/backoffLimit"),
    ({"server": {"tensorParallel": 0}}, "/server/tensorParallel"),
    ({"server": {"dataParallel": 0}}, "/server/dataParallel"),
    ({"server": {"tensorParallel": 2.5}}, "/server/tensorParallel"),
])
def test_schema_refuses_nonsense_multi_host_values(values, field):
    with pytest.raises(helm.HelmValuesError, match=f"at '{field}'"):
        render_docs(values)


@pytest.mark.parametrize("values, message", [
    ({"multiHost": {"enabled": True, "processes": 4}, "server": {"tensorParallel": 2}}, "multiple of multiHost.processes"),
    ({"multiHost": {"enabled": True}}, "multiple of multiHost.processes"),  # TP=1 on two hosts
    # the server refuses data parallel across a multi-host group (one replica spans every process)
    ({"multiHost": {"enabled": True}, "server": {"tensorParallel": 2, "dataParallel": 2}}, "dataParallel is 2"),
    ({"multiHost": {"enabled": True, "coordinatorPort": 9000}, "server": {"tensorParallel": 2}}, "coordinatorPort 9000"),
    ({"multiHost": {"enabled": True, "controlPort": 8476}, "server": {"tensorParallel": 2}}, "controlPort 8476"),
    ({"multiHost": {"enabled": True, "mode": "indexedJob"}, "server": {"tensorParallel": 2}}, "autoscaling.enabled=false"),
    ({"multiHost": {"enabled": True, "mode": "indexedJob"}, "server": {"tensorParallel": 2},
      "autoscaling": {"enabled": False}, "replicaCount": 2}, "replicaCount=1"),
])
def test_multi_host_settings_that_cannot_start_are_refused(values, message):
    with pytest.raises(helm.HelmRenderError, match=message):
        render_docs(values)


def test_indexed_job_refuses_clusters_without_the_completion_index_label(capfd):
    # `helm lint` reports a template's `fail` only in its log; a render cannot set the version.
    helm.enable_logging()
    try:
        helm.lint(str(CHART), MODES["indexedJob"], kube_version="v1.27.0")
        assert "needs Kubernetes 1.28+" in capfd.readouterr().err
        helm.lint(str(CHART), MODES["indexedJob"], kube_version="v1.28.0")
        assert "needs Kubernetes 1.28+" not in capfd.readouterr().err
    finally:
        helm.disable_logging()


def test_multi_host_env_vars_name_real_cli_flags():
    out = subprocess.run([sys.executable, "-c", "from slipstream.server.cli import main; main()", "serve", "--help"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    flags = set(re.findall(r"--([a-z][a-z0-9-]+)", out.stdout))
    for mode in MODES:
        for name in env(process_0_pod(mode)):
            if name.startswith("SLIPSTREAM_"):
                flag = name.removeprefix("SLIPSTREAM_").lower().replace("_", "-")
                assert flag in flags, f"{name} has no --{flag} in `slipstream serve --help`"


if __name__ == "__main__" and sys.argv[1:] == ["--regenerate-golden"]:
    header = "".join(line for line in GOLDEN.read_text().splitlines(keepends=True) if line.startswith("#"))
    GOLDEN.write_text(header + yaml.safe_dump({name: single_host(v) for name, v in SCENARIOS.items()}, sort_keys=True))
