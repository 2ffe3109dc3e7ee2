#!/usr/bin/env python3
"""Drive headless Chromium over the DevTools protocol to check or screenshot a stageb report.

Python standard library only: Chromium is started with --remote-debugging-pipe, which speaks
the DevTools protocol as NUL-terminated JSON on file descriptors 3 (commands in) and 4
(replies and events out), so no websocket client is needed.

  report_browser.py check REPORT.html
      Load the report from its file:// URL and fail (exit 1) on any uncaught exception,
      console error or warning, browser log error (a blocked load, a CSP violation), network
      request besides the page itself, dialog, <script> element, or missing section.
  report_browser.py screenshots REPORT.html OUT_DIR [SECTION ...]
      Save OUT_DIR/<section>.png for each section (default: all of them), each clipped to
      its section.

Environment: CHROMIUM (default: chromium, then chromium-browser, google-chrome).
"""

import base64
import json
import os
import pathlib
import select
import shutil
import subprocess
import sys
import tempfile
import time

SECTIONS = ["overview", "accuracy", "votes", "malformed", "reflection", "guidance",
            "need-review", "throughput"]
VIEWPORT = {"width": 1240, "height": 900}
# A section taller than this is cut in its screenshot (a 200-row table is thousands of px).
MAX_SHOT_HEIGHT = 2400
TIMEOUT_S = 60


def find_chromium():
    for name in [os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome"]:
        if name and shutil.which(name):
            return shutil.which(name)
    sys.exit("report_browser: no chromium found (set CHROMIUM)")


class Browser:
    """One headless Chromium and one page, over the DevTools pipe."""

    def __init__(self):
        self.profile = tempfile.mkdtemp(prefix="stageb-report-chromium-")
        to_chrome_r, self.to_chrome = os.pipe()
        self.from_chrome, from_chrome_w = os.pipe()

        def wire_fds():
            # Duplicate first: the pipe ends may themselves be 3 or 4.
            a, b = os.dup(to_chrome_r), os.dup(from_chrome_w)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.log = open(os.path.join(self.profile, "chromium.log"), "w")
        self.proc = subprocess.Popen(
            [find_chromium(), "--headless", "--remote-debugging-pipe", "--no-sandbox",
             "--disable-gpu", "--hide-scrollbars", "--no-first-run", "--no-default-browser-check",
             "--disable-extensions", "--disable-background-networking", "--mute-audio",
             f"--user-data-dir={self.profile}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
            pass_fds=(3, 4), preexec_fn=wire_fds)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self.buffer = b""
        self.next_id = 0
        self.events = []
        self.session = None
        self.deadline = time.monotonic() + TIMEOUT_S

    def _read_message(self):
        while b"\0" not in self.buffer:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("chromium did not answer in time")
            ready, _, _ = select.select([self.from_chrome], [], [], left)
            if ready:
                chunk = os.read(self.from_chrome, 1 << 20)
                if not chunk:
                    raise RuntimeError("chromium closed the DevTools pipe; see " + self.log.name)
                self.buffer += chunk
        message, self.buffer = self.buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method, params=None, session=True):
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params or {}}
        if session and self.session:
            message["sessionId"] = self.session
        os.write(self.to_chrome, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read_message()
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self.events.append(reply)

    def wait_for(self, method):
        for i, e in enumerate(self.events):
            if e["method"] == method:
                return self.events.pop(i)
        while True:
            message = self._read_message()
            if message.get("method") == method:
                return message
            if "method" in message:
                self.events.append(message)

    def open(self, url):
        target = self.call("Target.createTarget", {"url": "about:blank"}, session=False)
        attached = self.call("Target.attachToTarget",
                             {"targetId": target["targetId"], "flatten": True}, session=False)
        self.session = attached["sessionId"]
        for domain in ["Page", "Runtime", "Log", "Network"]:
            self.call(f"{domain}.enable")
        self.call("Emulation.setDeviceMetricsOverride",
                  dict(VIEWPORT, deviceScaleFactor=1, mobile=False))
        self.call("Page.navigate", {"url": url})
        self.wait_for("Page.loadEventFired")
        # Let late console messages and log entries arrive.
        self.call("Runtime.evaluate", {"expression": "new Promise(r => setTimeout(r, 300))",
                                       "awaitPromise": True})

    def evaluate(self, expression):
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"evaluate failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def close(self):
        try:
            self.call("Browser.close", session=False)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        shutil.rmtree(self.profile, ignore_errors=True)


def problems_of(browser, url):
    """Everything that went wrong while loading the page."""
    found = []
    for e in browser.events:
        method, p = e["method"], e.get("params", {})
        if method == "Runtime.exceptionThrown":
            found.append(f"uncaught exception: {p['exceptionDetails'].get('text')}")
        elif method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "warning", "assert"):
            args = " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", []))
            found.append(f"console.{p['type']}: {args}")
        elif method == "Log.entryAdded" and p["entry"].get("level") in ("error", "warning"):
            entry = p["entry"]
            found.append(f"browser log {entry['level']} ({entry.get('source')}): {entry.get('text')}")
        elif method == "Page.javascriptDialogOpening":
            found.append(f"a script opened a dialog: {p.get('message')}")
        elif method == "Network.requestWillBeSent":
            requested = p["request"]["url"]
            if requested.split("#")[0] != url.split("#")[0]:
                found.append(f"network request: {requested}")
    return found


def check(report):
    url = pathlib.Path(report).resolve().as_uri()
    browser = Browser()
    try:
        browser.open(url)
        problems = problems_of(browser, url)
        missing = browser.evaluate(
            f"{json.dumps(SECTIONS)}.filter(id => !document.getElementById(id))")
        if missing:
            problems.append(f"missing sections: {', '.join(missing)}")
        scripts = browser.evaluate("document.querySelectorAll('script').length")
        if scripts:
            problems.append(f"{scripts} <script> element(s) in the page")
        charts = browser.evaluate("document.querySelectorAll('figure.chart svg').length")
        title = browser.evaluate("document.title")
    finally:
        browser.close()
    for p in problems:
        print(f"report_browser: {p}", file=sys.stderr)
    if problems:
        return 1
    print(f"report_browser: {url} loads cleanly: {len(SECTIONS)} sections, {charts} charts, "
          f"no console error, no network request, no script ({title})")
    return 0


def screenshots(report, out_dir, sections):
    url = pathlib.Path(report).resolve().as_uri()
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    browser = Browser()
    try:
        browser.open(url)
        for section in sections or SECTIONS:
            box = browser.evaluate(
                f"(() => {{ const e = document.getElementById({json.dumps(section)});"
                " if (!e) return null; const r = e.getBoundingClientRect();"
                " return [r.left + scrollX, r.top + scrollY, r.width, r.height]; })()")
            if box is None:
                print(f"report_browser: no section {section}", file=sys.stderr)
                return 1
            x, y, w, h = box
            clip = {"x": max(x - 8, 0), "y": max(y - 8, 0), "width": w + 16,
                    "height": min(h + 16, MAX_SHOT_HEIGHT), "scale": 1}
            shot = browser.call("Page.captureScreenshot",
                                {"format": "png", "clip": clip, "captureBeyondViewport": True})
            path = out / f"{section}.png"
            path.write_bytes(base64.b64decode(shot["data"]))
            print(path)
    finally:
        browser.close()
    return 0


def main(argv):
    if len(argv) >= 2 and argv[0] == "check":
        return check(argv[1])
    if len(argv) >= 3 and argv[0] == "screenshots":
        return screenshots(argv[1], argv[2], argv[3:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
