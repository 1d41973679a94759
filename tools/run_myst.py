"""Run the code cells of a jupytext MyST notebook as one Python script, without Jupyter.

For a machine that has the study's packages (torch, numpy, pandas, matplotlib, scipy, tqdm) but no
jupytext, papermill or Jupyter kernel, such as a rented GPU box: the ``{code-cell}`` blocks of the
notebook run in order in one namespace, as papermill would run them, and ``name=value`` arguments
replace the values of the ``parameters`` cell. The notebook writes its own results
(``results/<scale>/<study>/``); what it displays is printed. A run that is stopped part-way resumes
from the study's caches and checkpoints when started again with the same arguments.

Usage (from the repository root)::

    python tools/run_myst.py notebooks/mnist.md scale=paper
    python tools/run_myst.py notebooks/mnist.md scale=ci use_cache=False
"""

from __future__ import annotations

import ast
import re
import sys
import time
import types
from pathlib import Path

_CELL = re.compile(r"^```\{code-cell\}[^\n]*\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)


def code_cells(text: str) -> list[tuple[list[str], str]]:
    """``(tags, source)`` of every code cell; the cell's ``:key: value`` option lines are read off."""
    cells = []
    for match in _CELL.finditer(text):
        lines = match.group(1).splitlines()
        tags: list[str] = []
        while lines and lines[0].startswith(":"):
            key, _, value = lines.pop(0)[1:].partition(":")
            if key.strip() == "tags":
                tags = [t.strip() for t in value.strip().strip("[]").split(",") if t.strip()]
        source = "\n".join(lines)
        if any(line.lstrip().startswith(("%", "!")) for line in lines):
            raise ValueError(f"a cell uses an IPython magic or shell escape, which plain Python cannot run:\n{source}")
        cells.append((tags, source))
    return cells


def parse_parameters(pairs: list[str]) -> dict[str, object]:
    """``name=value`` pairs; values are Python literals, or strings when they are not."""
    params = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.isidentifier():
            raise ValueError(f"parameters are name=value pairs, got {pair!r}")
        try:
            params[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            params[name] = value
    return params


def _install_display_fallback() -> None:
    """``IPython.display`` for a machine without IPython: ``display`` prints, ``Markdown`` is text."""
    try:
        import IPython.display  # noqa: F401

        return
    except ImportError:
        pass

    class Markdown:
        def __init__(self, data: str = ""):
            self.data = data

        def __repr__(self) -> str:
            return self.data

    module = types.ModuleType("IPython.display")
    module.Markdown = Markdown
    module.display = lambda *objects, **_: print(*objects)
    package = types.ModuleType("IPython")
    package.display = module
    if not isinstance(sys.modules.get("IPython"), types.ModuleType):
        sys.modules["IPython"] = package
    sys.modules["IPython.display"] = module


def run(path: Path, params: dict[str, object]) -> None:
    cells = code_cells(path.read_text())
    if params and not any("parameters" in tags for tags, _ in cells):
        raise ValueError(f"{path} has no cell tagged 'parameters' to override")
    _install_display_fallback()
    import matplotlib

    matplotlib.use("Agg")
    namespace: dict[str, object] = {"__name__": "__main__"}
    started = time.perf_counter()
    for number, (tags, source) in enumerate(cells, 1):
        print(f"--- cell {number}/{len(cells)} ({time.perf_counter() - started:.0f} s)", flush=True)
        exec(compile(source, f"{path}:cell{number}", "exec"), namespace)
        if "parameters" in tags:
            unknown = sorted(set(params) - set(namespace))
            if unknown:
                raise ValueError(f"{path} has no parameter(s) {unknown}")
            namespace.update(params)
    print(f"--- done in {time.perf_counter() - started:.0f} s", flush=True)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    path = Path(argv[0])
    if not path.is_file():
        raise SystemExit(f"no notebook at {path}")
    run(path, parse_parameters(argv[1:]))


if __name__ == "__main__":
    main()
