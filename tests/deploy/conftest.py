"""Fixtures for the deployment tests: the chart and config paths, and a live server to scrape.

`live_server_url` is a fallback: with SLIPSTREAM_TEST_MODEL set it runs `slipstream serve` on that
model as a subprocess (the real CLI, engine and app); otherwise it serves the real app over the
mock engine in-process (tests/server/conftest.py), which exposes the same /metrics.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "deploy"
CHART = DEPLOY / "helm" / "slipstream"
READY_TIMEOUT_S = float(os.environ.get("SLIPSTREAM_TEST_READY_TIMEOUT", "600"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"slipstream serve exited with {proc.returncode} before /ready:\n"
                               + log.read_text()[-3000:])
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not listening yet
        time.sleep(0.5)
    raise RuntimeError(f"{url}/ready not 200 after {READY_TIMEOUT_S:.0f}s:\n" + log.read_text()[-3000:])


@pytest.fixture(scope="session")
def live_server_url(tmp_path_factory) -> Iterator[str]:
    model = os.environ.get("SLIPSTREAM_TEST_MODEL")
    if not model:
        from tests.server.conftest import start_live

        live = start_live()
        yield live.url
        live.stop()
        return
    port = free_port()
    log = tmp_path_factory.mktemp("slipstream-serve") / "serve.log"
    cli = Path(sys.executable).with_name("slipstream")
    cmd = [str(cli), "serve", "--model", model, "--host", "127.0.0.1", "--port", str(port),
           "--max-slots", "4", "--max-seq-len", "256", "--kv-cache-memory", "32MiB"]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc, log)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
