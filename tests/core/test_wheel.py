"""The library ships alone: its wheel holds ``smp_core`` and nothing of the book, pins nothing exactly, and the
library's README (``smp_core/README.md``, its description) runs from it in a fresh environment that sees torch and
numpy but not ``smp_book``."""

import os
import re
import subprocess
import sys
import sysconfig
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # --no-build-isolation: the project's own setuptools builds it, so that no index is needed
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    str(ROOT), "-w", str(out)], check=True, cwd=out, capture_output=True, text=True)
    [found] = out.glob("smp_core-*.whl")
    return found


def test_the_wheel_holds_the_library_and_its_metadata(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    packages = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert packages == {"smp_core"}, packages
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "smp_core").rglob("*")
               if p.suffix in (".py", ".cpp") and "__pycache__" not in p.parts}
    assert sources == {n for n in names if not n.startswith("smp_core-")}  # every module and the kernel's source
    info = next(n for n in names if n.endswith(".dist-info/METADATA"))
    meta = Parser().parsestr(zipfile.ZipFile(wheel).read(info).decode())
    import smp_core

    assert meta["Name"] == "smp-core" and meta["Version"] == smp_core.__version__
    assert meta["License-Expression"] == "MIT" and any(n.endswith("licenses/LICENSE") for n in names)
    requires = meta.get_all("Requires-Dist")
    core = [r for r in requires if "extra ==" not in r]
    assert sorted(re.split(r"[<>=!~ ;\[]", r)[0] for r in core) == ["numpy", "torch"]
    assert not [r for r in requires if "==" in r.split(";")[0]], requires  # ranges, never an exact pin
    # its description is the library's README, not the project's (which speaks of the book)
    assert meta.get_payload().strip() == (ROOT / "smp_core" / "README.md").read_text().strip()


def test_the_readme_example_runs_from_the_wheel_alone(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, capture_output=True, text=True)
    # torch and numpy (and what they import) from the project's environment, as a plain path: its .pth files,
    # the editable installs of smp_core and smp_book among them, are not read, so the library comes from the wheel
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "project_env.pth").write_text(sysconfig.get_path("purelib") + "\n")
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "smp_core" / "README.md").read_text(), flags=re.S)
    script = tmp_path / "example.py"
    script.write_text("import importlib.util, smp_core\n"
                      "print('from', smp_core.__file__)\n"
                      "assert importlib.util.find_spec('smp_book') is None, 'smp_book is visible'\n" + blocks[0])
    # without the compiled kernel (whose build falls back to the torch path on any failure, so that this example
    # could not show that it builds): torch keeps one build folder per kernel name, and ninja rebuilds when the
    # source's path changes, so a build from the wheel here would cost a minute, and another one to the next
    # process that loads the kernel from the repository
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")} | {"SMP_CORE_FUSED": "0"}
    done = subprocess.run([str(python), str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"from {site}" in done.stdout
    assert "SMP fixed-block" in done.stdout and "accuracy" in done.stdout
