"""The library's README (smp_core/README.md, its distribution's description): its example runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "smp_core" / "README.md"


def test_readme_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    printed = capsys.readouterr().out
    assert "SMP fixed-block" in printed and "accuracy" in printed
    assert namespace["samples"].shape == (200, 41)
    assert namespace["probs"].shape == (200, 1000, 2)
