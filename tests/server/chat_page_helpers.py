"""What the chat page's browser tests share: a module's headless Chromium and its tabs, live mock servers (one
stepping slowly enough to watch a reply grow, one whose every reply is a Markdown script), and opening the page
and sending a message as a person would."""
from __future__ import annotations

import socket
import threading
from typing import Iterator

import pytest

from slipstream.engine.mock_engine import MockEngine
from slipstream.engine.scheduler import OutputProcessor, Scheduler, SchedulerConfig
from slipstream.server.app import create_app
from slipstream.server.http_server import make_server
from slipstream.server.service import Service, ServiceConfig
from tests.server.cdp import Browser, Page, install_chromium
from tests.server.conftest import BOS, MODEL, ByteTokenizer, LiveServer, start_live, wait_for

STEP_S = 0.03  # modelled device time per step: slow enough to watch a reply grow
REPLY = "#messages li.assistant:last-child .content"
DONE = "!document.getElementById('send').disabled"
SCRIPT = ("## Adding numbers\n\nHere is a **Python** function:\n\n```python\ndef add(a, b):\n    return a + b\n```\n\n"
          "- it takes *two* arguments\n- it returns `a + b`\n\n"
          "Model text such as <img src=x onerror=alert(1)> and <script>alert(2)</script> stays text.")


class ScriptedTokenizer(ByteTokenizer):
    """Every prompt ends with a START token, and MockEngine continues START + 1, START + 2, ...: ids
    past START are the script's pieces, then EOS. So every reply is SCRIPT, a few characters a token."""

    def __init__(self, script: str, piece: int = 6) -> None:
        super().__init__()
        self.pieces = [script[i:i + piece] for i in range(0, len(script), piece)]
        self.start = 258
        self.eos = self.start + len(self.pieces) + 1
        self.vocab_size = self.eos + 1
        self.eos_token_ids = frozenset({self.eos})

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return super().encode(text, add_special_tokens=add_special_tokens) + [self.start]

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        script = [i for i in ids if self.start < i < self.eos]
        rest = [i for i in ids if i < 256 or i == BOS]
        return super().decode(rest) + "".join(self.pieces[i - self.start - 1] for i in script)


def start_scripted(tokenizer: ScriptedTokenizer) -> LiveServer:
    engine = MockEngine(vocab_size=tokenizer.vocab_size, eos_token_ids=tokenizer.eos_token_ids, max_seq_len=512,
                        max_slots=2, num_pages=256, step_sleep_s=0.01)
    scheduler = Scheduler(engine, OutputProcessor(tokenizer), SchedulerConfig())
    scheduler.start()
    service = Service(scheduler, engine, tokenizer, ServiceConfig(model_name=MODEL))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = make_server(create_app(service, api_key=None), "127.0.0.1", sock.getsockname()[1], log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    if not wait_for(lambda: server.started, timeout=10):
        raise RuntimeError("scripted server did not start within 10 s")
    return LiveServer(f"http://127.0.0.1:{sock.getsockname()[1]}", engine, scheduler, service, server, thread, None)


@pytest.fixture(scope="module")
def chromium() -> Iterator[Browser]:
    try:
        binary = install_chromium()
    except RuntimeError as exc:
        pytest.fail(str(exc))
    b = Browser(binary)
    yield b
    b.close()


@pytest.fixture
def browser(chromium: Browser) -> Iterator[Browser]:
    """The module's browser; the tabs a test opened are closed after it."""
    opened: list[Page] = []
    page = chromium.page

    def tracked() -> Page:
        opened.append(page())
        return opened[-1]

    chromium.page = tracked  # type: ignore[method-assign]
    yield chromium
    chromium.page = page  # type: ignore[method-assign]
    for p in opened:
        p.close()


@pytest.fixture(scope="module")
def slow() -> Iterator[LiveServer]:
    server = start_live(step_sleep_s=STEP_S, max_seq_len=256, num_pages=256)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def scripted() -> Iterator[LiveServer]:
    server = start_scripted(ScriptedTokenizer(SCRIPT))
    yield server
    server.stop()


def open_chat(browser: Browser, url: str, *, max_tokens: int = 40) -> Page:
    page = browser.page()
    page.goto(url + "/")
    page.eval("localStorage.clear(); sessionStorage.clear()")
    page.reload()
    page.wait("document.getElementById('model').options.length || !document.getElementById('key-form').hidden")
    for field, value in (("temperature", 0), ("max-tokens", max_tokens)):  # as a person would: kept for next time
        page.eval(f"(f => {{ f.value = '{value}'; f.dispatchEvent(new Event('change')); }})"
                  f"(document.getElementById('{field}'))")
    return page


def send(page: Page, text: str) -> None:
    page.eval("document.getElementById('prompt').focus()")
    page.type(text)
    page.key("Enter", 13, "\r")
