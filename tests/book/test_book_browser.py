"""The built book, as a reader's browser shows it.

Opens the pages of ``_build/html`` in headless Chromium, served by a local ``http.server`` on
127.0.0.1, and checks on each page of :data:`PAGES` that

* every ``<img>`` loaded (``naturalWidth > 0``);
* the math was typeset by the local MathJax copy: every Sphinx math element holds an
  ``mjx-container``, no TeX error was rendered, no raw ``$$`` is left in the text, and no
  display formula is wider than the text column (in a 1280 px wide window);
* no request failed or went to another host than the local server (the book must read
  offline); nothing reaches the internet anyway, because every host name but 127.0.0.1 is
  mapped to "not found";
* no uncaught JavaScript exception was thrown.

A full-page screenshot of each page is saved to ``_build/screenshots/``.

Chromium is driven through the Chrome DevTools Protocol over ``--remote-debugging-pipe``, with
the standard library only: no WebDriver, no PyPI package. Set-up (Debian):
``apt-get install -y chromium``; build the book first (``make book``). Without Chromium or
without ``_build/html`` the tests are skipped with a message saying which is missing.
Environment: ``SMP_CHROMIUM`` (path to the browser), ``SMP_BOOK_HTML`` (the built site).
"""

from __future__ import annotations

import base64
import functools
import http.server
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[2]
HTML_ROOT = Path(os.environ.get("SMP_BOOK_HTML", ROOT / "_build" / "html"))
SCREENSHOTS = ROOT / "_build" / "screenshots"

# Pages to check, relative to _build/html. Chapters rendered from executed notebooks are added
# here when they join _toc.yml; a listed page that was not built is skipped, except REQUIRED.
PAGES = (
    "book/intro.html",
    "book/method.html",
    "book/how_to_run.html",
    "book/bibliography.html",
    "book/generated/toy.html",
    "book/generated/mnist.html",
    "book/generated/mnist_growth.html",
    "book/generated/mnist_seeds.html",
    "book/generated/summary.html",
    "book/generated/toy_baselines.html",
    "book/generated/mnist_baselines.html",
    "book/generated/toy_kfac.html",
    "book/generated/toy_tail.html",
    "book/generated/mnist_tail.html",
    "book/generated/mnist_kfac.html",
    "book/generated/regression.html",
    "book/generated/usage.html",
    "book/api.html",
)
REQUIRED = {"book/intro.html", "book/method.html", "book/generated/toy.html", "book/generated/mnist.html",
            "book/api.html"}
# Pages that must contain typeset math (the others are checked only if they have math).
MATH_PAGES = {"book/intro.html", "book/method.html", "book/generated/toy.html", "book/generated/mnist.html",
              "book/generated/mnist_growth.html", "book/generated/toy_kfac.html", "book/generated/mnist_kfac.html",
              "book/generated/toy_baselines.html", "book/generated/toy_tail.html", "book/generated/mnist_tail.html",
              "book/generated/mnist_baselines.html", "book/generated/mnist_seeds.html",
              "book/generated/regression.html"}

CHROMIUM_CANDIDATES = ("/usr/lib/chromium/chromium", "chromium", "chromium-browser", "google-chrome")
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-default-apps",
    "--disable-dev-shm-usage",
    "--disable-features=Translate,OptimizationHints,MediaRouter,InterestFeedContentSuggestions",
    "--no-proxy-server",
    # Every host but the local server resolves to nothing: a remote asset fails fast, and is
    # still seen (and reported) by Network.requestWillBeSent.
    "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
    "--hide-scrollbars",
    "--mute-audio",
    "--window-size=1280,900",
    "--remote-debugging-pipe",
)
TIMEOUT = 60.0  # seconds for one page: load, MathJax, fonts
LAUNCHER = """
import fcntl, os, sys
# Park both pipe ends above fd 9 first, so that neither can be overwritten by the other's dup2.
high = [fcntl.fcntl(int(fd), fcntl.F_DUPFD, 10) for fd in sys.argv[1:3]]
for fd in sys.argv[1:3]:
    os.close(int(fd))
os.dup2(high[0], 3)
os.dup2(high[1], 4)
for fd in high:
    os.close(fd)
os.execv(sys.argv[3], sys.argv[3:])
"""


def find_chromium() -> str | None:
    explicit = os.environ.get("SMP_CHROMIUM")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    for name in CHROMIUM_CANDIDATES:
        path = name if os.path.isabs(name) and os.access(name, os.X_OK) else shutil.which(name)
        if path:
            return path
    return None


# ---------------------------------------------------------------------------------------------
# A minimal DevTools-protocol client over the pipe (fd 3: commands in, fd 4: replies out)
# ---------------------------------------------------------------------------------------------


class CDPError(RuntimeError):
    pass


class Browser:
    """Headless Chromium speaking CDP over ``--remote-debugging-pipe``."""

    def __init__(self, executable: str):
        self.profile = tempfile.mkdtemp(prefix="smp-chromium-")
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        # The browser reads commands from fd 3 and writes replies to fd 4. A tiny Python launcher
        # moves the pipe ends there and execs the browser (no preexec_fn: the tests run threads).
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", LAUNCHER, str(to_chrome_r), str(from_chrome_w),
             executable, *CHROMIUM_FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self.stderr,
            pass_fds=(to_chrome_r, from_chrome_w),
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._next_id = 0
        self._lock = threading.Lock()
        self._replies: dict[int, queue.Queue] = {}
        self.events: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read_loop, daemon=True)
        self._reader.start()
        self.session = None
        self.target = None

    def _read_loop(self) -> None:
        buffer = b""
        while True:
            try:
                chunk = os.read(self._from_chrome, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                self.events.put(None)
                for q in list(self._replies.values()):
                    q.put({"error": {"message": "browser closed the pipe"}})
                return
            buffer += chunk
            while b"\0" in buffer:
                raw, buffer = buffer.split(b"\0", 1)
                message = json.loads(raw)
                if "id" in message and message["id"] in self._replies:
                    self._replies[message["id"]].put(message)
                elif "method" in message:
                    self.events.put(message)

    def send(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = TIMEOUT) -> dict:
        with self._lock:
            self._next_id += 1
            ident = self._next_id
            self._replies[ident] = queue.Queue()
        message = {"id": ident, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
        try:
            reply = self._replies[ident].get(timeout=timeout)
        except queue.Empty:
            raise CDPError(f"no reply to {method} within {timeout} s") from None
        finally:
            self._replies.pop(ident, None)
        if "error" in reply:
            raise CDPError(f"{method}: {reply['error'].get('message')}")
        return reply.get("result", {})

    def open_page(self) -> str:
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.target = target
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Network", "Runtime"):
            self.send(f"{domain}.enable", session=self.session)
        # Reload from the server every time, never from a cache of an earlier page.
        self.send("Network.setCacheDisabled", {"cacheDisabled": True}, session=self.session)
        return self.session

    def close_page(self) -> None:
        if self.session is not None:
            self.send("Target.closeTarget", {"targetId": self.target})
            self.session = None

    def call(self, method: str, params: dict | None = None, timeout: float = TIMEOUT) -> dict:
        return self.send(method, params, session=self.session, timeout=timeout)

    def evaluate(self, expression: str, timeout: float = TIMEOUT):
        result = self.call(
            "Runtime.evaluate",
            {"expression": expression, "awaitPromise": True, "returnByValue": True},
            timeout=timeout,
        )
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise CDPError(f"JavaScript error: {text}")
        return result["result"].get("value")

    def drain_events(self) -> list[dict]:
        out = []
        while True:
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                return out
            if event is not None:
                out.append(event)

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=5)
        except (CDPError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        for fd in (self._to_chrome, self._from_chrome):
            try:
                os.close(fd)
            except OSError:
                pass
        self.stderr.close()
        shutil.rmtree(self.profile, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# A local web server for _build/html that remembers what it was asked for
# ---------------------------------------------------------------------------------------------


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    log: list[tuple[str, int]]

    def log_request(self, code="-", size="-"):
        self.log.append((self.path, int(code) if str(code).isdigit() else 0))

    def log_message(self, format, *args):
        pass


@pytest.fixture(scope="module")
def html_root() -> Path:
    if not (HTML_ROOT / "index.html").is_file():
        pytest.skip(f"no built book at {HTML_ROOT}: run `make book` (or jupyter-book build .) first")
    return HTML_ROOT


@pytest.fixture(scope="module")
def server(html_root):
    log: list[tuple[str, int]] = []
    handler = functools.partial(type("Handler", (_QuietHandler,), {"log": log}), directory=str(html_root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", log
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def browser():
    executable = find_chromium()
    if executable is None:
        pytest.skip("Chromium is not installed (Debian: `apt-get install -y chromium`; or set SMP_CHROMIUM)")
    b = Browser(executable)
    try:
        b.send("Browser.getVersion", timeout=30)
    except (CDPError, OSError) as err:
        b.stderr.seek(0)
        tail = b.stderr.read().decode(errors="replace")[-2000:]
        b.close()
        pytest.fail(f"Chromium did not start ({executable}): {err}\n{tail}")
    yield b
    b.close()


# ---------------------------------------------------------------------------------------------
# What the page is asked once it has loaded
# ---------------------------------------------------------------------------------------------

WAIT_FOR_PAGE_JS = """
(async () => {
  if (document.readyState !== 'complete') {
    await new Promise(r => window.addEventListener('load', r, {once: true}));
  }
  // Images: load lazy ones too, and wait for every one to finish or fail.
  const images = Array.from(document.images);
  images.forEach(img => { if (img.loading === 'lazy') img.loading = 'eager'; });
  await Promise.all(images.map(img => img.complete ? null :
      new Promise(r => { img.addEventListener('load', r); img.addEventListener('error', r); })));
  // MathJax: the deferred script sets window.MathJax.startup once it has loaded.
  const t0 = Date.now();
  const mathOnPage = document.querySelector('.math') !== null;
  if (mathOnPage) {
    while (!(window.MathJax && MathJax.startup && MathJax.startup.promise) && Date.now() - t0 < 30000) {
      await new Promise(r => setTimeout(r, 50));
    }
    if (window.MathJax && MathJax.startup && MathJax.startup.promise) await MathJax.startup.promise;
  }
  await document.fonts.ready;
  return true;
})()
"""

INSPECT_PAGE_JS = """
(() => {
  const images = Array.from(document.images).map(img => ({
      src: img.currentSrc || img.src, ok: img.complete && img.naturalWidth > 0}));
  const maths = Array.from(document.querySelectorAll('.math'));
  const untypeset = maths.filter(el => !el.querySelector('mjx-container'))
      .map(el => el.textContent.trim().slice(0, 80));
  const errors = Array.from(document.querySelectorAll('mjx-merror, [data-mjx-error]'))
      .map(el => el.getAttribute('data-mjx-error') || el.textContent.slice(0, 80));
  // Display formulas wider than the text column are cut off (the theme scrolls them).
  const overflowing = Array.from(document.querySelectorAll('mjx-container[display="true"]'))
      .filter(el => el.scrollWidth > el.clientWidth + 2)
      .map(el => (el.closest('.math') || el).textContent.trim().slice(0, 60));
  // Text outside code blocks and outside typeset math: no TeX delimiters may survive there.
  const clone = document.body.cloneNode(true);
  clone.querySelectorAll('pre, code, script, style, mjx-container, mjx-assistive-mml')
      .forEach(el => el.remove());
  const text = clone.textContent;
  const raw = [];
  for (const delim of ['$$', '\\\\begin{', '\\\\frac', '\\\\theta']) {
    const i = text.indexOf(delim);
    if (i >= 0) raw.push(text.slice(Math.max(0, i - 40), i + 40));
  }
  return {
    title: document.title,
    images: images,
    mathElements: maths.length,
    mjxContainers: document.querySelectorAll('mjx-container').length,
    untypeset: untypeset,
    overflowing: overflowing,
    texErrors: errors,
    rawTex: raw,
    mathjaxVersion: window.MathJax && MathJax.version || null,
    height: Math.ceil(Math.max(document.documentElement.scrollHeight, document.body.scrollHeight)),
  };
})()
"""


def is_local(url: str, origin: str) -> bool:
    scheme = urlsplit(url).scheme
    if scheme in ("data", "blob", "about", "chrome", "devtools"):
        return True
    return url.startswith(origin + "/")


def screenshot(b: Browser, page: str, height: int) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    height = max(900, min(height, 12000))
    b.call("Emulation.setDeviceMetricsOverride",
           {"width": 1280, "height": height, "deviceScaleFactor": 1, "mobile": False})
    time.sleep(0.3)  # let the layout settle at the new size
    data = b.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": False})["data"]
    b.call("Emulation.clearDeviceMetricsOverride")
    out = SCREENSHOTS / (page.replace("/", "__").removesuffix(".html") + ".png")
    out.write_bytes(base64.b64decode(data))
    return out


def visit(b: Browser, origin: str, page: str) -> tuple[dict, list[str]]:
    """Load ``page``, wait until it is idle, and return what it shows plus the problems seen."""
    b.open_page()
    b.drain_events()
    problems: list[str] = []
    navigation = b.call("Page.navigate", {"url": f"{origin}/{page}"})
    if navigation.get("errorText"):
        problems.append(f"navigation failed: {navigation['errorText']}")
    b.evaluate(WAIT_FOR_PAGE_JS)
    # Web fonts and autoloaded MathJax extensions arrive after typesetting: wait until no
    # request has been pending for half a second.
    requests: dict[str, str] = {}
    finished: set[str] = set()
    deadline = time.monotonic() + TIMEOUT
    quiet_since = time.monotonic()
    while time.monotonic() < deadline:
        try:
            event = b.events.get(timeout=0.1)
        except queue.Empty:
            event = None
        if event is not None and event.get("sessionId") == b.session:
            quiet_since = time.monotonic()
            method, params = event.get("method"), event.get("params", {})
            if method == "Network.requestWillBeSent":
                url = params["request"]["url"]
                requests[params["requestId"]] = url
                if not is_local(url, origin):
                    problems.append(f"request to another host: {url}")
            elif method == "Network.responseReceived":
                status = params["response"].get("status", 0)
                if status >= 400 and not params["response"].get("url", "").endswith("/favicon.ico"):
                    problems.append(f"HTTP {status}: {params['response'].get('url')}")
            elif method in ("Network.loadingFinished", "Network.loadingFailed"):
                finished.add(params["requestId"])
                if method == "Network.loadingFailed" and not params.get("canceled"):
                    url = requests.get(params["requestId"], "?")
                    problems.append(f"failed request ({params.get('errorText')}): {url}")
            elif method == "Runtime.exceptionThrown":
                details = params.get("exceptionDetails", {})
                text = details.get("exception", {}).get("description") or details.get("text")
                problems.append(f"uncaught JavaScript exception: {text}")
        pending = set(requests) - finished
        if not pending and time.monotonic() - quiet_since > 0.5:
            break
    else:
        problems.append(f"page still loading after {TIMEOUT} s: {sorted(set(requests.values()))[:5]}")
    state = b.evaluate(INSPECT_PAGE_JS)
    state["requests"] = sorted(set(requests.values()))
    state["screenshot"] = str(screenshot(b, page, state["height"]))
    b.close_page()
    return state, problems


@pytest.mark.parametrize("page", PAGES)
def test_page_renders_offline(page, html_root, server, browser):
    origin, log = server
    if not (html_root / page).is_file():
        if page in REQUIRED:
            pytest.fail(f"{page} is missing from {html_root}: the book was built without it")
        pytest.skip(f"{page} was not built (its notebook has not been executed yet)")

    first = len(log)
    state, problems = visit(browser, origin, page)

    broken = [img["src"] for img in state["images"] if not img["ok"]]
    assert not broken, f"{page}: images that did not load: {broken}"
    if page in MATH_PAGES:
        assert state["mathElements"] > 0, f"{page}: no math on a page that must have some"
    if state["mathElements"]:
        assert state["mathjaxVersion"], f"{page}: MathJax did not load"
        assert state["mjxContainers"] >= state["mathElements"], (
            f"{page}: {state['mjxContainers']} typeset formulas for {state['mathElements']} math elements")
    assert not state["untypeset"], f"{page}: math left untypeset: {state['untypeset'][:5]}"
    assert not state["texErrors"], f"{page}: TeX errors: {state['texErrors'][:5]}"
    assert not state["rawTex"], f"{page}: raw TeX left in the text: {state['rawTex']}"
    assert not state["overflowing"], (
        f"{page}: display formulas wider than the page at 1280 px: {state['overflowing']}")
    # /favicon.ico is the browser's own probe (not a request of the page), answered 404 here.
    server_errors = [f"{path} -> {code}" for path, code in log[first:] if code >= 400 and path != "/favicon.ico"]
    assert not server_errors, f"{page}: the local server answered with errors: {server_errors}"
    assert not problems, f"{page}: " + "; ".join(problems)
    assert Path(state["screenshot"]).stat().st_size > 0


@pytest.mark.parametrize("page", PAGES)
def test_no_markdown_left_unrendered(page, html_root):
    # a notebook's Markdown output (the claim tables) printed as text instead of a table
    path = html_root / page
    if not path.is_file():
        pytest.skip(f"{page} was not built")
    text = re.sub(r"<[^>]+>", " ", path.read_text(encoding="utf-8"))
    leftovers = re.findall(r"\|\s*:?[-\u2013\u2014]{3,}", text)
    assert not leftovers, f"{page}: a Markdown table was printed as text: {leftovers[:3]}"
