"""The built book as a reader sees it: headless Chromium, driven by Selenium, opens ``_build/html``
offline (file:// URLs, every other host unresolvable) and checks the front page and every page of
``_toc.yml`` once MathJax has run: the page shows its title; the math was typeset by the local
MathJax (no raw TeX, no TeX error, no display formula wider than the column at 1280 px); every image
loaded; nothing was fetched from another host, no load failed and no JavaScript error was logged; no
cell shows an error (a traceback) or stderr, and no parameters cell is shown; none of what a reader
should never see is on it (see ``FORBIDDEN``); and every table fits its column at 1280 px. Without a
browser, it also checks that the built pages are exactly
those of the table of contents. A full-page screenshot of each page goes to ``_build/screenshots/``.

Set-up (Debian): ``apt-get install -y chromium chromium-driver`` (``make browser-deps``) and
``pip install -e "./smp_book[dev]"`` (selenium); build the book first (``make book``, i.e. ``jupyter-book build
book``). Without any of them the tests are skipped with a message. Environment: ``SMP_CHROMIUM`` (the
browser), ``SMP_CHROMEDRIVER`` (its driver), ``SMP_BOOK_HTML`` (the built site).
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
TOC = ROOT / "_toc.yml"  # its paths are relative to book/, the book's source folder, as the built pages are to HTML
# Pages built by Sphinx itself rather than from a source of the table of contents.
GENERATED = {"index.html", "genindex.html", "search.html", "py-modindex.html"}
# Words that a page's title must contain (the front page and one page of each part of _toc.yml); every other
# page must have a title and a heading that agree.
TITLES = {
    "index.html": "Score-Based Martingale Posteriors",  # redirects to intro.html
    "method.html": "Method",  # The method
    "notebooks/toy.html": "Toy example",  # Reproducing the paper
    "notebooks/regression.html": "regression",  # Beyond the paper
    "notebooks/usage.html": "Using SMP",  # Using it
}


def toc_files() -> list[str]:
    """The sources that _toc.yml names (root first), in the book's order, as paths relative to book/."""
    yaml = pytest.importorskip("yaml", reason="PyYAML (a dependency of jupyter-book) is not installed")
    toc = yaml.safe_load(TOC.read_text())
    files = [toc["root"]]

    def walk(entries):
        for entry in entries or []:
            if "file" in entry:
                files.append(entry["file"])
            for key in ("parts", "chapters", "sections"):
                walk(entry.get(key))

    walk(toc.get("parts"))
    walk(toc.get("chapters"))
    return [str(Path(f).with_suffix("")) for f in files]


PAGES = ["index.html"] + [f"{f}.html" for f in toc_files()]
# What a reader must never see in a page's visible text (code cells and outputs included).
FORBIDDEN = {
    "a Python traceback": r"Traceback \(most recent call last\)",
    "a progress bar": r"\d%\||\b(it/s|s/it)\]",
    "a parameters cell": r"^# Parameters$|^scale = (\"[^\"\n]*\"|'[^'\n]*')$",
    "a Markdown table printed as text": r"\|\s*:?[-\u2013\u2014]{3,}",
}
# The saved benchmark outputs that chapters show (how_to_run, mnist): when they are in the checkout, a chapter that
# says "Not measured in this checkout" read them from the wrong folder (a notebook runs in notebooks/, not the root).
BENCHMARK_OUTPUTS = [ROOT / "benchmarks" / name
                     for name in ("gpu_h200/runs.csv", "scaling/scaling.csv", "fresh_clone.md")]
if all(path.is_file() for path in BENCHMARK_OUTPUTS):
    FORBIDDEN["a saved benchmark output reported missing"] = r"Not measured in this checkout"
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
  // myst-nb gives a cell's error output the classes "output traceback", its stderr "output stderr"
  errorOutputs: [...document.querySelectorAll('.output.traceback, .output.stderr')]
      .map(el => `${el.className}: ${el.innerText.trim().slice(-160)}`),
  parameterCells: [...document.querySelectorAll('.tag_parameters, .tag_injected-parameters')]
      .map(el => el.innerText.trim().slice(0, 80)),
  // every table against the width of the page's article (the column between the sidebars)
  tables: [...document.querySelectorAll('table')].map(table => {
    const column = table.closest('article.bd-article') ?? document.querySelector('article.bd-article')
        ?? table.closest('main') ?? document.querySelector('main');
    const caption = table.querySelector('caption')?.innerText.trim();
    const head = [...table.querySelectorAll('tr:first-child > th, tr:first-child > td')].slice(0, 5)
        .map(el => el.innerText.trim());
    const section = table.closest('section')?.querySelector('h1, h2, h3, h4')?.innerText.replace(/#$/, '').trim();
    const what = caption ? `caption "${caption}"` : `header: ${head.join(' | ')}`;
    return {width: table.scrollWidth, column: column?.clientWidth ?? null,
            label: section ? `section "${section}", ${what}` : what};
  }),
};
})();
"""


def test_built_pages_are_the_table_of_contents():
    """Every source of _toc.yml has its page, and no other page was built (no chapter left out of the table of
    contents, no leftover of an earlier build or layout: make book empties _build/html first)."""
    if not (HTML / "index.html").is_file():
        pytest.skip(f"no built book at {HTML}: run `make book` (jupyter-book build book) first")
    expected = {f"{f}.html" for f in toc_files()}
    built = {page.relative_to(HTML).as_posix() for page in HTML.rglob("*.html")
             if not page.relative_to(HTML).parts[0].startswith("_")} - GENERATED
    assert not expected - built, f"pages of _toc.yml missing from {HTML}: {sorted(expected - built)}"
    assert not built - expected, f"pages in {HTML} that _toc.yml does not name: {sorted(built - expected)}"


@pytest.fixture(scope="module")
def driver():
    if not (HTML / "index.html").is_file():
        pytest.skip(f"no built book at {HTML}: run `make book` (jupyter-book build book) first")
    webdriver = pytest.importorskip("selenium.webdriver",
                                    reason="selenium is not installed: pip install -e './smp_book[dev]'")
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


_SEEN: dict[str, dict] = {}  # page -> what INSPECT_JS returned, and the errors the browser logged: each page loads once


def seen_on(page: str, driver) -> dict:
    """Opens the page (once per session), waits for it to settle, saves a screenshot; returns what it shows."""
    if page in _SEEN:
        return _SEEN[page]
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
    # failed loads ("network") and uncaught exceptions ("javascript"), not the theme's console.error chatter
    seen["logged"] = [e["message"] for e in driver.get_log("browser") if e["source"] in ("network", "javascript")]
    _SEEN[page] = seen
    return seen


@pytest.mark.parametrize("page", PAGES)
def test_page_as_a_reader_sees_it(page, driver):
    seen = seen_on(page, driver)
    words = TITLES.get(page, "")
    assert seen["h1"] and words in seen["h1"] and seen["title"].startswith(seen["h1"]), (
        f"{page}: title {seen['title']!r}, heading {seen['h1']!r}; expected a heading that starts the title"
        + (f" and holds {words!r}" if words else ""))
    assert not seen["errorOutputs"], f"{page}: cells show an error or stderr: {seen['errorOutputs'][:3]}"
    assert not seen["parameterCells"], f"{page}: a parameters cell is shown: {seen['parameterCells'][:3]}"
    assert not seen["brokenImages"], f"{page}: images that did not load: {seen['brokenImages']}"
    if page in TITLES:  # these pages have math: MathJax must have run on them
        assert seen["maths"], f"{page}: no math on the page"
    assert not seen["maths"] or seen["mathjax"], f"{page}: MathJax did not load"
    assert not seen["untypeset"], f"{page}: math left untypeset: {seen['untypeset'][:5]}"
    assert not seen["texErrors"], f"{page}: TeX errors: {seen['texErrors'][:5]}"
    raw = [d for d in ("$$", "\\(", "\\[", "\\begin{", "\\frac", "\\theta") if d in seen["prose"]]
    assert not raw, f"{page}: raw TeX left in the text: {raw}"
    assert not seen["tooWide"], f"{page}: display formulas wider than the column at 1280 px: {seen['tooWide']}"
    remote = [url for url in seen["fetched"] if not url.startswith(("file:", "data:", "blob:"))]
    assert not remote, f"{page}: fetched from another host (the book must read offline): {remote}"
    assert not seen["logged"], f"{page}: failed loads or JavaScript errors: {seen['logged']}"
    for what, pattern in FORBIDDEN.items():
        found = [m.group(0) for m in re.finditer(pattern, seen["text"], re.MULTILINE)]
        assert not found, f"{page}: {what} is shown: {found[:3]}"
    nans = [cell for cell in seen["cells"] if cell.lower() == "nan"]
    assert not nans, f"{page}: {len(nans)} table cells show 'nan'"


def test_tables_fit_the_column(driver):
    """Every table on every page is at most as wide as its page's article (the column) at 1280 px, the theme's
    font size, no zoom: a reader sees each table whole, without scrolling it sideways."""
    too_wide = []
    for page in [p for p in PAGES if p not in GENERATED]:  # index.html redirects to the root page
        for table in seen_on(page, driver)["tables"]:
            if table["column"] is not None and table["width"] > table["column"]:
                too_wide.append(f"{page}: {table['width']} px in a {table['column']} px column: {table['label'][:160]}")
    assert not too_wide, f"{len(too_wide)} tables wider than the column at 1280 px:\n" + "\n".join(too_wide)
