"""The Dockerfile and the Helm chart agree: same user, ports, cache volume and entrypoint contract.
(deploy/container-test.sh builds and runs the image for real; these checks need no container tools.)"""
from __future__ import annotations

import json
import re

from tests.deploy.conftest import REPO_ROOT

DOCKERFILE = (REPO_ROOT / "Dockerfile").read_text()


def instructions(name: str) -> list[str]:
    """Arguments of every NAME instruction, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    return [m.group(1).strip() for m in re.finditer(rf"^{name}\s+(.*)$", joined, re.M)]


def runtime_stage() -> str:
    """The text of the last stage, the one that becomes the image."""
    return DOCKERFILE[DOCKERFILE.rindex("\nFROM "):]


def test_image_runs_slipstream_serve_as_a_non_root_user():
    assert json.loads(instructions("ENTRYPOINT")[-1]) == ["slipstream", "serve", "--host", "0.0.0.0"]
    (user,) = re.findall(r"^USER\s+(\S+)", runtime_stage(), re.M)
    assert user.split(":")[0] not in ("0", "root")
    assert instructions("ARG")[0] == "BASE_IMAGE=python:3.11-slim"
    assert len(re.findall(r"^FROM ", DOCKERFILE, re.M)) == 2  # builder + runtime: no compilers shipped


def test_the_compiler_stays_in_the_builder_stage():
    builder = DOCKERFILE[:DOCKERFILE.rindex("\nFROM ")]
    (install,) = [run for run in instructions("RUN") if "apt-get install" in run]
    assert re.search(r"\bg\+\+", install) and install in re.sub(r"\\\n\s*", " ", builder)  # kernels built
    assert "apt-get" not in runtime_stage() and "COPY --from=builder /opt/venv" in runtime_stage()


def test_healthcheck_probes_health_on_the_configured_port():
    (healthcheck,) = instructions("HEALTHCHECK")
    command = json.loads(healthcheck[healthcheck.index("CMD") + 3:])
    assert command[0] == "python3"  # slim images have no curl
    assert "/health" in command[-1] and "SLIPSTREAM_PORT" in command[-1]


def test_chart_matches_the_image_user_ports_and_cache_volume():
    from tests.deploy.helm_render import container, env, render  # skips if helm-python-sdk is missing

    manifests = render({})
    pod = manifests["Deployment"]["spec"]["template"]["spec"]
    (user,) = re.findall(r"^USER\s+(\S+)", runtime_stage(), re.M)
    assert str(pod["securityContext"]["runAsUser"]) == user.split(":")[0]
    (volume,) = json.loads(instructions("VOLUME")[-1])
    mounts = {m["name"]: m["mountPath"] for m in container(manifests)["volumeMounts"]}
    assert mounts["compile-cache"] == volume
    assert env(manifests)["SLIPSTREAM_COMPILE_CACHE"] == volume
    assert re.search(rf"SLIPSTREAM_COMPILE_CACHE={re.escape(volume)}\b", runtime_stage())
    exposed = {int(p) for p in instructions("EXPOSE")[-1].split()}
    assert {p["containerPort"] for p in container(manifests)["ports"]} == exposed
