"""Serving over a unix socket (`serve --uds`, `--grpc-uds`, `bench --base-url unix:`): the same answers, drain
and benchmark as on TCP, the socket file's mode and lifetime, and bad paths refused before the model loads."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import httpx
import pytest

import slipstream.server.cli
from slipstream.server.bench import run as bench
from slipstream.server.grpc_service import start_grpc_server
from slipstream.server.proto import jetstream_pb2_grpc as pb_grpc
from slipstream.server.unix_socket import SUN_PATH_MAX, parse_mode
from tests.server.conftest import MODEL, wait_for
from tests.server.grpc_helpers import LoopThread, collect, text_request

ROOT = Path(__file__).resolve().parents[2]


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _stale_socket(path: Path) -> None:
    """A socket file nobody listens on, as a killed server leaves behind."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))


def _data(lines) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


def test_a_uds_server_answers_health_ready_metrics_and_streams(make_live, tmp_path) -> None:
    path = tmp_path / "s.sock"
    live = make_live(uds=str(path))
    assert stat.S_ISSOCK(os.lstat(path).st_mode) and _mode(path) == 0o600
    # no TCP listener: every socket the server accepts on is a unix one
    assert {s.family for srv in live.server.servers for s in srv.sockets} == {socket.AF_UNIX}
    with live.http() as http:
        assert http.get("/health").json() == {"status": "ok"}
        assert http.get("/ready").status_code == 200
        with http.stream("POST", "/v1/completions",
                         json={"model": MODEL, "prompt": "abc", "max_tokens": 5, "stream": True}) as response:
            events = _data(response.iter_lines())
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == "defgh"
    assert live.metric("jetstream_request_success_count_total") == 1
    live.stop()
    assert not path.exists()  # removed on a clean shutdown


def test_uds_mode_sets_the_socket_files_permissions(make_live, tmp_path) -> None:
    path = tmp_path / "group.sock"
    make_live(uds=str(path), uds_mode=0o660)
    assert _mode(path) == 0o660
    assert slipstream.server.cli.build_parser().parse_args(["serve", "--uds-mode", "0660"]).uds_mode == 0o660
    assert slipstream.server.cli.build_parser().parse_args(["serve"]).uds_mode == 0o600
    assert parse_mode("666") == 0o666
    for bad in ("rw", "0800", "01777", "0400"):  # not octal, too wide, owner cannot connect
        with pytest.raises(argparse.ArgumentTypeError):
            parse_mode(bad)


def test_a_dead_servers_socket_is_replaced(make_live, tmp_path) -> None:
    path = tmp_path / "s.sock"
    _stale_socket(path)
    live = make_live(uds=str(path))
    with live.http() as http:
        assert http.get("/ready").status_code == 200


# ---- bad paths: one error line, before the model loads -------------------------------------------


@pytest.fixture
def no_model(monkeypatch) -> list[str]:
    loads: list[str] = []

    def build_engines(args, **kwargs):
        loads.append(args.model)
        raise RuntimeError("the model was loaded before the socket paths were checked")

    monkeypatch.setattr(slipstream.server.cli, "build_engines", build_engines)
    return loads


def _serve_error(capsys, *flags: str) -> str:
    assert slipstream.server.cli.main(["serve", *flags]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("slipstream: error: "), lines
    return lines[0]


def test_bad_socket_paths_are_refused_before_loading(no_model, make_live, tmp_path, capsys) -> None:
    assert "does not exist" in _serve_error(capsys, "--uds", str(tmp_path / "nowhere" / "s.sock"))
    long = str(tmp_path / ("x" * (SUN_PATH_MAX - len(str(tmp_path)))))  # one byte over the limit
    assert f"at most {SUN_PATH_MAX}" in _serve_error(capsys, "--uds", long)
    (tmp_path / "notes.txt").write_text("keep me")
    assert "not a socket" in _serve_error(capsys, "--uds", str(tmp_path / "notes.txt"))
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    busy = tmp_path / "busy.sock"
    make_live(uds=str(busy))
    assert "live server" in _serve_error(capsys, "--grpc-uds", f"unix:{busy}")
    assert "choose one" in _serve_error(capsys, "--grpc-uds", str(tmp_path / "g.sock"), "--grpc-port", "9000")
    assert "its own path" in _serve_error(capsys, "--uds", str(tmp_path / "a.sock"), "--grpc-uds",
                                          str(tmp_path / "a.sock"))
    assert no_model == []


# ---- gRPC ----------------------------------------------------------------------------------------


def test_grpc_over_a_unix_socket_decodes(live, tmp_path) -> None:
    path = tmp_path / "g.sock"
    loop = LoopThread()
    try:
        rpc = loop.run(start_grpc_server(live.service, host="127.0.0.1", port=0, uds=str(path)))
        assert rpc.port == 0 and _mode(path) == 0o600
        with grpc.insecure_channel(f"unix:{path}") as channel:
            texts, _, _ = collect(pb_grpc.OrchestratorStub(channel).Decode(text_request("abc", 3), timeout=10))
        assert texts == ["def"]
        loop.run(rpc.stop(0))
    finally:
        loop.close()
    assert not path.exists()


# ---- slipstream bench ----------------------------------------------------------------------------


def test_bench_over_a_unix_socket_agrees_with_tcp(make_live, tmp_path, default_model_path, default_tokenizer,
                                                  monkeypatch) -> None:
    tokenizer = default_tokenizer
    monkeypatch.setattr(bench, "load_tokenizer", lambda name: tokenizer)  # loading the GGUF takes seconds
    config = dict(step_sleep_s=0.002, max_seq_len=256, num_pages=300)
    tcp, uds = make_live(**config), make_live(uds=str(tmp_path / "b.sock"), **config)

    def run(*where: str) -> dict:
        parser = argparse.ArgumentParser()
        bench.add_arguments(parser)
        args = parser.parse_args([*where, "--tokenizer", default_model_path, "--disable-tqdm", "--num-prompts", "8",
                                  "--random-input-len", "8", "--random-output-len", "12", "--ignore-eos",
                                  "--temperature", "0", "--max-concurrency", "4", "--seed", "3"])
        return asyncio.run(bench.benchmark(args))

    over_tcp = run("--base-url", tcp.url)
    for where in (("--base-url", f"unix:{uds.uds}"), ("--unix-socket", uds.uds, "--base-url", "http://localhost")):
        over_uds = run(*where)
        assert over_uds["model_id"] == over_tcp["model_id"] == MODEL  # looked up at /v1/models over the socket
        assert over_uds["completed"] == over_tcp["completed"] == 8 and over_uds["failed"] == 0
        for key in ("input_lens", "output_lens", "generated_texts"):
            assert over_uds[key] == over_tcp[key], key
        assert over_uds["output_lens"] == [12] * 8 and all(over_uds["generated_texts"])
        # timing: the same server speed (mock steps of 2 ms), so the same order of magnitude on a busy host
        for key in ("mean_e2el_ms", "mean_ttft_ms"):
            assert over_tcp[key] / 5 - 20 < over_uds[key] < over_tcp[key] * 5 + 20, (key, over_uds[key], over_tcp[key])


def test_bench_names_a_missing_socket(capsys, tmp_path) -> None:
    assert bench.main(["--base-url", f"unix:{tmp_path / 'none.sock'}", "--disable-tqdm"]) == 2
    assert "does not exist" in capsys.readouterr().err


# ---- the serve command in a child process without TCP --------------------------------------------


# socket(2) for TCP/UDP fails in the child, as on the lent TPU machine: C code (grpc, uvloop) included
_NO_INET = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <sys/socket.h>
int socket(int domain, int type, int protocol) {
    static int (*real)(int, int, int);
    if (domain == AF_INET || domain == AF_INET6) { errno = EACCES; return -1; }
    if (!real) real = (int (*)(int, int, int))dlsym(RTLD_NEXT, "socket");
    return real(domain, type, protocol);
}
"""


@pytest.fixture(scope="module")
def no_inet_preload(tmp_path_factory) -> str:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        pytest.skip("needs a C compiler (as the native kernels do) to forbid TCP sockets in C code")
    out = tmp_path_factory.mktemp("noinet")
    (out / "noinet.c").write_text(_NO_INET)
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(out / "noinet.so"), str(out / "noinet.c"), "-ldl"],
                   check=True, capture_output=True)
    probe = subprocess.run([sys.executable, "-c", "import socket; socket.socket()"], capture_output=True, text=True,
                           env={**os.environ, "LD_PRELOAD": str(out / "noinet.so")})
    assert probe.returncode != 0 and "PermissionError" in probe.stderr, probe.stderr  # the shim works
    return str(out / "noinet.so")


class _Child:
    """`slipstream serve` over MockEngine (tests/server/mock_serve.py) with its stderr read on a thread."""

    def __init__(self, *argv: str, preload: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.server.mock_serve", *argv], cwd=ROOT,
                                     stderr=subprocess.PIPE, text=True, env={**os.environ, "LD_PRELOAD": preload})
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True)
        self._reader.start()

    def log(self) -> str:
        return "".join(self.lines)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def test_serve_uds_drains_on_sigterm_with_no_tcp_socket(tmp_path, no_inet_preload) -> None:
    http_path, grpc_path = tmp_path / "h.sock", tmp_path / "g.sock"
    _stale_socket(http_path)
    child = _Child("--step-sleep-s", "0.02", "serve", "--uds", str(http_path), "--grpc-uds", f"unix:{grpc_path}",
                   "--uds-mode", "0660", "--shutdown-timeout", "20", "--log-level", "warning", preload=no_inet_preload)
    try:
        assert wait_for(lambda: "ready on" in child.log() or child.proc.poll() is not None, timeout=60), child.log()
        assert f"ready on unix:{http_path}, gRPC on unix:{grpc_path}" in child.log(), child.log()
        assert _mode(http_path) == _mode(grpc_path) == 0o660
        with grpc.insecure_channel(f"unix:{grpc_path}") as channel:
            texts, _, _ = collect(pb_grpc.OrchestratorStub(channel).Decode(text_request("abc", 3), timeout=10))
        assert texts == ["def"]
        transport = httpx.HTTPTransport(uds=str(http_path))
        with httpx.Client(base_url="http://localhost", transport=transport, timeout=20) as http:
            assert http.get("/metrics").status_code == 200
            with http.stream("POST", "/v1/completions",
                             json={"prompt": "a", "max_tokens": 100, "stream": True}) as response:
                lines = response.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                child.proc.send_signal(signal.SIGTERM)
                with httpx.Client(base_url="http://localhost", transport=httpx.HTTPTransport(uds=str(http_path)),
                                  timeout=5) as probe:
                    assert wait_for(lambda: probe.get("/ready").status_code == 503, timeout=10)
                events = _data([first, *lines])
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
        assert events[-1] == "[DONE]" and len(text) == 100  # the stream in flight finished
        assert child.proc.wait(timeout=30) == 0, child.log()
    finally:
        child.kill()
    assert not http_path.exists() and not grpc_path.exists(), os.listdir(tmp_path)
    assert "PermissionError" not in child.log() and "Traceback" not in child.log(), child.log()
