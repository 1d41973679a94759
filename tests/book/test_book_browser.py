"""The built book as a reader sees it: headless Chromium, driven by Selenium, opens ``_build/html``
offline (file:// URLs, every other host unresolvable) and checks the front page and one page of each
part of ``_toc.yml`` once MathJax has run: the page shows its title; the math was typeset by the
local MathJax (no raw TeX, no TeX error, no display formula wider than the column at 1280 px); every
image loaded; nothing was fetched from another host, no load failed and no JavaScript error was
logged; and none of what a reader should never see is on it (see ``FORBIDDEN``). A full-page
screenshot of each page goes to ``_build/screenshots/``.

Set-up (Debian): ``apt-get install -y chromium chromium-driver`` (``make browser-deps``) and
``pip install -e ".[dev]"`` (selenium); build the book first (``make book``). Without any of them
the tests are skipped with a message. Environment: ``SMP_CHROMIUM`` (the browser),
``SMP_CHROMEDRIVER`` (its driver), ``SMP_BOOK_HTML`` (the built site).
"""

from __future__ import annotations

import base64
import os
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HTML = Path(os.environ.get("SMP_BOOK_HTML", ROOT / "_build" / "html"))
SCREENSHOTS = ROOT / "_build" / "screenshots"
# The front page and one page of each part of _toc.yml, with words that its title must contain.
PAGES = {
    "index.html": "Score-Based Martingale Posteriors",  # redirects to book/intro.html
    "book/method.html": "Method",  # The method
    "book/generated/toy.html": "Toy example",  # Reproducing the paper
    "book/generated/regression.html": "regression",  # Beyond the paper
    "book/generated/usage.html": "Using SMP",  # Using it
}
# What a reader must never see in a page's visible text (code cells and outputs included).
FORBIDDEN = {
    "a Python traceback": r"Traceback \(most recent call last\)",
    "a progress bar": r"\d%\||\b(it/s|s/it)\]",
    "papermill's parameters cell": r"^# Parameters$|^scale = (\"[^\"\n]*\"|'[^'\n]*')$",
    "a Markdown table printed as text": r"\|\s*:?[-\u2013\u2014]{3,}",
}
TIMEOUT = 60  # seconds for one page: load, MathJax, fonts


def executable(env: str, *names: str) -> str | None:
    if os.environ.get(env):
        return os.environ[env] if os.access(os.environ[env], os.X_OK) else None
    return next(filter(None, map(shutil.which, names)), None)


# Resolves once the page, its images (lazy ones too), MathJax and the fonts are done; returns what it shows.
INSPECT_JS = """return (async () => {
if (document.readyState !== 'complete') await new Promise(r => addEventListener('load', r, {once: true}));
const imgs = [...document.images];
imgs.forEach(img => { img.loading = 'eager'; });
await Promise.all(imgs.map(img => img.complete ? 0 : new Promise(r => { img.onload = img.onerror = r; })));
const maths = [...document.querySelectorAll('.math')];
for (let t = 0; maths.length && !window.MathJax?.startup?.promise && t < 300; t++) {
  await new Promise(r => setTimeout(r, 100));
}
if (maths.length) await window.MathJax?.startup?.promise;
await document.fonts.ready;
const clone = document.body.cloneNode(true);  // the prose: no code, no typeset math
clone.querySelectorAll('pre, code, script, style, mjx-container').forEach(el => el.remove());
const mjx = [...document.querySelectorAll('mjx-container')];
return {
  title: document.title,
  h1: document.querySelector('h1')?.innerText.replace(/#$/, '').trim() ?? '',
  text: document.body.innerText,
  prose: clone.textContent,
  cells: [...document.querySelectorAll('td, th')].map(el => el.innerText.trim()),
  brokenImages: imgs.filter(img => !img.naturalWidth).map(img => img.src),
  maths: maths.length,
  untypeset: maths.filter(el => !el.querySelector('mjx-container')).map(el => el.textContent.slice(0, 80)),
  texErrors: [...document.querySelectorAll('mjx-merror')].map(el => el.textContent.slice(0, 80)),
  tooWide: mjx.filter(el => el.getAttribute('display') === 'true' && el.scrollWidth > el.clientWidth + 2)
      .map(el => el.textContent.slice(0, 60)),
  mathjax: window.MathJax?.version ?? null,
  fetched: performance.getEntriesByType('resource').map(e => e.name),
};
})();
"""


@pytest.fixture(scope="module")
def driver():
    if not (HTML / "index.html").is_file():
        pytest.skip(f"no built book at {HTML}: run `make book` (or jupyter-book build .) first")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed: pip install -e '.[dev]'")
    browser = executable("SMP_CHROMIUM", "chromium", "chromium-browser", "google-chrome")
    chromedriver = executable("SMP_CHROMEDRIVER", "chromedriver")
    for name, path in (("chromium", browser), ("chromedriver", chromedriver)):
        if path is None:
            pytest.skip(f"{name} is not installed (Debian: apt-get install -y chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900",
                 "--hide-scrollbars", "--host-resolver-rules=MAP * ~NOTFOUND"):  # no host but file:// answers
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    try:
        d = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=chromedriver))
    except Exception as err:  # installed, but would not start: that is a failure, not a skip
        pytest.fail(f"Chromium did not start ({browser}, {chromedriver}): {err}")
    d.set_script_timeout(TIMEOUT)
    yield d
    d.quit()


@pytest.mark.parametrize("page", PAGES)
def test_page_as_a_reader_sees_it(page, driver):
    if not (HTML / page).is_file():
        pytest.fail(f"{page} is missing from {HTML}: the book was built without it")
    driver.get_log("browser")  # drop what earlier pages logged
    driver.get((HTML / page).as_uri())
    if page == "index.html":  # wait for the redirect to the first chapter
        driver.implicitly_wait(10)
        driver.find_element("css selector", "h1")
        driver.implicitly_wait(0)
    seen = driver.execute_script(INSPECT_JS)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    shot = driver.execute_cdp_cmd("Page.captureScreenshot", {"captureBeyondViewport": True, "format": "png"})
    (SCREENSHOTS / (page.replace("/", "__").removesuffix(".html") + ".png")).write_bytes(base64.b64decode(shot["data"]))

    assert seen["h1"] and PAGES[page] in seen["h1"] and seen["title"].startswith(seen["h1"]), (
        f"{page}: title {seen['title']!r}, heading {seen['h1']!r}; expected {PAGES[page]!r} in both")
    assert not seen["brokenImages"], f"{page}: images that did not load: {seen['brokenImages']}"
    assert seen["maths"] and seen["mathjax"], f"{page}: no math, or MathJax did not load (every page has math)"
    assert not seen["untypeset"], f"{page}: math left untypeset: {seen['untypeset'][:5]}"
    assert not seen["texErrors"], f"{page}: TeX errors: {seen['texErrors'][:5]}"
    raw = [d for d in ("$$", "\\(", "\\[", "\\begin{", "\\frac", "\\theta") if d in seen["prose"]]
    assert not raw, f"{page}: raw TeX left in the text: {raw}"
    assert not seen["tooWide"], f"{page}: display formulas wider than the column at 1280 px: {seen['tooWide']}"
    remote = [url for url in seen["fetched"] if not url.startswith(("file:", "data:", "blob:"))]
    assert not remote, f"{page}: fetched from another host (the book must read offline): {remote}"
    # failed loads ("network") and uncaught exceptions ("javascript"), not the theme's console.error chatter
    errors = [e["message"] for e in driver.get_log("browser") if e["source"] in ("network", "javascript")]
    assert not errors, f"{page}: failed loads or JavaScript errors: {errors}"
    for what, pattern in FORBIDDEN.items():
        found = [m.group(0) for m in re.finditer(pattern, seen["text"], re.MULTILINE)]
        assert not found, f"{page}: {what} is shown: {found[:3]}"
    nans = [cell for cell in seen["cells"] if cell.lower() == "nan"]
    assert not nans, f"{page}: {len(nans)} table cells show 'nan'"
