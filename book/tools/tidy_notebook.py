"""Tidy an executed notebook for the book: hide the parameters cells (the notebook's own and the one
papermill injects) and drop what a computation printed on stderr (progress bars, warnings).

Usage: python book/tools/tidy_notebook.py NOTEBOOK.ipynb [...]  (rewritten in place)
"""

import sys

import nbformat

HIDDEN = {"parameters", "injected-parameters"}


def tidy(path: str) -> None:
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        tags = cell.metadata.setdefault("tags", [])
        if HIDDEN & set(tags) and "remove-cell" not in tags:
            tags.append("remove-cell")
        cell.outputs = [o for o in cell.get("outputs", []) if not (o.output_type == "stream" and o.name == "stderr")]
    nbformat.write(nb, path)


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        tidy(arg)
