"""Result folders, manifests and a config-keyed cache for the notebooks.

Every study writes ``results/<scale>/<study>/``: CSV tables, figures and ``manifest.json`` (git
hash, config, seeds, package versions, device, threads, wall time). Long computations are cached
under ``.cache/<study>/`` by a hash of their config, so rerunning a notebook reuses them; the keys
hold :func:`code_hash` of the code that computes them, so a change to that code recomputes them.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import platform
import runpy
import subprocess
import time
import types
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

PACKAGES = ("torch", "numpy", "jax", "numpyro", "scipy", "pandas", "matplotlib", "smp_core")


_CORE = Path(__file__).resolve().parents[1] / "smp_core"
_BOOK = Path(__file__).resolve().parent


# Modules that only draw, show or file results: no computed number depends on them, so they stay out
# of code_hash (editing a figure does not recompute hours of runs).
PRESENTATION = {"plots", "chapters", "reproduce", "paper"}
# The settings module: a study depends on the names it imports from it, not on the whole file, so that
# editing one study's or one scale's settings recomputes only what uses them (_settings_part).
SETTINGS = "config"
# Functions of the settings module whose output every cache key holds (each study puts the config it is
# given, get_config's dict, into the keys of its runs): their code counts, the tables they read do not.
SETTINGS_IN_KEYS = {"get_config"}


def _without_docstring(node: ast.AST) -> ast.AST:
    for child in ast.walk(node):
        body = getattr(child, "body", None)
        if isinstance(child, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and body \
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            child.body = body[1:] or [ast.Pass()]
    return node


def _normalised_code(path: Path) -> bytes:
    """A Python file's syntax tree without comments and docstrings (so that prose edits keep caches)."""
    return ast.dump(_without_docstring(ast.parse(path.read_text()))).encode()


def _as_data(value: Any) -> Any:
    """``value`` as JSON-able data that does not depend on insertion or hash order (dicts by key, sets
    sorted); anything else by its ``repr``."""
    if isinstance(value, dict):
        return [[repr(k), _as_data(v)] for k, v in sorted(value.items(), key=lambda item: repr(item[0]))]
    if isinstance(value, list | tuple):
        return [_as_data(v) for v in value]
    if isinstance(value, set | frozenset):
        return sorted((_as_data(v) for v in value), key=repr)
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return repr(value)


def _settings_part(path: Path, names: set[str]) -> bytes:
    """What ``names`` of the settings module ``path`` are: a value as data; a function as its syntax tree
    (docstring left out) with the values of the module-level names it reads and, in turn, the functions
    of the module it calls; but for the functions of :data:`SETTINGS_IN_KEYS`, whose output the cache
    keys hold, the syntax tree alone. A name the module lacks counts as such."""
    namespace = runpy.run_path(str(path))
    functions = {n.name: n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}
    parts, todo, done = [], sorted(names), set()
    while todo:
        name = todo.pop()
        if name in done:
            continue
        done.add(name)
        if name in functions:
            node = _without_docstring(functions[name])
            loads = set() if name in SETTINGS_IN_KEYS else {
                n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
            todo += sorted(loads & set(functions))
            read = {n: namespace[n] for n in sorted(loads & set(namespace) - set(functions))
                    if not callable(namespace[n]) and not isinstance(namespace[n], types.ModuleType)}
            parts.append(f"def {name}: {ast.dump(node)} reads {json.dumps(_as_data(read))}")
        elif name in namespace:
            parts.append(f"{name} = {json.dumps(_as_data(namespace[name]))}")
        else:
            parts.append(f"{name}: not defined")
    return "\n".join(sorted(parts)).encode()


def _imports(path: Path) -> tuple[set[Path], set[str]]:
    """The files of ``smp_book`` and ``smp_core`` that a file of either imports (absolute or relative,
    at module level or inside a function), but for the presentation modules of :data:`PRESENTATION`,
    and the names it imports from the settings module (:data:`SETTINGS`; a file that imports the module
    itself depends on all of it). ``from pkg import name`` counts the module ``name`` when there is one,
    else the package's ``__init__``; the compiled kernel's sources count with ``fused.py``."""
    package_dir = path.parent
    found: set[Path] = set()
    settings: set[str] = set()

    def add(package: Path, name: str | None) -> None:
        module = package / f"{name}.py" if name else package / "__init__.py"
        if name and not module.exists():
            module = package / "__init__.py"
        if module.exists() and not (package == _BOOK and module.stem in PRESENTATION):
            found.add(module)

    roots = {"smp_book": _BOOK, "smp_core": _CORE}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                package, module = package_dir, node.module
            elif node.module and node.module.split(".")[0] in roots:
                package, module = roots[node.module.split(".")[0]], ".".join(node.module.split(".")[1:]) or None
            else:
                continue
            if package == _BOOK and module == SETTINGS and all(alias.name != "*" for alias in node.names):
                settings |= {alias.name for alias in node.names}
            elif module:
                add(package, module.split(".")[0])
            else:
                for alias in node.names:
                    add(package, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in roots:
                    add(roots[parts[0]], parts[1] if len(parts) > 1 else None)
    if path.parent == _CORE and path.name == "fused.py":
        found |= {p for p in (_CORE / "csrc").glob("*") if p.suffix in (".cpp", ".h", ".cu")}
    return found, settings


@functools.cache
def code_hash(module: str) -> str:
    """A hash of the code a result of ``module`` (``"smp_book.toy_study"``, say) depends on: ``module``
    and every file of ``smp_book`` and ``smp_core`` it imports, transitively (the C++ kernel's sources
    with ``smp_core/fused.py``), but for the presentation modules, and of the settings it imports by name
    from ``smp_book/config.py`` (their values, not the rest of the file: :func:`_settings_part`).
    Comments and docstrings do not count. Cache keys hold it instead of version numbers, so editing code
    a study does not import (a new module of ``smp_core``, a figure, another study's settings) leaves
    its cached runs valid."""
    todo, seen, settings = [_BOOK / f"{module.removeprefix('smp_book.')}.py"], set(), set()
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            if path.suffix == ".py":
                files, names = _imports(path)
                todo += sorted(files - seen)
                settings |= names
    digest = hashlib.sha256()
    for path in sorted(seen, key=lambda p: (p.parent.name, p.name)):
        digest.update(f"{path.parent.name}/{path.name}".encode())
        digest.update(_normalised_code(path) if path.suffix == ".py" else path.read_bytes())
    config = _BOOK / f"{SETTINGS}.py"
    if settings and config not in seen:
        digest.update(_settings_part(config, settings))
    return digest.hexdigest()[:16]


def git_revision() -> str:
    """The current commit, with ``-dirty`` when the code (anything outside ``results/``) has uncommitted changes."""
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        # results/ is rewritten by the runs themselves: changes there do not make the code dirty
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!results"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_model() -> str:
    """The processor's model name (``/proc/cpuinfo`` on Linux), so that timings name their machine."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def environment() -> dict[str, Any]:
    """Package versions, Python, platform, device, processor and thread count."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu: {cpu_model()}"
    return {"python": platform.python_version(), "platform": platform.platform(), "packages": versions,
            "device": device, "cuda": torch.cuda.is_available(), "torch_threads": torch.get_num_threads(),
            "cpu_model": cpu_model(), "cpu_count": os.cpu_count()}


def write_manifest(path: Path, config: dict[str, Any], seeds: dict[str, Any], wall_time: float,
                   **extra: Any) -> Path:
    """Write ``manifest.json`` into the folder ``path``."""
    manifest = {"git": git_revision(), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": config,
                "seeds": seeds, "wall_time_s": round(wall_time, 2), "environment": environment(), **extra}
    out = Path(path) / "manifest.json"
    out.write_text(json.dumps(manifest, indent=2, default=str))
    return out


def config_key(config: dict[str, Any]) -> str:
    """A short, stable hash of a JSON-serialisable config."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cached(study: str, config: dict[str, Any], compute: Callable[[], Any],
           root: str | os.PathLike = ".cache", enabled: bool = True) -> Any:
    """Return ``compute()``, reusing a saved result for the same ``config``.

    The file is ``<root>/<study>/<key>.pt`` with the config stored beside the value; a file whose
    stored config differs (a hash collision) raises instead of being overwritten.
    """
    if not enabled:
        return compute()
    folder = Path(root) / study
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{config_key(config)}.pt"
    canonical = json.loads(json.dumps(config, sort_keys=True, default=str))
    if path.exists():
        payload = torch.load(path, map_location="cpu", weights_only=False)
        if payload["config"] != canonical:
            raise RuntimeError(f"cache file {path} holds another config; remove it by hand")
        return payload["value"]
    value = compute()
    tmp = path.with_suffix(".tmp")
    torch.save({"config": canonical, "value": value}, tmp)
    os.replace(tmp, path)
    return value


def summarise_replicates(per_replicate: list[dict[str, pd.DataFrame]]) -> dict[str, pd.DataFrame]:
    """Mean and standard deviation (``ddof=1``; NaN for one replicate) over replicates of every cell.

    ``per_replicate[r][name]`` is table ``name`` of replicate ``r`` (rows named ``method``); returns
    ``{name}_mean``, ``{name}_std`` and ``{name}_replicates`` (all replicates stacked, indexed by
    ``(replicate, method)``) for every ``name``, rows in the order of the first replicate.
    """
    if not per_replicate:
        raise ValueError("no replicates to summarise")
    out = {}
    for name in per_replicate[0]:
        frames = [tables[name] for tables in per_replicate]
        stacked = pd.concat(frames, keys=range(len(frames)), names=["replicate"])
        out[f"{name}_mean"] = stacked.groupby(level="method", sort=False).mean()
        out[f"{name}_std"] = stacked.groupby(level="method", sort=False).std(ddof=1)
        out[f"{name}_replicates"] = stacked
    return out


def variance_components(values: pd.DataFrame) -> pd.DataFrame:
    """Between-group and within-group spread of each column of a balanced two-level design, by the
    one-way random-effects analysis of variance.

    ``values`` is indexed by ``(group, replicate)`` (two index levels, every group with the same number
    ``r >= 2`` of replicates, at least two groups), one column per quantity; the model is
    ``y_gr = mu + a_g + e_gr`` with ``a_g ~ (0, sigma_group^2)`` and ``e_gr ~ (0, sigma_within^2)``
    independent. With ``G`` groups, ``MS_between = r sum_g (ybar_g - ybar)^2 / (G - 1)`` and
    ``MS_within = sum_gr (y_gr - ybar_g)^2 / (G (r - 1))``; ``MS_within`` and ``(MS_between - MS_within) / r``
    are unbiased for the two variances. Returns, per column: ``mean``, ``sd_group`` (the square root of
    the second estimate, 0 where it is negative), ``sd_within``, ``group_share``
    (``sigma_group^2 / (sigma_group^2 + sigma_within^2)`` from the estimates, the intraclass correlation),
    ``F = MS_between / MS_within`` and ``p_value``, the chance of an ``F`` at least as large if the groups
    did not differ (``F(G - 1, G (r - 1))``, exact for normal errors of one variance in every group).
    A small ``p_value`` says that ``sigma_group > 0``, not that it exceeds ``sigma_within``; the two
    standard deviations say which is larger. With no spread at all ``F`` and ``p_value`` are NaN.
    """
    from scipy.stats import f as f_distribution

    if not isinstance(values.index, pd.MultiIndex) or values.index.nlevels != 2:
        raise ValueError("values must be indexed by (group, replicate): a MultiIndex of two levels")
    if values.empty or not np.isfinite(values.to_numpy(dtype=float)).all():
        raise ValueError("values must be non-empty and contain no NaN or infinite entries")
    sizes = values.groupby(level=0, sort=False).size()
    if len(sizes) < 2 or sizes.nunique() != 1 or sizes.iloc[0] < 2:
        raise ValueError("a balanced design is needed: at least 2 groups, each with the same number (at least 2) "
                         f"of replicates; got {({group: int(n) for group, n in sizes.items()})}")
    n_groups, r = len(sizes), int(sizes.iloc[0])
    rows = {}
    for column in values.columns:
        y = values[column].astype(float)
        group_means = y.groupby(level=0, sort=False).mean()
        grand = float(y.mean())
        ms_between = r * float(((group_means - grand) ** 2).sum()) / (n_groups - 1)
        deviations = y - group_means.reindex(y.index.get_level_values(0)).to_numpy()
        ms_within = float((deviations**2).sum()) / (n_groups * (r - 1))
        var_group = max(0.0, (ms_between - ms_within) / r)
        total = var_group + ms_within
        if ms_within > 0:
            f_stat = ms_between / ms_within
            p_value = float(f_distribution.sf(f_stat, n_groups - 1, n_groups * (r - 1)))
        else:  # no spread within groups: any between them is certain; none at all leaves nothing to test
            f_stat, p_value = (float("inf"), 0.0) if ms_between > 0 else (float("nan"), float("nan"))
        rows[column] = {"mean": grand, "sd_group": var_group**0.5, "sd_within": ms_within**0.5,
                        "group_share": var_group / total if total > 0 else float("nan"), "F": f_stat,
                        "p_value": p_value}
    return pd.DataFrame.from_dict(rows, orient="index")
