# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # browser
#
# > Looking at a page the way a reader does: headless Chromium over its DevTools protocol, the page's DOM after its scripts ran and a screenshot, for the docs-site checks.

# %%
#| default_exp browser

# %%
#| export
from __future__ import annotations
import base64, contextlib, json, os, re, shutil, signal, subprocess, tempfile, time
from pathlib import Path
from capbook.core import CapbookError, Deferred, atomic_write

nbformat = Deferred("nbformat")   # brings jsonschema, whose format checker compiles its grammars as it is imported (a second)

# %% [markdown]
# ## Looking at a page the way a reader does
#
# The site's tests open its pages in Debian's headless Chromium (`apt-get install chromium`, or `make browser`), so
# they see the DOM after MathJax and the theme's scripts ran, not just the HTML files. One browser, started with a
# fresh profile folder and no background networking, reads any number of pages: `Chromium` drives it over its
# DevTools pipe (the Chrome DevTools Protocol, JSON messages each ended by a NUL byte, written to the browser's file
# descriptor 3 and read from its 4), so no port is opened and nothing beyond the standard library is needed. Each
# page opens in a new tab; after its load event a short virtual time budget lets MathJax finish typesetting before
# the DOM is read. A browser that stops answering is killed with its whole process group.
#
# > **capbook:** the first version started Chromium once per page (`--dump-dom`): about 1.6 s of CPU a page, 60 s for
# > one check of the site. One browser for all of them costs about 0.2 s a page.

# %%
#| export
_CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                   "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars"]

_CHROMIUM = ("chromium", "/usr/bin/chromium")

def _chromium() -> str:
    "Path of the headless browser, or a one-line how-to."
    for name in _CHROMIUM:
        if exe := shutil.which(name): return exe
    raise CapbookError("chromium not found: install it with `apt-get install chromium` (or `make browser`)")

def _as_url(url_or_path: str | Path) -> str:
    "A URL unchanged; a local path as a `file://` URL (which must exist)."
    s = str(url_or_path)
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", s): return s
    p = Path(s).resolve()
    if not p.exists(): raise CapbookError(f"{p}: page not found")
    return p.as_uri()

def _devtools_fds(to_browser: int, from_browser: int):
    "In the browser's process before exec: our pipe ends as its file descriptors 3 (it reads) and 4 (it writes), inheritable."
    def move():
        a, b = os.dup2(to_browser, 100), os.dup2(from_browser, 101)   # out of the way first: either may already be 3 or 4
        os.dup2(a, 3); os.dup2(b, 4)
    return move

class Chromium:
    "One headless Chromium for many pages, driven over its DevTools pipe: `with Chromium() as c: c.dom(page)`, `c.screenshot(page, png)`."
    def __init__(self, timeout: float = 60, budget_ms: int = 5000):
        self.timeout, self.budget_ms, self.proc = timeout, budget_ms, None

    def __enter__(self) -> "Chromium":
        exe = _chromium()
        self._profile = tempfile.TemporaryDirectory(prefix="capbook-chromium-")
        self._err = tempfile.TemporaryFile()
        to_r, self._to = os.pipe()
        self._from, from_w = os.pipe()
        try:
            self.proc = subprocess.Popen([exe, *_CHROMIUM_FLAGS, f"--user-data-dir={self._profile.name}", "--remote-debugging-pipe",
                                          "about:blank"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._err,
                                         close_fds=False, preexec_fn=_devtools_fds(to_r, from_w), start_new_session=True)
        finally:
            os.close(to_r); os.close(from_w)
        self._buf, self._n, self._events = b"", 0, []
        return self

    def __exit__(self, *exc):
        try:
            if self.proc.poll() is None: self._send("Browser.close", timeout=5)
            self.proc.wait(timeout=5)
        except (CapbookError, subprocess.TimeoutExpired, OSError): pass
        finally:
            if self.proc.poll() is None: os.killpg(self.proc.pid, signal.SIGKILL); self.proc.wait()
            for fd in (self._to, self._from): os.close(fd)
            self._err.close(); self._profile.cleanup()

    def _fail(self, what: str):
        "Stop in one line: the browser gave no answer (killed with its process group) or ended (its last error line)."
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL); self.proc.wait()
            raise CapbookError(f"chromium gave no answer within {self.timeout} s for {what}")
        self._err.seek(0)
        last = [l for l in self._err.read().decode(errors="replace").splitlines() if l.strip()][-1:] or ["no message"]
        raise CapbookError(f"chromium failed (exit {self.proc.returncode}) on {what}: {last[0]}")

    def _message(self, deadline: float, what: str) -> dict:
        "The browser's next message (a reply or an event)."
        import select
        while b"\0" not in self._buf:
            if not select.select([self._from], [], [], max(0.0, deadline - time.time()))[0]: self._fail(what)
            chunk = os.read(self._from, 1 << 20)
            if not chunk: self._fail(what)
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def _send(self, method: str, params: dict | None = None, session: str | None = None, what: str = "", timeout: float | None = None) -> dict:
        "Call a DevTools method and return its result; events that arrive meanwhile are kept for `_event`."
        self._n += 1
        msg = {"id": self._n, "method": method, "params": params or {}, **({"sessionId": session} if session else {})}
        try: os.write(self._to, json.dumps(msg).encode() + b"\0")
        except BrokenPipeError: self._fail(what or method)
        deadline = time.time() + (timeout or self.timeout)
        while (reply := self._message(deadline, what or method)).get("id") != self._n: self._events.append(reply)
        if "error" in reply: raise CapbookError(f"chromium refused {method} for {what}: {reply['error'].get('message')}")
        return reply["result"]

    def _event(self, name: str, session: str, what: str) -> dict:
        deadline = time.time() + self.timeout
        while True:
            for i, e in enumerate(self._events):
                if e.get("method") == name and e.get("sessionId") == session: return self._events.pop(i)
            self._events.append(self._message(deadline, what))

    @contextlib.contextmanager
    def _page(self, url_or_path: str | Path, size: tuple[int, int] | None = None):
        "A new tab (of `size` (width, height) if given) with the page loaded and its scripts run; yields (session, url)."
        url = _as_url(url_or_path)
        target, s = self._send("Target.createTarget", {"url": "about:blank"}, what=url)["targetId"], None
        try:
            s = self._send("Target.attachToTarget", {"targetId": target, "flatten": True}, what=url)["sessionId"]
            self._send("Page.enable", session=s, what=url)
            if size: self._send("Emulation.setDeviceMetricsOverride", {"width": size[0], "height": size[1], "deviceScaleFactor": 1,
                                                                       "mobile": False}, session=s, what=url)
            if err := self._send("Page.navigate", {"url": url}, session=s, what=url).get("errorText"):
                raise CapbookError(f"chromium could not open {url}: {err}")
            self._event("Page.loadEventFired", s, url)
            # then `budget_ms` of virtual time (paused while a fetch is pending): MathJax and the theme's timers run
            self._send("Emulation.setVirtualTimePolicy", {"policy": "pauseIfNetworkFetchesPending", "budget": self.budget_ms},
                       session=s, what=url)
            self._event("Emulation.virtualTimeBudgetExpired", s, url)
            yield s, url
        finally:
            if self.proc.poll() is None:
                self._send("Target.closeTarget", {"targetId": target}, what=url)
                self._events = [e for e in self._events if e.get("sessionId") not in (None, s)]

    def evaluate(self, url_or_path: str | Path, expression: str, size: tuple[int, int] | None = None):
        "The value of a JavaScript `expression` (JSON-able) on a page (a URL or a local file) after its scripts ran, in a window of `size` (width, height) if given."
        with self._page(url_or_path, size) as (s, url):
            res = self._send("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=s, what=url)["result"]
        if "value" not in res: raise CapbookError(f"chromium could not evaluate on {url}: {res.get('description', res)}")
        return res["value"]

    def dom(self, url_or_path: str | Path) -> str:
        "The DOM of a page (a URL or a local file) after its scripts ran, as HTML."
        return self.evaluate(url_or_path, "document.documentElement.outerHTML")

    def screenshot(self, url_or_path: str | Path, png_path: str | Path, size: tuple[int, int] = (1280, 2000)) -> Path:
        "Save a `size` (width, height) PNG screenshot of a page (a URL or a local file) to `png_path`, atomically."
        png_path = Path(png_path).resolve(); png_path.parent.mkdir(parents=True, exist_ok=True)
        with self._page(url_or_path, size) as (s, url):
            data = self._send("Page.captureScreenshot", {"format": "png"}, session=s, what=url)["data"]
        return atomic_write(png_path, lambda t: t.write_bytes(base64.b64decode(data)))

def chromium_dom(url_or_path: str | Path, timeout: float = 60) -> str:
    "The DOM of a page (a URL or a local file) after its scripts ran, from headless Chromium (many pages: one `Chromium`)."
    with Chromium(timeout) as c: return c.dom(url_or_path)

def chromium_screenshot(url: str | Path, png_path: str | Path, size: tuple[int, int] = (1280, 2000), timeout: float = 60) -> Path:
    "Save a `size` (width, height) PNG screenshot of a page (a URL or a local file) to `png_path`."
    with Chromium(timeout) as c: return c.screenshot(url, png_path, size)

# %% [markdown]
# One browser, two pages: the DOM is read after the page's timers ran (a script appends a paragraph a second after
# load, in virtual time), and a screenshot has the size asked for. Without Chromium this example is skipped.

# %%
from PIL import Image as _PILImage
if shutil.which("chromium"):
    _dir = Path(tempfile.mkdtemp())
    (_dir / "late.html").write_text("<html><body><p>first</p><script>setTimeout(() => document.body.insertAdjacentHTML("
                                    "'beforeend', '<p>LATE_MARK</p>'), 1000)</script></body></html>")
    with Chromium() as _c:
        assert "LATE_MARK" in _c.dom(_dir / "late.html") and "first" in _c.dom(_dir / "late.html")
        assert _PILImage.open(_c.screenshot(_dir / "late.html", _dir / "shot.png", size=(320, 200))).size == (320, 200)
    shutil.rmtree(_dir)
