"""Render the Helm chart with Helm's own engine (helm-python-sdk binds Helm's Go SDK: no binary)."""
from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.deploy.conftest import CHART

helm = pytest.importorskip("helm_python", reason="pip install helm-python-sdk (Helm's Go SDK, no helm binary)")


def render_docs(values: dict[str, Any], release: str = "demo") -> list[dict[str, Any]]:
    """Manifests as `helm template RELEASE deploy/helm/slipstream -n serving` would produce them."""
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values, name=release, namespace="serving")
    return [doc for path, text in files.items() if path.endswith((".yaml", ".yml"))
            for doc in yaml.safe_load_all(text) if doc]


def render(values: dict[str, Any], release: str = "demo") -> dict[str, dict[str, Any]]:
    """Manifests by kind (for releases with one manifest of each kind)."""
    docs = render_docs(values, release)
    by_kind = {doc["kind"]: doc for doc in docs}
    if len(by_kind) != len(docs):
        raise AssertionError(f"two manifests of one kind: {[d['kind'] for d in docs]}")
    return by_kind


def container(manifests: dict[str, dict[str, Any]]) -> dict[str, Any]:
    (only,) = manifests["Deployment"]["spec"]["template"]["spec"]["containers"]
    return only


def env(manifests: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Container env as name -> value (or the valueFrom mapping)."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(manifests)["env"]}
