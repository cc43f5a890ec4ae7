"""How the chat page is served and looks, in a real headless Chromium (tests/server/cdp.py): themes, contrast,
labels, focus order and the screenshots (SLIPSTREAM_SCREENSHOTS=docs/ writes them into docs/), its CSP and
--no-web-ui, and the link `serve` prints."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from fastapi.testclient import TestClient

from slipstream.server.app import create_app
from slipstream.server.cli import build_parser
from tests.server.cdp import Browser
from tests.server.chat_page_helpers import DONE, REPLY, open_chat, send
from tests.server.chat_page_helpers import browser, chromium, scripted, slow  # noqa: F401 - fixtures
from tests.server.conftest import LiveServer


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
