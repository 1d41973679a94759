"""smp_core is the library alone: torch and numpy are its only required dependencies, and nothing in it
imports the book's package."""

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import smp_core

CORE = Path(smp_core.__file__).parent
BLOCKED = ["smp_book", "jax", "numpyro", "matplotlib", "pandas", "scipy", "tqdm", "torchvision", "IPython"]


def test_no_module_of_smp_core_names_the_book_package():
    for path in CORE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            assert not any(n.split(".")[0] == "smp_book" for n in names), f"{path.name} imports smp_book"


def test_every_module_imports_and_runs_without_the_book_dependencies():
    modules = sorted(m.name for m in pkgutil.walk_packages([str(CORE)], "smp_core."))
    assert "smp_core.recursion" in modules and "smp_core.fused" in modules
    script = f"""
import sys, importlib, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ImportError("blocked in this test: " + name)
sys.meta_path.insert(0, Block())
for name in {modules!r}:
    importlib.import_module(name)
import torch, smp_core
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
r = smp_core.run_smp(net, "bernoulli", torch.randn(20, 2), preconditioner="fixed-diag", tau=0.5, n_steps=20,
                     n_chains=4, seed=0, progress=True)
assert r.theta.shape == (4, 13) and smp_core.residual_variance_ratio(20, 20) < 1
assert not any(k.split(".")[0] in {BLOCKED!r} for k in sys.modules)
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_no_import_cycle_inside_smp_core():
    """The modules of smp_core import one another in one direction, deferred imports inside functions included
    (a fast path registers itself with the module it extends, not the other way round)."""
    graph: dict[str, set[str]] = {}
    for path in CORE.rglob("*.py"):
        here = path.stem
        edges = graph.setdefault(here, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                edges.update([node.module] if node.module else [a.name for a in node.names])
    graph.pop("__init__")
    done: set[str] = set()

    def visit(name: str, stack: tuple[str, ...]) -> None:
        assert name not in stack, f"import cycle: {' -> '.join(stack + (name,))}"
        if name not in done:
            for other in graph.get(name, ()):
                visit(other, stack + (name,))
            done.add(name)

    for name in graph:
        visit(name, ())
    assert {"models", "fused", "preconditioners", "recursion"} <= done
