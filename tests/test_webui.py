"""The web chat page in headless Chromium (Debian's /usr/bin/chromium, driven over the DevTools protocol on a
pipe: no browser download, no websocket library): one streamed reply, its speed shown while it streams, and the
speed, tau and acceptance shown under it are the ones the server measured for that request.

Set FLASHDRAFT_WEBUI_SCREENSHOT=docs/webui.png to also save the screenshot there.
"""
from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from test_server import ServerProcess, greedy

CHROMIUM = "/usr/bin/chromium"
QUESTION = "def add(a, b):"
MAX_TOKENS = 24
pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                reason=f"{CHROMIUM} is absent (Debian: apt-get install -y chromium)")


class Browser:
    """Chromium with --remote-debugging-pipe: JSON messages ending in NUL on fds 3 (in) and 4 (out)."""

    def __init__(self, profile: Path, log_path: Path):
        to_browser_r, self.to_browser = os.pipe()
        self.from_browser, from_browser_w = os.pipe()
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={profile}", "--remote-debugging-pipe", "--window-size=1100,760", "about:blank"]
        self.log = open(log_path, "w")
        # bash (dash takes one-digit fds only) puts the pipe ends on the fds the protocol expects, then becomes Chromium.
        self.proc = subprocess.Popen(["bash", "-c", f'exec "$0" "$@" 3<&{to_browser_r} 4>&{from_browser_w}', CHROMIUM,
                                      *flags], pass_fds=(to_browser_r, from_browser_w), stdout=self.log,
                                     stderr=subprocess.STDOUT)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self.buffer = b""
        self.next_id = 0
        self.session = None

    def call(self, method: str, timeout: float = 30, **params) -> dict:
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params}
        if self.session is not None:
            message["sessionId"] = self.session
        os.write(self.to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            while b"\0" in self.buffer:
                raw, self.buffer = self.buffer.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self.next_id:
                    assert "error" not in reply, f"{method}: {reply['error']}"
                    return reply["result"]
            chunk = os.read(self.from_browser, 1 << 20)
            assert chunk, "Chromium closed the DevTools pipe"
            self.buffer += chunk
        raise TimeoutError(f"{method}: no reply in {timeout} s")

    def open_page(self, url: str) -> None:
        page = next(t for t in self.call("Target.getTargets")["targetInfos"] if t["type"] == "page")
        self.session = self.call("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]
        self.call("Emulation.setDeviceMetricsOverride", width=1100, height=760, deviceScaleFactor=1, mobile=False)
        self.call("Page.navigate", url=url)

    def js(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.js(expression)
            if value:
                return value
            time.sleep(0.1)
        raise TimeoutError(f"still false after {timeout} s: {expression}")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self.to_browser)
        os.close(self.from_browser)
        self.log.close()


@pytest.fixture(scope="module")
def webui_server(qwen3_dir, drafter_dir, tmp_path_factory):
    srv = ServerProcess(["-m", str(qwen3_dir), "-md", str(drafter_dir), "-c", "256", "-t", "1",
                         "--no-spec-dm-adaptive"],  # the random drafter would soon switch an adaptive one off
                        tmp_path_factory.mktemp("webui") / "server.log")
    yield srv
    srv.stop()


def test_page_streams_a_reply_and_shows_its_stats(webui_server, engine, tmp_path):
    expected = greedy(engine, MAX_TOKENS, messages=[{"role": "user", "content": QUESTION}])

    browser = Browser(tmp_path / "profile", tmp_path / "chromium.log")
    try:
        browser.open_page(webui_server.url + "/")
        browser.wait_for("(document.getElementById('status') || {}).textContent === 'ready'", 60)
        assert "DFlash" in browser.js("document.getElementById('model').textContent")
        # Every live figure the page shows while the reply streams (it is removed when the reply ends).
        browser.js("window.liveSeen = []; new MutationObserver(() => document.querySelectorAll('.live-stats')"
                   ".forEach((e) => window.liveSeen.push(e.textContent))).observe(document.getElementById("
                   "'transcript'), {subtree: true, childList: true, characterData: true})")
        browser.js(f"document.getElementById('max-tokens').value = {MAX_TOKENS};"
                   f"document.getElementById('prompt').value = {json.dumps(QUESTION)};"
                   "document.getElementById('send').click()")
        stats = browser.wait_for("(document.querySelector('.message.assistant .stats') || {}).textContent", 120)
        reply = browser.js("document.querySelector('.message.assistant .body').textContent")
        live = browser.js("window.liveSeen")
        assert browser.js("document.querySelectorAll('.live-stats').length") == 0
        png = base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"])
    finally:
        browser.close()

    assert reply == expected
    shown = re.search(r"([\d.]+) tok/s · tau ([\d.]+) tokens/step · accepted (\d+)/(\d+) drafted tokens "
                      r"\(([\d.]+)%\) · (\d+) steps, (\d+) with a draft", stats)
    assert shown, stats
    assert f"{MAX_TOKENS} tokens" in stats
    measured = re.findall(r": ([\d.]+) tok/s; .*?; tau ([\d.]+), acceptance \d+/\d+ \(([\d.]+)%\)",
                          webui_server.log())
    assert measured == [(shown[1], shown[2], shown[5])], "the page shows other numbers than the server measured"
    accepted, drafted, steps, drafting_steps = (int(shown[i]) for i in (3, 4, 6, 7))
    assert float(shown[1]) > 0 and accepted <= drafted and drafting_steps <= steps
    assert float(shown[2]) == pytest.approx((accepted + steps) / steps, abs=0.006)  # tau, as the page says
    counts = [int(m[1]) for m in (re.search(r"tok/s · (\d+) tokens so far", t) for t in live) if m]
    assert counts and counts == sorted(counts) and counts[-1] <= MAX_TOKENS, live

    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    (tmp_path / "webui.png").write_bytes(png)
    if os.environ.get("FLASHDRAFT_WEBUI_SCREENSHOT"):
        shutil.copy(tmp_path / "webui.png", os.environ["FLASHDRAFT_WEBUI_SCREENSHOT"])
