"""The book's pipeline: a study computes files, a chapter shows them.

A study (``STUDIES``) has ``compute(ctx)``: it writes tables, figures and the values its prose quotes through
its ``Context`` and reads earlier studies with ``ctx.read``. ``results`` reads ``results/<scale>/<study>/`` when
its manifest holds the settings asked for, else computes it (unless ``SMP_BOOK_READ_ONLY`` is set: ``make
book``); a chapter's parameters send changed settings to ``results/custom/``. ``cached`` memoises the expensive
leaves (a NUTS run, a MAP fit, one SMP run) by their settings and ``code_hash``.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from .config import SCALES, get_config, with_parameters
from .machine import environment, git_revision
from .results import RESULTS, ROOT, Results, note

CACHE, DATA = ROOT / ".cache", ROOT / "data"
READ_ONLY = "SMP_BOOK_READ_ONLY"
FORMAT = 2

# Every study, in the order the book needs them (a study may read those before it).
STUDIES = {name: f"smp_book.{module}" for name, module in [
    ("toy", "toy_study"), ("toy_baselines", "baseline_study"), ("toy_kfac", "toy_kfac_study"),
    ("toy_tail", "tail_study"), ("toy_gaps", "toy_gaps_study"), ("mnist", "mnist_study"),
    ("mnist_baselines", "mnist_baseline_study"), ("last_layer", "last_layer_study"),
    ("mnist_seeds", "mnist_seeds_study"), ("mnist_growth", "mnist_growth_study"),
    ("mnist_kfac", "mnist_kfac_study"), ("mnist_tail", "mnist_tail_study"), ("regression", "regression_study"),
    ("summary", "summary_study")]}
OWN_CONFIG = {"toy_gaps", "last_layer", "mnist_tail", "summary"}  # their modules define config(scale)

# The smp_book modules whose code each module's numbers rest on: its own imports, but for the pipeline,
# the settings (they reach the numbers through the keys) and what only draws or shows (plots, paper, show).
DEPENDS: dict[str, tuple[str, ...]] = {
    "toy": ("nuts", "summaries"), "toy_study": ("nuts", "toy"),
    "baseline_study": ("baselines", "nuts", "summaries", "toy"), "toy_kfac_study": ("toy",),
    "tail_study": ("nuts", "tails", "toy"), "toy_gaps_study": ("nuts", "toy"),
    "mnist_runs": ("mnist", "summaries"), "mnist_study": ("mnist_runs",),
    "mnist_seeds_study": ("mnist_runs", "summaries"), "mnist_growth_study": ("mnist_runs",),
    "mnist_kfac_study": ("mnist_runs",), "mnist_tail_study": ("mnist_runs", "tails"),
    "shifted": ("summaries",), "mnist_baseline_study": ("baselines", "mnist_runs", "shifted", "summaries"),
    "last_layer_study": ("last_layer_runs", "mnist_runs", "shifted"),
    "regression_study": ("baselines", "nuts"),
}


def _canonical(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def rests_on(module: str) -> set[str]:
    """The names of the book's modules ``module`` (``"smp_book.toy_study"``) rests on: itself and, transitively,
    the modules :data:`DEPENDS` names for it (``{"toy_study", "toy", "nuts", "summaries"}``)."""
    name = module.removeprefix("smp_book.")
    return {name}.union(*(rests_on(other) for other in DEPENDS.get(name, ())))


@functools.cache
def code_hash(module: str, root: Path = ROOT) -> str:
    """A hash of the code a result of ``module`` rests on: every file of ``smp_core`` (the kernel's sources too)
    and of :func:`rests_on`, under ``root`` (another checkout gives that code's hash)."""
    book, names = Path(root) / "smp_book", rests_on(module)
    files = sorted(p for p in (Path(root) / "smp_core").rglob("*") if p.suffix in (".py", ".cpp", ".h", ".cu"))
    digest = hashlib.sha256()
    for path in files + [book / f"{name}.py" for name in sorted(names)]:
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def config_key(config: dict[str, Any]) -> str:
    """A short, stable hash of a JSON-serialisable config."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cached(study: str, key: dict[str, Any], compute: Callable[[], Any], root: str | os.PathLike = CACHE,
           enabled: bool = True) -> Any:
    """``compute()``, saved as ``<root>/<study>/<config_key(key)>.pt`` with ``key`` beside it and reused for
    the same ``key``; a file holding another key (a hash collision) raises instead of being overwritten."""
    if not enabled:
        return compute()
    import torch

    path = Path(root) / study / f"{config_key(key)}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)  # a long computation checkpoints beside it
    if path.exists():
        payload = torch.load(path, map_location="cpu", weights_only=False)
        if payload["config"] != _canonical(key):
            raise RuntimeError(f"cache file {path} holds another key; remove it by hand")
        return payload["value"]
    value = compute()
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    torch.save({"config": _canonical(key), "value": value}, tmp)
    os.replace(tmp, path)
    return value


def study_config(study: str, scale: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
    """The settings of ``study`` at ``scale`` (its module's ``config(scale)`` for those of :data:`OWN_CONFIG`,
    else ``get_config``), changed by a chapter's ``params`` (:func:`smp_book.config.with_parameters`)."""
    if study not in STUDIES:
        raise ValueError(f"study: unknown study {study!r}; known: {', '.join(STUDIES)}")
    if scale not in SCALES:
        raise ValueError(f"scale: unknown scale {scale!r}; known: {', '.join(SCALES)}")
    module = sys.modules.get(STUDIES[study]) or (importlib.import_module(STUDIES[study]) if study in OWN_CONFIG
                                                 else None)  # a chapter that only reads need not import torch
    own = getattr(module, "config", None)
    return with_parameters(study, own(scale) if callable(own) else get_config(study, scale), params)


@dataclass
class Context:
    """What a study's ``compute`` gets: its settings, where to write, and how to read earlier studies."""

    study: str
    scale: str
    config: dict[str, Any]
    folder: Path
    root: Path
    use_cache: bool = True
    progress: bool = False
    manifest: dict[str, Any] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    tables: dict[str, dict[str, int]] = field(default_factory=dict)
    figures: list[str] = field(default_factory=list)
    sources: dict[str, str | None] = field(default_factory=dict)

    def table(self, name: str, df: pd.DataFrame, index: bool = True) -> pd.DataFrame:
        """Write ``df`` as ``<name>.csv`` (with its index unless ``index=False``); returns it."""
        if name in self.tables:
            raise ValueError(f"table {name!r} of {self.study} is written twice")
        df.to_csv(self.folder / f"{name}.csv", index=index)
        self.tables[name] = {"index": df.index.nlevels if index else 0, "header": df.columns.nlevels}
        return df

    def figure(self, name: str, fig) -> None:
        """Save a matplotlib figure as ``figures/<name>.png`` and close it."""
        import matplotlib.pyplot as plt

        from .plots import save

        if name in self.figures:
            raise ValueError(f"figure {name!r} of {self.study} is written twice")
        save(fig, self.folder / "figures", name)
        plt.close(fig)
        self.figures.append(name)

    def value(self, name: str, value: Any) -> Any:
        """A number (or short text) the chapter's prose quotes; returns it."""
        self.values[name] = value.item() if hasattr(value, "item") else value
        return self.values[name]

    def record(self, **entries: Any) -> None:
        """Entries for the manifest (seeds, timings of parts, ...)."""
        self.manifest.update(entries)

    def settings(self, study: str, scale: str) -> dict[str, Any]:
        """Another study's or scale's settings, for numbers the prose quotes (recorded in the manifest)."""
        config = get_config(study, scale)
        self.manifest.setdefault("settings_read", {})[f"{study}/{scale}"] = _canonical(config)
        return config

    def read_other_scale(self, study: str, scale: str) -> Results | None:
        """``study``'s results at another ``scale`` when they hold that scale's settings, else ``None``; never
        computed here (the paper scale takes hours). The manifest records what was read, or that nothing was."""
        folder, key = self.root / scale / study, f"../{scale}/{study}"
        res = Results(folder) if stale_reason(folder, study_config(study, scale)) is None else None
        self.sources[key] = res.manifest.get("id") if res else None
        return res

    def read(self, study: str) -> Results:
        """An earlier study's results at the same scale and root (computed first if missing)."""
        res = results(study, self.scale, root=self.root, use_cache=self.use_cache, progress=self.progress)
        self.sources[study] = res.manifest.get("id")
        return res


def _manifest(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


def stale_reason(folder: Path, config: dict[str, Any]) -> str | None:
    """Why ``folder`` does not hold a study's results for ``config`` (``None`` when it does)."""
    if (manifest := _manifest(folder)) is None:
        return "it holds no readable manifest.json"
    if manifest.get("format") != FORMAT:
        return f"its manifest has format {manifest.get('format')}, not {FORMAT}"
    if manifest.get("config") != _canonical(config):
        return "it was computed with other settings"
    for source, run_id in manifest.get("sources", {}).items():
        if (_manifest(folder.parent / source) or {}).get("id") != run_id:
            return f"the {source} results it read have changed since"
    for name, stored in manifest.get("settings_read", {}).items():
        if _canonical(get_config(*name.split("/"))) != stored:
            return f"the {name} settings it quotes have changed"
    missing = [name for name in manifest.get("tables", {}) if not (folder / f"{name}.csv").exists()]
    return f"its tables {missing} are missing" if missing else None


def replace(target: Path, new: Path) -> None:
    """Move the folder ``new`` to ``target``; what was there is set aside first and removed once ``new`` is in."""
    old = target.with_name(f".{target.name}.old.{os.getpid()}")
    if target.exists():
        target.rename(old)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(new, target)
    shutil.rmtree(old, ignore_errors=True)


def compute(study: str, scale: str, params: dict[str, Any] | None = None, root: str | Path = RESULTS,
            use_cache: bool = True, progress: bool = False) -> Results:
    """Run ``study``'s ``compute`` and write its folder (:func:`folder_of`), replacing it only once complete."""
    config, folder = study_config(study, scale, params), folder_of(study, scale, params, root)
    scratch = Path(root) / scale / ".partial" / f"{study}.{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    ctx = Context(study, scale, config, scratch, Path(root), use_cache=use_cache, progress=progress)
    load, started = os.getloadavg()[0], time.perf_counter()
    importlib.import_module(STUDIES[study]).compute(ctx)
    wall, threads = time.perf_counter() - started, environment()["torch_threads"]
    loads = {"start": load, "end": os.getloadavg()[0]}
    if max(loads.values()) > threads + 0.75:
        ctx.manifest.setdefault("timing_note", f"other work ran (load average {max(loads.values()):.1f} with "
                                f"{threads} thread(s)): its timings are not for comparisons")
    (scratch / "values.json").write_text(json.dumps(_canonical(ctx.values), indent=2))
    extra = _canonical(ctx.manifest)
    manifest = {"git": git_revision(), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": _canonical(config),
                "seeds": extra.pop("seeds", {}), "wall_time_s": round(wall, 2), "environment": environment(),
                "load_average": loads, "format": FORMAT, "study": study, "scale": scale, "id": uuid.uuid4().hex,
                "code": code_hash(STUDIES[study]), "tables": ctx.tables, "figures": ctx.figures,
                "sources": ctx.sources, **extra}
    (scratch / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str))
    replace(folder, scratch)
    return Results(folder)


def folder_of(study: str, scale: str, params: dict[str, Any] | None = None, root: str | Path = RESULTS) -> Path:
    """``<root>/<scale>/<study>``, or ``<root>/custom/<scale>-<study>-<key>`` for settings that ``params`` changed."""
    config = study_config(study, scale, params)
    if config == study_config(study, scale):
        return Path(root) / scale / study
    return Path(root) / "custom" / f"{scale}-{study}-{config_key(config)}"


def results(study: str, scale: str, params: dict[str, Any] | None = None, *, root: str | Path = RESULTS,
            use_cache: bool = True, progress: bool = False) -> Results:
    """The results of ``study`` at ``scale`` with a chapter's ``params``: read when its folder holds those
    settings, else computed, unless ``SMP_BOOK_READ_ONLY`` is set: then it raises, saying why. Results of other
    code than the current one are read, with a note on the chapter's page."""
    folder = folder_of(study, scale, params, root)
    why = stale_reason(folder, study_config(study, scale, params))
    if why is None:
        res = Results(folder)
        if res.manifest.get("code") != code_hash(STUDIES[study]):
            note(f"These results were computed by an earlier version of the code: `make reproduce SCALE={scale}` "
                  "recomputes them and reports what moved.")
        return res
    if os.environ.get(READ_ONLY):
        raise RuntimeError(f"results({study!r}, {scale!r}): {folder} cannot be read ({why}), and {READ_ONLY} is set, "
                           f"which forbids computing it here: run `make reproduce SCALE={scale}` to compute it")
    return compute(study, scale, params, root=root, use_cache=use_cache, progress=progress)
