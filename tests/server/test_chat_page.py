"""The chat page at / in a real headless Chromium (tests/server/cdp.py) against live mock servers:
streaming, the API's text, Stop freeing the slot, safe Markdown, the API key, history, themes,
contrast and the screenshots (SLIPSTREAM_SCREENSHOTS=docs/ writes them into docs/)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
from fastapi.testclient import TestClient

from slipstream.engine.mock_engine import MockEngine
from slipstream.engine.scheduler import OutputProcessor, Scheduler, SchedulerConfig
from slipstream.server.app import create_app, make_server
from slipstream.server.cli import build_parser
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


def test_a_reply_streams_in_token_by_token_and_matches_the_api(browser: Browser, slow: LiveServer) -> None:
    page = open_chat(browser, slow.url)
    page.eval("document.getElementById('prompt').focus()")
    page.type("first line")
    page.key("Enter", 13, "\r", shift=True)  # Shift+Enter: a new line, nothing sent
    page.type("hi")
    assert page.eval("document.getElementById('prompt').value") == "first line\nhi"
    assert page.eval("document.querySelectorAll('#messages li').length") == 0
    page.key("Enter", 13, "\r")
    seen = []
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not page.eval(f"{DONE} && !!document.querySelector('{REPLY}')"):
        text = page.eval(f"document.querySelector('{REPLY}')?.textContent ?? ''")
        if text and (not seen or seen[-1] != text):
            seen.append(text)
        time.sleep(0.01)
    final = page.eval(f"document.querySelector('{REPLY}').textContent")
    intermediate = [s for s in seen if s != final]
    assert len(intermediate) >= 2, seen  # the reply grew on screen, not all at once
    assert all(final.startswith(s) for s in intermediate)

    with slow.http() as http:
        api = http.post("/v1/chat/completions", json={"model": MODEL, "temperature": 0, "top_p": 1, "max_tokens": 40,
                                                      "messages": [{"role": "user", "content": "first line\nhi"}]})
    assert final == api.json()["choices"][0]["message"]["content"]
    assert final.startswith("?@ABC") and len(final) == 40
    stats = page.eval("document.querySelector('#messages li.assistant .stats').textContent")
    assert "TTFT" in stats and "tokens/s" in stats and "40 tokens" in stats, stats
    assert page.eval("document.querySelector('#messages li.user .content').textContent") == "first line\nhi"


def test_stop_aborts_the_request_and_the_server_frees_the_slot(browser: Browser, make_live) -> None:
    step_s = 0.2  # long steps, so "within one step" is measurable above the polling
    slow = make_live(step_sleep_s=step_s, max_seq_len=256, num_pages=256)
    page = open_chat(browser, slow.url, max_tokens=200)
    send(page, "a long one")
    page.wait(f"(document.querySelector('{REPLY}')?.textContent ?? '').length >= 2")
    assert slow.metric("slipstream_requests_running") == 1
    page.click("#stop")
    clicked = time.monotonic()
    assert wait_for(lambda: slow.metric("slipstream_requests_running") == 0, timeout=2.0)
    freed_s = time.monotonic() - clicked
    # the scheduler drops it after the step in flight; 0.15 s for the disconnect and the polling
    assert freed_s < step_s + 0.15, freed_s
    page.wait(DONE)
    stopped = page.eval(f"document.querySelector('{REPLY}').textContent")
    assert 2 <= len(stopped) < 20
    assert "stopped" in page.eval("document.querySelector('#messages li.assistant .stats').textContent")
    assert slow.engine.occupied_slots == []


def test_markdown_renders_and_html_in_model_output_stays_text(browser: Browser, scripted: LiveServer) -> None:
    page = open_chat(browser, scripted.url, max_tokens=400)
    send(page, "show me")
    page.wait(DONE + f" && document.querySelector('{REPLY}')?.textContent.endsWith('stays text.')")
    reply = f"document.querySelector('{REPLY}')"
    assert page.eval(f"{reply}.querySelector('h4').textContent") == "Adding numbers"
    assert page.eval(f"{reply}.querySelector('strong').textContent") == "Python"
    assert page.eval(f"{reply}.querySelector('.code pre code').textContent") == "def add(a, b):\n    return a + b"
    browser.send("Browser.grantPermissions", {"origin": scripted.url,
                                              "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]})
    page.click(f"{REPLY} .code .copy")
    page.wait(f"{reply}.querySelector('.code .copy').textContent === 'Copied'", timeout=3)
    assert page.eval("navigator.clipboard.readText()") == "def add(a, b):\n    return a + b"
    assert page.eval(f"[...{reply}.querySelectorAll('ul li')].map(l => l.textContent)") == \
        ["it takes two arguments", "it returns a + b"]
    assert page.eval("document.querySelectorAll('#messages img, #messages script').length") == 0
    text = page.eval(f"{reply}.textContent")
    assert "<img src=x onerror=alert(1)>" in text and "<script>alert(2)</script>" in text
    assert page.events("Page.javascriptDialogOpening") == []
    with scripted.http() as http:
        api = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 400})
    assert api.json()["choices"][0]["message"]["content"] == SCRIPT


def test_an_api_key_server_asks_for_the_key_and_then_answers(browser: Browser, make_live) -> None:
    keyed = make_live(api_key="sekret-key")
    page = open_chat(browser, keyed.url)
    assert page.eval("document.getElementById('key-form').hidden") is False  # /v1/models answered 401
    send(page, "hi")
    page.wait(DONE)
    assert page.eval("document.querySelectorAll('#messages li.assistant').length") == 0
    for key, accepted in (("wrong", False), ("sekret-key", True)):
        page.eval("document.getElementById('api-key').focus()")
        page.type(key)
        page.key("Enter", 13, "\r")
        if accepted:
            page.wait(DONE + f" && document.querySelector('{REPLY}')?.textContent.length === 40")
        else:
            page.wait("!document.getElementById('key-form').hidden")
    assert page.eval("document.getElementById('key-form').hidden") is True
    assert page.eval("document.getElementById('model').value") == MODEL
    assert page.eval("sessionStorage.getItem('slipstream.apiKey')") == "sekret-key"
    assert "sekret-key" not in page.eval("JSON.stringify(localStorage)")



def test_a_message_sent_before_the_key_goes_again_with_the_key_entered_meanwhile(browser: Browser, make_live) -> None:
    """The chat request's 401 arrives after the key was entered: a stale answer, so the page retries
    with the new key instead of forgetting it and asking again. CDP's Fetch domain holds the requests."""
    keyed = make_live(api_key="sekret-key")
    page = open_chat(browser, keyed.url)
    page.call("Fetch.enable", patterns=[{"urlPattern": "*/v1/chat/completions"}])
    send(page, "hi")  # no key yet: held back, it will answer 401
    assert wait_for(lambda: len(page.events("Fetch.requestPaused")) == 1)
    page.eval("document.getElementById('api-key').focus()")
    page.type("sekret-key")
    page.key("Enter", 13, "\r")
    page.wait("document.getElementById('model').options.length")  # the models list answered with the key
    page.call("Fetch.continueRequest", requestId=page.events("Fetch.requestPaused")[0]["requestId"])
    assert wait_for(lambda: len(page.events("Fetch.requestPaused")) == 2), "the message was not sent again"
    retry = page.events("Fetch.requestPaused")[1]["request"]
    assert retry["headers"].get("Authorization") == "Bearer sekret-key"
    page.call("Fetch.continueRequest", requestId=page.events("Fetch.requestPaused")[1]["requestId"])
    page.wait(DONE + f" && document.querySelector('{REPLY}')?.textContent.length === 40")
    assert page.eval("document.getElementById('key-form').hidden") is True
    assert page.eval("sessionStorage.getItem('slipstream.apiKey')") == "sekret-key"
    assert page.eval("document.querySelectorAll('#messages li.assistant').length") == 1

def test_history_and_system_prompt_survive_a_reload(browser: Browser, slow: LiveServer) -> None:
    page = open_chat(browser, slow.url, max_tokens=5)
    page.eval("(s => { s.value = 'Be brief.'; s.dispatchEvent(new Event('input')); })"
              "(document.getElementById('system'))")
    send(page, "one")
    page.wait(DONE + f" && document.querySelector('{REPLY}')")
    send(page, "two")
    page.wait(DONE + " && document.querySelectorAll('#messages li.assistant').length === 2")
    before = page.eval("[...document.querySelectorAll('#messages .content')].map(c => c.textContent)")
    assert before[0] == "one" and before[2] == "two" and len(before) == 4
    page.reload()
    page.wait("document.querySelectorAll('#messages li').length === 4")
    assert page.eval("[...document.querySelectorAll('#messages .content')].map(c => c.textContent)") == before
    assert page.eval("document.getElementById('system').value") == "Be brief."
    assert page.eval("document.getElementById('max-tokens').value") == "5"
    page.click("#regenerate")  # the last reply again, from the same history
    page.wait(DONE + " && document.querySelectorAll('#messages li.assistant').length === 2")
    assert page.eval("[...document.querySelectorAll('#messages .content')].map(c => c.textContent)") == before
    page.click("#new-chat")
    assert page.eval("document.querySelectorAll('#messages li').length") == 0


# WCAG relative luminance and contrast, from the page's computed colours over its real background.
CONTRAST_JS = """(() => {
  const rgba = (c) => { const p = c.match(/[\\d.]+/g).map(Number); return [p[0], p[1], p[2], p.length > 3 ? p[3] : 1]; };
  const over = (top, under) => top.slice(0, 3).map((v, i) => v * top[3] + under[i] * (1 - top[3])).concat(1);
  const lum = (c) => { const f = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; };
                       return 0.2126 * f(c[0]) + 0.7152 * f(c[1]) + 0.0722 * f(c[2]); };
  const background = (el) => { const layers = []; for (let e = el; e; e = e.parentElement) {
      const c = rgba(getComputedStyle(e).backgroundColor); if (c[3] > 0) layers.push(c); if (c[3] >= 1) break; }
    return layers.reverse().reduce((under, top) => over(top, under), [255, 255, 255, 1]); };
  const out = {};
  for (const sel of SELECTORS) { const el = document.querySelector(sel);
    const bg = background(el); const fg = over(rgba(getComputedStyle(el).color), bg);
    const [a, b] = [lum(fg), lum(bg)].sort((x, y) => y - x); out[sel] = (a + 0.05) / (b + 0.05); }
  return out; })()"""
CONTRASTED = [".msg.assistant .content p", ".msg.user .content", ".who", ".stats", ".code pre code", "#send",
              "#new-chat", "#regenerate", "#prompt", "#temperature", "#model", "label[for=system]", "h1"]
VIEWS = {"desktop": (1280, 800, False), "phone": (390, 844, True)}


def test_screenshots_contrast_labels_and_focus_order(browser: Browser, scripted: LiveServer, tmp_path: Path) -> None:
    out = Path(os.environ.get("SLIPSTREAM_SCREENSHOTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    page = open_chat(browser, scripted.url, max_tokens=400)
    send(page, "How do I add two numbers in Python?")
    page.wait(DONE + f" && document.querySelector('{REPLY}')?.textContent.endsWith('stays text.')")
    unlabeled = page.eval("[...document.querySelectorAll('input, select, textarea, button')].filter(e => "
                          "!(e.labels?.length || e.getAttribute('aria-label') || e.textContent.trim())).map(e => e.id)")
    assert unlabeled == []
    for name, (width, height, mobile) in VIEWS.items():
        for theme in ("light", "dark"):
            page.view(width, height, mobile=mobile, dark=theme == "dark")
            page.eval("document.getElementById('messages').scrollTop = 0")
            toggle_says = "Light" if theme == "dark" else "Dark"  # the toggle follows the system's preference
            page.wait(f"document.getElementById('theme').textContent === '{toggle_says}'", timeout=2)
            shown = page.eval("getComputedStyle(document.querySelector('aside')).display")
            assert (shown == "none") == mobile  # the phone layout folds the settings away
            ratios = page.eval(CONTRAST_JS.replace("SELECTORS", json.dumps(CONTRASTED if not mobile else
                                                                           CONTRASTED[:-3])))
            low = {sel: round(r, 2) for sel, r in ratios.items() if r < 4.5}
            assert low == {}, f"{name} {theme}: contrast below 4.5"
            fits = page.eval("document.documentElement.scrollWidth <= innerWidth")
            assert fits, f"{name}: the page scrolls sideways"
            png = page.screenshot(str(out / f"chat-{name}-{theme}.png"))
            assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) < 300_000
            if mobile:  # the Settings button opens the folded panel, and closes it again
                page.click("#toggle-settings")
                assert page.eval("getComputedStyle(document.querySelector('aside')).display") == "flex"
                assert page.eval("document.getElementById('toggle-settings').getAttribute('aria-expanded')") == "true"
                assert page.eval("document.getElementById('send').getBoundingClientRect().bottom <= innerHeight")
                page.click("#toggle-settings")
                assert page.eval("getComputedStyle(document.querySelector('aside')).display") == "none"
    # the theme toggle overrides the system preference, and is remembered
    page.view(1280, 800, dark=False)
    page.click("#theme")
    assert page.eval("document.documentElement.dataset.theme") == "dark"
    assert page.eval("getComputedStyle(document.body).backgroundColor") == "rgb(22, 24, 28)"
    page.click("#theme")
    assert page.eval("getComputedStyle(document.body).backgroundColor") == "rgb(255, 255, 255)"
    # keyboard: from the message box, Tab reaches Send, then Stop is skipped while disabled
    page.eval("document.getElementById('prompt').focus()")
    order = []
    for _ in range(3):
        page.key("Tab", 9)
        order.append(page.eval("document.activeElement.id"))
    assert order == ["send", "regenerate", "system"], order


def test_the_page_has_a_csp_and_no_web_ui_turns_it_off(slow: LiveServer) -> None:
    with slow.http() as http:
        page = http.get("/")
        assert page.status_code == 200 and http.get("/chat").text == page.text
        csp = page.headers["content-security-policy"]
        assert "default-src 'self'" in csp and "script-src 'self'" in csp and "unsafe-inline" not in csp
        assert http.get("/static/chat.js").headers["content-type"].startswith("text/javascript")
    off = TestClient(create_app(slow.service, api_key=None, web_ui=False))
    assert off.get("/").status_code == 404 and off.get("/static/chat.js").status_code == 404
    assert off.get("/v1/models").status_code == 200
    assert build_parser().parse_args(["serve", "--no-web-ui"]).no_web_ui is True
    assert build_parser().parse_args(["serve"]).no_web_ui is False


def test_serve_prints_a_chat_link_that_opens_in_the_browser(browser: Browser) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    child = subprocess.Popen([sys.executable, "-m", "tests.server.mock_serve", "serve", "--host", "127.0.0.1",
                              "--port", str(port)], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        lines: list[str] = []
        for line in child.stderr:
            lines.append(line)
            if "ready on" in line:
                break
        link = f"chat page: http://127.0.0.1:{port}/"
        assert lines and link in lines[-1], "".join(lines)
        page = browser.page()
        page.goto(link.split(": ", 1)[1])
        # the served name is the default model's (mock_serve swaps only the engine)
        assert page.wait("document.getElementById('model').options.length") == 1
    finally:
        child.terminate()
        child.wait(timeout=15)


def test_parameters_reach_the_request_and_errors_show_the_server_message(browser: Browser, make_live) -> None:
    busy = make_live(step_sleep_s=STEP_S, max_seq_len=256, num_pages=256,
                     service_config={"max_requests_per_client": 1})
    page = open_chat(browser, busy.url)
    page.eval("window.__bodies = []; const real = window.fetch; window.fetch = (url, init) => { "
              "if (init && init.body) window.__bodies.push(JSON.parse(init.body)); return real(url, init); }")
    for field, value in (("seed", 7), ("top-p", 0.5)):
        page.eval(f"document.getElementById('{field}').value = '{value}'")
    page.click("#json-mode")
    send(page, "hi")
    status = "!document.getElementById('status').hidden && document.getElementById('status').textContent"
    # the byte tokenizer has no grammar support: the server's 400 and its message reach the person
    assert page.wait(status).startswith("The server answered 400: structured output is not available")
    body = page.eval("window.__bodies[0]")
    assert body["seed"] == 7 and body["top_p"] == 0.5 and body["temperature"] == 0 and body["max_tokens"] == 40
    assert body["response_format"] == {"type": "json_object"} and body["model"] == MODEL and body["stream"] is True
    assert body["messages"] == [{"role": "user", "content": "hi"}]

    page.click("#json-mode")
    holder = threading.Thread(target=lambda: busy.http().post("/v1/completions", json={
        "prompt": "a", "max_tokens": 60}), daemon=True)
    holder.start()  # this address's one allowed request, for ~2 s
    assert wait_for(lambda: busy.metric("slipstream_requests_running") == 1)
    send(page, "again")
    page.wait(f"({status}).includes('429')")
    assert page.eval(status).startswith("The server answered 429: ") and page.eval(status).endswith(" Retry after 1 s.")
    assert "response_format" not in page.eval("window.__bodies[1]")
    assert page.eval("document.querySelectorAll('#messages li.assistant').length") == 0
    holder.join(timeout=10)
