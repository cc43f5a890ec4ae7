"""A live Slipstream HTTP server over MockEngine on a random local port, plus a byte-level tokenizer.

With ByteTokenizer and MockEngine every output is hand-computable: the prompt "abc" continues
"def...", and the chat template below ends in ">" so a chat reply starts "?@AB...".
"""
from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from typing import Any, Callable, Iterator

import httpx
import jinja2
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from slipstream.engine.mock_engine import MockEngine
from slipstream.engine.distributed.replicas import ReplicaSet
from slipstream.engine.scheduler import OutputProcessor, Scheduler, SchedulerConfig
from slipstream.server.app import create_app
from slipstream.server.http_server import SlipstreamServer, make_server
from slipstream.server.fim import fim_format
from slipstream.server.reasoning import reasoning_format
from slipstream.server.service import Service, ServiceConfig
from slipstream.server.tool_formats import tool_format

MODEL = "mock-model"
BOS, EOS = 256, 257
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


class ByteTokenizer:
    """ids 0..255 are UTF-8 bytes; 256 is BOS and 257 EOS."""

    vocab_size = 258
    eos_token_ids = frozenset({EOS})
    bos_token_id, add_bos = BOS, True

    def __init__(self) -> None:
        self._template = jinja2.Environment().from_string(CHAT_TEMPLATE)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + list(text.encode())

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        out, raw = [], bytearray()
        for i in ids:
            if i < 256:
                raw.append(i)
                continue
            out.append(raw.decode(errors="replace"))
            raw.clear()
            out.append(self.special_text(i, skip_special_tokens))
        out.append(raw.decode(errors="replace"))
        return "".join(out)

    def special_text(self, token_id: int, skip_special_tokens: bool) -> str:
        """The text of an id past the bytes."""
        return "" if skip_special_tokens else "<s>" if token_id == BOS else "</s>"

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt)


class PieceTokenizer(ByteTokenizer):
    """Bytes, plus `pieces` (id -> text, ids from 258 up) as single tokens, matched first when encoding, and `end`
    as EOS: a prompt ending in a piece's id makes MockEngine reply with the pieces after it, a scripted reply."""

    def __init__(self, pieces: dict[int, str], end: int, template: str = CHAT_TEMPLATE) -> None:
        super().__init__()
        self.pieces, self.vocab_size, self.eos_token_ids = pieces, end + 1, frozenset({end})
        self._template = jinja2.Environment().from_string(template)
        self._ids = {text: i for i, text in pieces.items()}
        self._longest_first = sorted(self._ids, key=len, reverse=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            piece = next((p for p in self._longest_first if text.startswith(p, i)), None)
            if piece is not None:
                ids.append(self._ids[piece])
                i += len(piece)
            else:
                ids.extend(text[i].encode())
                i += 1
        return ids

    def special_text(self, token_id: int, skip_special_tokens: bool) -> str:
        return self.pieces.get(token_id, "")

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                            **variables: Any) -> str:
        return self._template.render(**variables, messages=messages, add_generation_prompt=add_generation_prompt)


class CountingTokenizer(ByteTokenizer):
    """Counts encode calls: cheap checks must refuse a request before any tokenizing."""

    def __init__(self) -> None:
        super().__init__()
        self.encoded = 0

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        self.encoded += 1
        return super().encode(text, add_special_tokens=add_special_tokens)


@dataclasses.dataclass
class LiveServer:
    url: str
    engine: MockEngine
    scheduler: Scheduler | ReplicaSet
    service: Service
    server: SlipstreamServer
    thread: threading.Thread
    api_key: str | None
    engines: list[MockEngine] = dataclasses.field(default_factory=list)  # one per replica
    uds: str | None = None  # the unix socket it serves on (`url` then only names the Host)

    def client(self, api_key: str | None = None) -> openai.OpenAI:
        # max_retries=0: the client would otherwise retry 429/503 itself and hide them.
        transport = {"http_client": httpx.Client(transport=httpx.HTTPTransport(uds=self.uds))} if self.uds else {}
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key or self.api_key or "unused",
                             max_retries=0, timeout=10, **transport)

    def http(self, **kwargs: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        if self.uds:
            kwargs.setdefault("transport", httpx.HTTPTransport(uds=self.uds))
        return httpx.Client(base_url=self.url, headers=headers, timeout=10, **kwargs)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample from /metrics, keyed by (name, sorted labels)."""
        transport = httpx.HTTPTransport(uds=self.uds) if self.uds else None
        with httpx.Client(base_url=self.url, transport=transport, timeout=5) as http:
            text = http.get("/metrics").text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def metric(self, name: str, **labels: str) -> float:
        """The one sample of `name` whose labels include `labels` (so `replica` may be left out while
        the server has one replica); KeyError when none or several match."""
        found = [value for (n, have), value in self.metrics().items()
                 if n == name and set(labels.items()) <= set(have)]
        if len(found) != 1:
            raise KeyError(f"{name}{labels}: {len(found)} samples match")
        return found[0]

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        if self.thread.is_alive():
            raise RuntimeError("test server did not shut down within 15 s")


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def start_live(*, start: bool = True, api_key: str | None = None, max_body_bytes: int = 1 << 20,
               max_queue: int = 256, shutdown_timeout_s: float = 5.0, exit_on_engine_failure: bool = True,
               body_timeout_s: float = 30.0, header_timeout_s: float = 10.0, max_connections: int | None = 1024,
               service_config: dict[str, Any] | None = None, replicas: int = 1, uds: str | None = None,
               uds_mode: int = 0o600, pooling: str = "last", tokenizer: Any = None,
               reasoning_parser: str = "auto", tool_call_parser: str = "auto", **engine_kwargs: Any) -> LiveServer:
    """`replicas` > 1: data parallel, a ReplicaSet over that many MockEngines and schedulers.
    `uds`: serve on this unix socket path (as `serve --uds`) instead of a loopback port.
    `tokenizer`: another than ByteTokenizer (the engine then takes its vocabulary and EOS)."""
    tokenizer = tokenizer or ByteTokenizer()
    engine_kwargs = {"vocab_size": tokenizer.vocab_size, "eos_token_ids": frozenset(tokenizer.eos_token_ids),
                     "max_seq_len": 128, "max_slots": 4, "num_pages": 128, **engine_kwargs}
    engines = [MockEngine(**engine_kwargs) for _ in range(replicas)]
    engine = engines[0]
    schedulers = [Scheduler(e, OutputProcessor(tokenizer), SchedulerConfig(max_queue=max_queue)) for e in engines]
    scheduler = schedulers[0] if replicas == 1 else ReplicaSet(schedulers)
    if start:
        scheduler.start()
    service = Service(scheduler, engine, tokenizer, ServiceConfig(model_name=MODEL, **(service_config or {})),
                      reasoning=reasoning_format(tokenizer, reasoning_parser), fim=fim_format(tokenizer),
                      tool_format=tool_format(tokenizer, tool_call_parser))
    app = create_app(service, api_key=api_key, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s,
                     pooling=pooling)
    url, server, thread = run_http(app, shutdown_timeout_s=shutdown_timeout_s,
                                   exit_on_engine_failure=exit_on_engine_failure, header_timeout_s=header_timeout_s,
                                   max_connections=max_connections, uds=uds, uds_mode=uds_mode)
    return LiveServer(url, engine, scheduler, service, server, thread, api_key, engines, uds)


def run_http(app, *, shutdown_timeout_s: float = 5.0, uds: str | None = None,
             **server_kwargs: Any) -> tuple[str, SlipstreamServer, threading.Thread]:
    """Serve `app` on a free loopback port (or the unix socket `uds`) in a thread; (url, server, thread)
    once it listens. Stop it with `server.should_exit = True` and a join."""
    sockets, port = None, 0
    if uds is None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sockets, port = [sock], sock.getsockname()[1]
    server = make_server(app, "127.0.0.1", port, log_level="warning", shutdown_timeout_s=shutdown_timeout_s,
                         started_at=time.monotonic(), uds=uds, **server_kwargs)
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, daemon=True)
    thread.start()
    if not wait_for(lambda: server.started or not thread.is_alive(), timeout=10) or not server.started:
        raise RuntimeError("test server did not start within 10 s")
    return ("http://localhost" if uds else f"http://127.0.0.1:{port}"), server, thread


@contextlib.contextmanager
def serve_model_dir(path: str, flags: list[str]) -> Iterator[str]:
    """`slipstream serve --model path *flags` as the CLI builds it (engine, image inputs), in this process on a free
    port: its URL, stopped after the block."""
    from slipstream.engine.scheduler import OutputProcessor, Scheduler, SchedulerConfig
    from slipstream.server.app import create_app
    from slipstream.server.cli import build_engine, build_parser, image_inputs
    from slipstream.server.service import Service, ServiceConfig

    args = build_parser().parse_args(["serve", "--model", path, *flags])
    engine, tokenizer, resolved = build_engine(args)
    scheduler = Scheduler(engine, OutputProcessor(tokenizer), SchedulerConfig(max_queue=8))
    service = Service(scheduler, engine, tokenizer, ServiceConfig(model_name="dummy", max_prompt_bytes=1 << 20),
                      images=image_inputs(args, engine, resolved, tokenizer))
    scheduler.start()
    url, server, thread = run_http(create_app(service, api_key=None))
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        scheduler.shutdown(timeout=5)


@pytest.fixture
def make_live() -> Iterator[Callable[..., LiveServer]]:
    """Servers with custom settings (engine kwargs go to MockEngine), stopped after the test."""
    servers: list[LiveServer] = []

    def make(**kwargs: Any) -> LiveServer:
        servers.append(start_live(**kwargs))
        return servers[-1]

    yield make
    for live in servers:
        live.stop()  # the server's shutdown also shuts the scheduler down


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    """One default server shared by a module's tests (they must not depend on its counters)."""
    server = start_live()
    yield server
    server.stop()
