"""Sphinx extension (loaded through ``_config.yml``, ``sphinx.local_extensions``) that keeps the
built book readable offline.

* When the HTML build starts, it warns if ``mathjax_path`` points at another host, or if the
  local MathJax copy it names is missing (fetch it with ``python book/tools/fetch_mathjax.py``).
* When the HTML build ends, it warns about every page element that would load a script, a
  stylesheet, a font, an image or a frame from another host, and about ``url(http...)`` or
  ``@import`` of remote files in the shipped stylesheets.
* When a page is written, it drops duplicate inline scripts. Sphinx 7.4 lists an inline script
  that an extension adds after the builder started (sphinx-thebe's ``const THEBE_JS_URL = ...``)
  twice, once with the file name ``None`` and once with ``''``, and the second ``const`` is a
  JavaScript ``SyntaxError`` on every page.

Under ``jupyter-book build -W`` each warning fails the build. The browser test
(``tests/book/test_book_browser.py``) checks the same thing on the rendered pages.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

from sphinx.application import Sphinx
from sphinx.util import logging

logger = logging.getLogger(__name__)

REMOTE = re.compile(r"^\s*(?:[a-z][a-z0-9+.-]*:)?//", re.IGNORECASE)
CSS_REMOTE = re.compile(
    r"""(?:url\(\s*['"]?|@import\s+['"])\s*((?:https?:)?//[^'")\s]+)""", re.IGNORECASE
)
# (tag, attribute) pairs whose URL the browser fetches when the page loads.
FETCHED = {
    ("script", "src"),
    ("img", "src"),
    ("img", "srcset"),
    ("source", "src"),
    ("source", "srcset"),
    ("iframe", "src"),
    ("embed", "src"),
    ("object", "data"),
    ("video", "src"),
    ("video", "poster"),
    ("audio", "src"),
    ("track", "src"),
    ("input", "src"),
}
# <link rel=...> values that make the browser fetch the href.
FETCHED_LINK_RELS = {
    "stylesheet",
    "preload",
    "modulepreload",
    "prefetch",
    "icon",
    "shortcut",
    "apple-touch-icon",
    "manifest",
    "preconnect",
    "dns-prefetch",
}


def is_remote(url: str) -> bool:
    """True for ``http://``, ``https://`` and protocol-relative ``//host`` URLs."""
    url = url.strip()
    return bool(REMOTE.match(url)) and not url.lower().startswith(("data:", "file:"))


class _RemoteAssets(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.found: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {k: (v or "") for k, v in attrs}
        if tag == "link":
            rels = set(values.get("rel", "").lower().split())
            if rels & FETCHED_LINK_RELS and is_remote(values.get("href", "")):
                self.found.append(f"<link rel={values['rel']!r} href={values['href']!r}>")
            return
        if tag == "style" or "style" in values:
            for url in CSS_REMOTE.findall(values.get("style", "")):
                self.found.append(f"<{tag} style=url({url})>")
        for attr, value in values.items():
            if (tag, attr) not in FETCHED:
                continue
            urls = [part.split()[0] for part in value.split(",") if part.strip()]
            for url in urls if attr == "srcset" else [value]:
                if is_remote(url):
                    self.found.append(f"<{tag} {attr}={url!r}>")


def remote_assets_in_html(text: str) -> list[str]:
    """Elements of an HTML page that would fetch something from another host."""
    parser = _RemoteAssets()
    parser.feed(text)
    found = parser.found
    # Inline <style> blocks.
    for block in re.findall(r"<style[^>]*>(.*?)</style>", text, flags=re.S | re.I):
        found += [f"<style> url({u})" for u in CSS_REMOTE.findall(block)]
    return found


def remote_assets_in_css(text: str) -> list[str]:
    """Remote ``url(...)`` and ``@import`` targets in a stylesheet (comments ignored)."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return CSS_REMOTE.findall(text)


def check_mathjax(app: Sphinx) -> None:
    if app.builder.format != "html":
        return
    path = app.config.mathjax_path
    if is_remote(path):
        logger.warning(
            "mathjax_path %r loads MathJax from another host; the book must read offline "
            "(set mathjax_path to the local copy, mathjax/tex-chtml.js)",
            path,
        )
        return
    confdir = Path(app.confdir)
    candidates = [confdir / static / path for static in app.config.html_static_path]
    if not any(c.is_file() for c in candidates):
        where = candidates[0].relative_to(confdir) if candidates else path
        logger.warning(
            "the local MathJax copy %s is missing: run `python book/tools/fetch_mathjax.py` "
            "before building the book",
            where,
        )


def check_output(app: Sphinx, exception: Exception | None) -> None:
    if exception is not None or app.builder.format != "html":
        return
    outdir = Path(app.outdir)
    static = outdir / "_static"
    for page in sorted(outdir.rglob("*.html")):
        if static in page.parents:
            continue
        for item in remote_assets_in_html(page.read_text(encoding="utf-8", errors="replace")):
            logger.warning(
                "%s loads a remote asset: %s", page.relative_to(outdir), item
            )
    for sheet in sorted(static.rglob("*.css")) if static.is_dir() else []:
        for url in remote_assets_in_css(sheet.read_text(encoding="utf-8", errors="replace")):
            logger.warning("%s loads a remote asset: %s", sheet.relative_to(outdir), url)


def drop_duplicate_scripts(app: Sphinx, pagename, templatename, context, doctree) -> None:
    scripts = context.get("script_files")
    if not scripts:
        return
    seen: set = set()
    unique = []
    for js in scripts:
        key = (str(js.filename or ""), js.priority, tuple(sorted((k, str(v)) for k, v in js.attributes.items())))
        if key not in seen:
            seen.add(key)
            unique.append(js)
    scripts[:] = unique


def setup(app: Sphinx) -> dict:
    app.connect("builder-inited", check_mathjax)
    app.connect("html-page-context", drop_duplicate_scripts, priority=900)
    app.connect("build-finished", check_output)
    return {"version": "0.1", "parallel_read_safe": True, "parallel_write_safe": True}

