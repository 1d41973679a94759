"""The book speaks to readers of the paper: no git hashes or dates in its prose (history lives in git)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
PATTERNS = {
    "a git hash": re.compile(r"(?<![\w/.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w-])"),
    "a date": re.compile(rf"\b(\d{{1,2}} ({MONTHS})\b|\b({MONTHS}) \d{{4}}\b|\b20\d\d-\d\d-\d\d\b)"),
    "a commit reference": re.compile(r"\b(git|commit) [0-9a-f]{7}"),
}


def prose(path: Path) -> str:
    """The Markdown of a page without its code cells, code blocks and inline code."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return re.sub(r"`[^`\n]*`", "", text)


PAGES = (sorted((ROOT / "notebooks").glob("*.md")) + sorted((ROOT / "book").glob("*.md"))
         + [ROOT / "README.md", ROOT / "smp_core" / "README.md"])


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_history_in_prose(page):
    text = prose(page)
    found = [f"{what}: {m.group(0)!r}" for what, pattern in PATTERNS.items() for m in pattern.finditer(text)]
    assert not found, f"{page.name} quotes history in its prose (history lives in git): {found[:10]}"


def test_the_check_finds_history(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("As fixed in git 6b8a318 on 25 November 2026.\n\n```python\nx = 'deadbee1'\n```\n")
    text = prose(page)
    assert PATTERNS["a git hash"].search(text) and PATTERNS["a date"].search(text)
    assert "deadbee1" not in text


API_PAGES = {"usage", "how_to_run"}  # the pages about the code itself


def internal_names(text: str) -> list[str]:
    """The inline code spans of a page's prose that name ``smp_book.*`` and are not a command to run."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # inline code stays: that is where names go
    spans = re.findall(r"`([^`\n]+)`", text)
    return [s for s in spans if re.search(r"\bsmp_book\.\w", s) and not re.match(r"python\s+-m\s", s.strip())]


def test_the_check_finds_internal_names():
    text = "See `smp_book.nuts.run_nuts`; run `python  -m smp_book.reproduce`, or `a` smp_book.x `b`.\n"
    assert internal_names(text) == ["smp_book.nuts.run_nuts"]


@pytest.mark.parametrize("page", [p for p in PAGES if p.parent.name == "notebooks" and p.stem not in API_PAGES],
                         ids=lambda p: p.stem)
def test_chapters_name_no_internal_code(page):
    found = internal_names(page.read_text())
    assert not found, f"{page.name} names the book's internal code in its prose (a command to run is fine): {found}"
