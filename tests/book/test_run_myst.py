"""tools/run_myst.py: a MyST notebook's code cells run as a script, parameters overridden as papermill does."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location("run_myst", Path(__file__).parents[2] / "tools" / "run_myst.py")
run_myst = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(run_myst)

NOTEBOOK = """---
jupytext:
  text_representation:
    format_name: myst
---

# A study

```{code-cell} ipython3
:tags: [parameters]

scale = "ci"
steps = 3
```

Some text with a fence that is not a code cell:

```python
raise RuntimeError("not run")
```

```{code-cell} ipython3
:tags: [remove-cell]

import json
from pathlib import Path
from IPython.display import Markdown, display

Path(out).write_text(json.dumps({"scale": scale, "total": sum(range(steps))}))
display(Markdown(f"**{scale}**"))
```
"""


def test_cells_tags_and_parameters(tmp_path):
    cells = run_myst.code_cells(NOTEBOOK)
    assert [tags for tags, _ in cells] == [["parameters"], ["remove-cell"]]
    assert cells[0][1].strip() == 'scale = "ci"\nsteps = 3'
    assert run_myst.parse_parameters(["scale=paper", "steps=10", "flag=False", "name='x y'"]) == {
        "scale": "paper", "steps": 10, "flag": False, "name": "x y"}


def test_writes_its_results_and_refuses_unknown_parameters(tmp_path, capsys, monkeypatch):
    # as on a machine without IPython: display() prints through the fallback
    monkeypatch.setitem(sys.modules, "IPython", None)
    monkeypatch.setitem(sys.modules, "IPython.display", None)
    notebook = tmp_path / "study.md"
    out = tmp_path / "result.json"
    notebook.write_text(NOTEBOOK.replace('steps = 3', f'steps = 3\nout = {str(out)!r}'))
    run_myst.run(notebook, {"scale": "paper", "steps": 5})
    assert json.loads(out.read_text()) == {"scale": "paper", "total": 10}  # the overrides were used
    assert "**paper**" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"no parameter\(s\) \['stepz'\]"):
        run_myst.run(notebook, {"stepz": 5})
    with pytest.raises(ValueError, match="name=value"):
        run_myst.parse_parameters(["scale"])
