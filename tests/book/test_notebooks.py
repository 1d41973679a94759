"""The registry of notebooks: every notebook in notebooks/ is run once by `make test` (at ci scale under nbval,
the Makefile's NOTEBOOKS, or in the book's build for the SCALE_FREE ones, which take no scale) and is a chapter
of the book (notebooks/NAME in _toc.yml, whose paths are
relative to book/); nothing listed is missing."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _makefile_notebooks(name: str = "NOTEBOOKS") -> list[str]:
    match = re.search(rf"^{name} \?= (.+)$", (ROOT / "Makefile").read_text(), flags=re.MULTILINE)
    assert match, f"the Makefile has no {name} ?= line"
    return match.group(1).split()


def _toc_notebooks() -> list[str]:
    """The chapters notebooks/NAME of _toc.yml, in the book's order."""
    toc = (ROOT / "_toc.yml").read_text()
    return re.findall(r"^\s*-?\s*(?:file|root):\s*notebooks/([\w-]+)\s*$", toc, flags=re.MULTILINE)


def test_every_notebook_is_run_and_in_the_book():
    sources = sorted(p.stem for p in (ROOT / "notebooks").glob("*.md"))
    listed = _makefile_notebooks()
    assert sorted(listed) == sources, "notebooks/*.md and the Makefile's NOTEBOOKS differ"
    for name in _makefile_notebooks("SCALE_FREE"):  # nbval leaves them to the book: they must take no scale
        assert name in sources, f"SCALE_FREE names {name}, which notebooks/ does not hold"
        text = (ROOT / "notebooks" / f"{name}.md").read_text()
        code = "\n".join(re.findall(r"```\{code-cell\}[^\n]*\n(.*?)```", text, flags=re.DOTALL))
        assert not re.search(r"\bscale\b", code.replace('scale = "laptop"', "", 1)), (
            f"{name} is SCALE_FREE in the Makefile but its code uses its scale: nbval must run it at ci scale")
    in_toc = _toc_notebooks()
    missing = [name for name in sources if name not in in_toc]
    assert not missing, f"notebooks missing from _toc.yml (as `file: notebooks/NAME`): {missing}"
    unknown = [name for name in in_toc if name not in sources]
    assert not unknown, f"_toc.yml names notebooks that notebooks/ does not hold: {unknown}"


def test_chapters_run_in_the_order_of_their_studies():
    # a study reads the results of those before it; the summary reads them all
    try:
        from smp_book.pipeline import STUDIES
    except ImportError:
        from smp_book.chapters import STUDIES

    order = [nb for nb in _makefile_notebooks() if nb in STUDIES]
    assert order == [s for s in STUDIES if s in order] and order[-1] == "summary"
    # every study is shown: by its own chapter, or by a section of another (the toy's gaps in the toy chapter)
    texts = {nb: (ROOT / "notebooks" / f"{nb}.md").read_text() for nb in _makefile_notebooks()}
    unshown = [s for s in STUDIES if not any(f'results("{s}"' in t for t in texts.values())]
    assert not unshown, f"studies no chapter shows: {unshown}"


def test_the_book_folder_links_to_the_toc_and_the_notebooks():
    # `jupyter-book build book` reads book/_toc.yml (its paths relative to book/) and finds _config.yml in book/'s
    # parent folder; the notebooks are book/notebooks/NAME.md through a link
    book = ROOT / "book"
    assert (book / "_toc.yml").is_symlink() and (book / "_toc.yml").resolve() == (ROOT / "_toc.yml").resolve()
    assert (book / "notebooks").is_symlink() and (book / "notebooks").resolve() == (ROOT / "notebooks").resolve()
    assert not (book / "_config.yml").exists(), "book/_config.yml would move the build's output to book/_build"
