"""The book's API reference (book/api.md) names every export of smp_core and documents its module."""

import inspect
import re
from pathlib import Path

import smp_core

API_PAGE = Path(__file__).resolve().parents[1] / "book" / "api.md"


def test_every_export_of_smp_core_is_named_with_the_module_that_documents_it():
    page = API_PAGE.read_text()
    documented = set(re.findall(r"automodule:: (smp_core\.\w+)", page))
    for name in smp_core.__all__:
        obj = getattr(smp_core, name)
        module = obj.__name__ if inspect.ismodule(obj) else obj.__module__
        target = module if inspect.ismodule(obj) else f"{module}.{name}"
        assert f"<{target}>`" in page, f"book/api.md does not link smp_core.{name} ({target})"
        assert module in documented, f"book/api.md does not document the module {module} of smp_core.{name}"
