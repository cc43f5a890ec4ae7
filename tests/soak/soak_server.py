"""The soak's server under test: a MockEngine server in a child process (`python -m tests.soak.soak
serve`, run by start_server), and what the soak reads of it from outside: /metrics, the process's
RSS, and when it holds no request, slot or page any more. No load is generated here.
"""
from __future__ import annotations

import argparse
import collections
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import httpx

BOS, EOS = 256, 257


class ByteTokenizer:
    """ids 0..255 are UTF-8 bytes; 256 is BOS and 257 EOS (as the server tests use)."""

    vocab_size = 258
    eos_token_ids = frozenset({EOS})
    bos_token_id, add_bos = BOS, True

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + list(text.encode())

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"


# ---- inside the child process -------------------------------------------------------------------

def serve(args: argparse.Namespace) -> int:
    from slipstream.engine.mock_engine import MockEngine
    from slipstream.engine.scheduler import OutputProcessor, Scheduler, SchedulerConfig
    from slipstream.server.app import create_app
    from slipstream.server.http_server import make_server
    from slipstream.server.service import Service, ServiceConfig

    engine = MockEngine(vocab_size=ByteTokenizer.vocab_size, eos_token_ids=frozenset({EOS}), max_seq_len=128,
                        max_slots=args.max_slots, num_pages=256, step_sleep_s=args.step_sleep)
    # MockEngine logs every step for the tests that inspect it; over a long soak that log alone
    # would grow RSS without bound, so keep only its tail (the soak injects no failures).
    engine.step_log = collections.deque(maxlen=256)  # type: ignore[assignment]
    engine.events = collections.deque(maxlen=256)  # type: ignore[assignment]
    scheduler = Scheduler(engine, OutputProcessor(ByteTokenizer()), SchedulerConfig(max_queue=args.max_queue))
    service = Service(scheduler, engine, ByteTokenizer(), ServiceConfig(model_name="soak"))
    app = create_app(service, api_key=None)
    scheduler.start()
    server = make_server(app, "127.0.0.1", args.port, shutdown_timeout_s=args.shutdown_timeout, log_level="warning")

    # As `slipstream serve` does: uvicorn re-raises SIGTERM after its drain; that is a clean exit.
    def clean_exit(signum: int, frame: Any) -> None:
        sys.exit(1 if server.engine_failed else 0)

    signal.signal(signal.SIGTERM, clean_exit)
    server.run()
    return 1 if server.engine_failed else 0


# ---- from the soak's side -----------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "tests.soak.soak", "serve", "--port", str(port), "--max-slots", str(args.max_slots),
           "--max-queue", str(args.max_queue), "--step-sleep", str(args.step_sleep), "--shutdown-timeout", "20"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo
    proc = subprocess.Popen(cmd, cwd=root)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("soak server did not become ready within 60 s")


def scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=5).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:  # summed over data-parallel replicas (the `replica` label)
            key = s.name + "".join(f"{{{v}}}" for k, v in s.labels.items() if k != "replica")
            out[key] = out.get(key, 0.0) + s.value
    return out


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def wait_idle(url: str, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        held = (m["slipstream_requests_running"], m["slipstream_requests_waiting"],
                m["jetstream_slots_used_percentage"], m["slipstream_kv_pages_used"])
        if held == (0, 0, 0, 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)
