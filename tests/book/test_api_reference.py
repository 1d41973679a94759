"""The book's API reference (book/api.md, one page per module under book/api/) lists every export of
smp_core and documents each one."""

import inspect
import re
from pathlib import Path

import smp_core

API_PAGE = Path(__file__).resolve().parents[2] / "book" / "api.md"
MODULE_PAGES = sorted((API_PAGE.parent / "api").glob("*.md"))


def _target(name: str) -> str:
    obj = getattr(smp_core, name)
    return obj.__name__ if inspect.ismodule(obj) else f"{obj.__module__}.{name}"


def test_the_importing_list_is_smp_cores_exports_exactly():
    page = API_PAGE.read_text()
    section = page.split("## Importing", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"\{py:\w+\}`(\w+) <([\w.]+)>`", section)
    assert sorted(name for name, _ in listed) == sorted(smp_core.__all__)
    assert all(target == _target(name) for name, target in listed)


def test_every_export_is_documented_by_an_auto_directive():
    """Each export is named by its own ``auto*::`` directive, or its module is documented with
    ``:members:`` (all of them, or a list that names it)."""
    page = "\n".join(path.read_text() for path in MODULE_PAGES)
    named = set(re.findall(r"\.\. auto(?:function|class|exception|data):: ([\w.]+)", page))
    whole = set(re.findall(r"\.\. automodule:: ([\w.]+)\n   :members:\n", page))
    listed = {f"{module}.{member.strip()}" for module, members in
              re.findall(r"\.\. automodule:: ([\w.]+)\n   :members: (.+)\n", page) for member in members.split(",")}
    for name in smp_core.__all__:
        target = _target(name)
        module = target if inspect.ismodule(getattr(smp_core, name)) else target.rsplit(".", 1)[0]
        assert target in named or module in whole or target in listed, f"book/api.md does not document {target}"


def test_every_module_page_is_listed_on_the_reference_and_in_the_table_of_contents():
    page, toc = API_PAGE.read_text(), (API_PAGE.parents[1] / "_toc.yml").read_text()
    for path in MODULE_PAGES:
        assert f"{{doc}}`api/{path.stem}`" in page and f"api/{path.stem}\n" in toc, path.stem
