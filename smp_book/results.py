"""A study's results folder, read back for a chapter: ``results/<scale>/<study>/`` holds CSV tables, figures
(PNG), ``values.json`` (the numbers its prose quotes) and ``manifest.json`` (:mod:`smp_book.pipeline`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]  # the repository: results, data and caches live under it
RESULTS = ROOT / "results"


class Results:
    """The files of one study, read back: ``table(name)``, ``figure(name)``, ``values``, ``manifest``."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if not (self.folder / "manifest.json").exists():
            raise FileNotFoundError(f"no results in {self.folder} (no manifest.json)")
        self.manifest = json.loads((self.folder / "manifest.json").read_text())
        self.study = self.manifest.get("study", self.folder.name)
        values = self.folder / "values.json"
        self.values: dict[str, Any] = json.loads(values.read_text()) if values.exists() else {}

    @property
    def config(self) -> dict[str, Any]:
        return self.manifest["config"]

    def tables(self) -> list[str]:
        return list(self.manifest.get("tables", {}))

    def has(self, name: str) -> bool:
        return name in self.manifest.get("tables", {})

    def table(self, name: str) -> pd.DataFrame:
        """Table ``name`` as it was written (index and column levels restored)."""
        layout = self.manifest.get("tables", {}).get(name)
        if layout is None:
            raise KeyError(f"{self.study} has no table {name!r}; it has: {', '.join(self.tables()) or 'none'}")
        header = list(range(layout["header"])) if layout["header"] > 1 else 0
        index = list(range(layout["index"])) if layout["index"] > 0 else None
        return pd.read_csv(self.folder / f"{name}.csv", index_col=index, header=header)

    def figure(self, name: str):
        """Figure ``name`` for display in a notebook (its PNG)."""
        from IPython.display import Image

        path = self.folder / "figures" / f"{name}.png"
        if not path.exists():
            raise KeyError(f"{self.study} has no figure {name!r}; it has: "
                           f"{', '.join(self.manifest.get('figures', []))}")
        return Image(filename=str(path))

    def glue(self, **derived: Any) -> None:
        """Glue every value, and the ``derived`` ones, for the prose: ``{glue:text}`<study>.<name>:.3f```."""
        from myst_nb import glue

        for name, value in {**self.values, **derived}.items():
            glue(f"{self.study}.{name}", value.item() if hasattr(value, "item") else value, display=False)



def note(text: str) -> None:
    """A note on the chapter's page when it runs in a notebook (nothing otherwise)."""
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
    except ImportError:
        return
    if get_ipython() is not None:
        display(Markdown(f":::{{note}}\n{text}\n:::"))
