"""The chat page at / in a real headless Chromium (tests/server/cdp.py) against live mock servers, as a person
chats: streaming, the API's text, Stop freeing the slot, safe Markdown, the API key, history, the parameters
and the server's errors. How it is served and looks: test_chat_page_serving.py."""
from __future__ import annotations

import json
import threading
import time

from tests.server.cdp import Browser, Page
from tests.server.chat_page_helpers import DONE, REPLY, SCRIPT, STEP_S, open_chat, send
from tests.server.chat_page_helpers import browser, chromium, scripted, slow  # noqa: F401 - fixtures
from tests.server.conftest import MODEL, LiveServer, wait_for


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


def test_a_reasoning_models_thinking_streams_into_a_fold_above_its_answer(browser: Browser, make_live) -> None:
    from tests.server.test_reasoning import ThinkTokenizer

    live = make_live(tokenizer=ThinkTokenizer(), step_sleep_s=STEP_S)
    page = open_chat(browser, live.url)
    send(page, "What is 2+2?")
    thinking = "document.querySelector('#messages li.assistant details.thinking')"
    page.wait(f"!!{thinking}")  # the fold appears while the model still thinks
    page.wait(DONE)
    assert page.eval(f"document.querySelector('{REPLY}').textContent") == "The answer is 4."
    assert page.eval(f"{thinking}.querySelector('summary').textContent") == "Thought"
    assert page.eval(f"{thinking}.lastChild.textContent") == "Let me see."
    assert page.eval(f"{thinking}.open") is False
    page.click("#messages li.assistant details.thinking summary")
    page.wait(f"{thinking}.open")
    stats = page.eval("document.querySelector('#messages li.assistant .stats').textContent")
    assert "8 tokens" in stats  # the thinking's tokens count as output


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
