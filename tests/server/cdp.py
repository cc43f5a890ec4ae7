"""A headless Chromium driven over the DevTools protocol (--remote-debugging-pipe: NUL-separated JSON
on fds 3 and 4, so no websocket library), for the chat page's browser tests. Test-only code."""
from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from typing import Any

BINARIES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    return next((path for name in BINARIES if (path := shutil.which(name))), None)


def install_chromium() -> str:
    """Chromium's path, installing Debian's package when it is missing and apt-get can (as root).
    RuntimeError saying why not otherwise: the page's tests need a real browser."""
    if (path := find_chromium()) is not None:
        return path
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        raise RuntimeError("the chat page tests need Chromium: `apt-get install -y --no-install-recommends chromium` "
                           "(as root), or put chromium on PATH")
    for command in (["apt-get", "install", "-y", "--no-install-recommends", "chromium"],
                    ["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]):
        done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        if command[1] == "install" and done.returncode == 0:
            break
    if (path := find_chromium()) is None:
        raise RuntimeError(f"installing chromium with apt-get failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return path


class CdpError(RuntimeError):
    pass


class Browser:
    """One headless browser process; `page()` opens a tab."""

    def __init__(self, binary: str, timeout_s: float = 15.0) -> None:
        self.timeout_s = timeout_s
        self._profile = tempfile.mkdtemp(prefix="slipstream-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # above 9 (bash takes such fd numbers; dash cannot), so "3<&N 4>&M" cannot clobber the other end
        for low in (to_browser_r, from_browser_w):
            high = fcntl.fcntl(low, fcntl.F_DUPFD_CLOEXEC, 10)
            os.close(low)
            if low == to_browser_r:
                to_browser_r = high
            else:
                from_browser_w = high
        args = ["--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
                "--disable-extensions", "--disable-background-networking", "--disable-dev-shm-usage",
                "--remote-debugging-pipe", f"--user-data-dir={self._profile}", "about:blank"]
        # the browser reads commands on fd 3 and writes answers on fd 4
        script = f'exec "$0" "$@" 3<&{to_browser_r} 4>&{from_browser_w} {to_browser_r}<&- {from_browser_w}>&-'
        self.proc = subprocess.Popen(["bash", "-c", script, binary, *args], pass_fds=(to_browser_r, from_browser_w),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._next_id = 0
        self._answers: dict[int, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self._lock = threading.Lock()  # one writer at a time
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        buffer = b""
        while chunk := os.read(self._from_browser, 1 << 16):
            buffer += chunk
            *messages, buffer = buffer.split(b"\0")
            with self._cond:
                for raw in messages:
                    message = json.loads(raw)
                    if "id" in message:
                        self._answers[message["id"]] = message
                    else:
                        self.events.append(message)
                self._cond.notify_all()

    def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None) -> dict[str, Any]:
        with self._lock:
            self._next_id += 1
            ident = self._next_id
            message = {"id": ident, "method": method, "params": params or {}}
            if session is not None:
                message["sessionId"] = session
            os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        with self._cond:
            if not self._cond.wait_for(lambda: ident in self._answers, timeout=self.timeout_s):
                raise CdpError(f"{method}: no answer within {self.timeout_s} s")
            answer = self._answers.pop(ident)
        if "error" in answer:
            raise CdpError(f"{method}: {answer['error']}")
        return answer.get("result", {})

    def page(self) -> "Page":
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        return Page(self, target, session)

    def close(self) -> None:
        try:
            self.send("Browser.close")
        except (CdpError, OSError):
            pass  # already gone: the kill below still reaps it
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_browser)
        shutil.rmtree(self._profile, ignore_errors=True)


class Page:
    def __init__(self, browser: Browser, target: str, session: str) -> None:
        self.browser, self.target, self.session = browser, target, session
        self.call("Page.enable")
        self.call("Runtime.enable")
        self.call("Page.bringToFront")  # a background tab's timers are throttled

    def close(self) -> None:
        self.browser.send("Target.closeTarget", {"targetId": self.target})

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        return self.browser.send(method, params, self.session)

    def events(self, method: str) -> list[dict[str, Any]]:
        with self.browser._cond:
            return [e["params"] for e in self.browser.events if e.get("sessionId") == self.session
                    and e["method"] == method]

    def eval(self, expression: str) -> Any:
        """The value of a JS expression (awaited if a promise); CdpError if it throws."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise CdpError(f"{expression[:80]}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait(self, expression: str, timeout: float = 10.0, interval: float = 0.02) -> Any:
        """Poll until the expression is truthy; its value. CdpError after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.eval(expression)
            except CdpError:  # the page is between documents (a navigation)
                value = None
            if value not in (None, False, "", 0, []):
                return value
            if time.monotonic() > deadline:
                raise CdpError(f"not true within {timeout} s: {expression}")
            time.sleep(interval)

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        self.wait("document.readyState === 'complete' && location.href !== 'about:blank'")

    def reload(self) -> None:
        self.eval("window.__reloading = true")
        self.call("Page.reload")
        self.wait("!window.__reloading && document.readyState === 'complete'")

    def type(self, text: str) -> None:
        self.call("Input.insertText", text=text)

    def key(self, key: str, code: int, text: str = "", shift: bool = False) -> None:
        for kind in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", type=kind, key=key, code=key, windowsVirtualKeyCode=code,
                      text=text if kind == "keyDown" else "", modifiers=8 if shift else 0)

    def click(self, selector: str) -> None:
        """A real mouse click at the element's centre."""
        x, y = self.eval(f"(e => {{ e.scrollIntoView({{block: 'center'}}); const r = e.getBoundingClientRect(); "
                         f"return [r.x + r.width / 2, r.y + r.height / 2]; }})(document.querySelector({json.dumps(selector)}))")
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def view(self, width: int, height: int, *, mobile: bool = False, dark: bool = False) -> None:
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                  mobile=mobile)
        self.call("Emulation.setEmulatedMedia",
                  features=[{"name": "prefers-color-scheme", "value": "dark" if dark else "light"}])

    def screenshot(self, path: str) -> bytes:
        data = base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])
        with open(path, "wb") as f:
            f.write(data)
        return data

