"""The registry of notebooks: every notebook in notebooks/ is run by `make notebooks` (and so at ci
scale under nbval by `make test`) and is a chapter of the book; nothing listed is missing."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _makefile_notebooks() -> list[str]:
    match = re.search(r"^NOTEBOOKS \?= (.+)$", (ROOT / "Makefile").read_text(), flags=re.MULTILINE)
    assert match, "the Makefile has no NOTEBOOKS ?= line"
    return match.group(1).split()


def test_every_notebook_is_run_and_in_the_book():
    sources = sorted(p.stem for p in (ROOT / "notebooks").glob("*.md"))
    listed = _makefile_notebooks()
    assert sorted(listed) == sources, "notebooks/*.md and the Makefile's NOTEBOOKS differ"
    toc = (ROOT / "_toc.yml").read_text()
    missing = [name for name in sources if f"file: book/generated/{name}\n" not in toc]
    assert not missing, f"notebooks missing from _toc.yml: {missing}"


def test_chapters_run_in_the_order_of_their_studies():
    # a study reads the results of those before it; the summary reads them all
    from smp_book.chapters import STUDIES

    order = [nb for nb in _makefile_notebooks() if nb in STUDIES]
    assert order == [s for s in STUDIES if s in order] and order[-1] == "summary"
    # every study is shown: by its own chapter, or by a section of another (the toy's gaps in the toy chapter)
    texts = {nb: (ROOT / "notebooks" / f"{nb}.md").read_text() for nb in _makefile_notebooks()}
    unshown = [s for s in STUDIES if not any(f'results("{s}"' in t for t in texts.values())]
    assert not unshown, f"studies no chapter shows: {unshown}"
