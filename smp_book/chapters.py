"""A chapter's results: computed once, saved as files, shown from the files.

``results/<scale>/<study>/`` holds what a study computed: tables (CSV), figures (PNG), values (the
numbers its prose quotes, ``values.json``) and ``manifest.json`` (config, seeds, code, machine, wall
time). These files are the interface between computing and showing. A chapter calls
:func:`results`: when the folder's manifest holds the chapter's settings (and the results it read
from other studies are still those), it is read; otherwise the study's ``compute(ctx)`` runs and
writes it. ``python -m smp_book.reproduce`` recomputes them all.

A study module ``smp_book.<name>_study`` (see :data:`STUDIES`) defines ``compute(ctx)``, which writes
through the :class:`Context` it is given, and may define ``config(scale)`` when its settings are more
than ``config.get_config(study, scale)``. A study is written into a scratch folder and moved into
place only once complete, so an interrupted run never leaves half a result behind; the long
computations inside are cached (``smp_book.results.cached``) and resume where they stopped.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from .config import SCALES, get_config
from .results import code_hash, environment, write_manifest

FORMAT = 1

# Every study, in the order the book needs them (a study may read those before it), with its module.
STUDIES = {
    "toy": "smp_book.toy_study",
    "toy_baselines": "smp_book.baseline_study",
    "toy_kfac": "smp_book.toy_kfac_study",
    "toy_tail": "smp_book.tail_study",
    "toy_gaps": "smp_book.toy_gaps_study",
    "mnist": "smp_book.mnist_study",
    "mnist_baselines": "smp_book.mnist_baseline_study",
    "last_layer": "smp_book.last_layer_study",
    "mnist_seeds": "smp_book.mnist_seeds_study",
    "mnist_growth": "smp_book.mnist_growth_study",
    "mnist_kfac": "smp_book.mnist_kfac_study",
    "mnist_tail": "smp_book.mnist_tail_study",
    "regression": "smp_book.regression_study",
    "summary": "smp_book.summary_study",
}


def _canonical(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def _check(study: str, scale: str) -> None:
    if study not in STUDIES:
        raise ValueError(f"study: unknown study {study!r}; known: {', '.join(STUDIES)}")
    if scale not in SCALES:
        raise ValueError(f"scale: unknown scale {scale!r}; known: {', '.join(SCALES)}")


def study_config(study: str, scale: str) -> dict[str, Any]:
    """The settings a study's results must have been computed with (``config(scale)`` of its module if
    it defines one, else ``get_config(study, scale)``)."""
    _check(study, scale)
    module = importlib.import_module(STUDIES[study])
    own = getattr(module, "config", None)
    return own(scale) if callable(own) else get_config(study, scale)


class Results:
    """The files of one study, read back: ``table(name)``, ``figure(name)``, ``values``, ``manifest``."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        path = self.folder / "manifest.json"
        if not path.exists():
            raise FileNotFoundError(f"no results in {self.folder} (no manifest.json)")
        self.manifest = json.loads(path.read_text())
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
                           f"{', '.join(self.manifest.get('figures', [])) or 'none'}")
        return Image(filename=str(path))

    def glue(self, **derived: Any) -> None:
        """Glue every value for the prose (myst-nb): ``{glue:text}`<study>.<name>:.3f``` in the chapter;
        ``derived`` adds values the chapter derives from the tables, under the same prefix."""
        from myst_nb import glue

        for name, value in {**self.values, **derived}.items():
            glue(f"{self.study}.{name}", value.item() if hasattr(value, "item") else value, display=False)


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
    _tables: dict[str, dict[str, int]] = field(default_factory=dict)
    _figures: list[str] = field(default_factory=list)
    _sources: dict[str, str] = field(default_factory=dict)

    def table(self, name: str, df: pd.DataFrame, index: bool = True) -> pd.DataFrame:
        """Write ``df`` as ``<name>.csv`` (with its index unless ``index=False``); returns it."""
        if name in self._tables:
            raise ValueError(f"table {name!r} of {self.study} is written twice")
        df.to_csv(self.folder / f"{name}.csv", index=index)
        self._tables[name] = {"index": df.index.nlevels if index else 0, "header": df.columns.nlevels}
        return df

    def figure(self, name: str, fig) -> None:
        """Save a matplotlib figure as ``figures/<name>.png`` (and a PDF beside it) and close it."""
        import matplotlib.pyplot as plt

        from .plots import save

        if name in self._figures:
            raise ValueError(f"figure {name!r} of {self.study} is written twice")
        save(fig, self.folder / "figures", name)
        plt.close(fig)
        self._figures.append(name)

    def value(self, name: str, value: Any) -> Any:
        """A number (or short text) the chapter's prose quotes; returns it."""
        if hasattr(value, "item"):
            value = value.item()
        self.values[name] = value
        return value

    def record(self, **entries: Any) -> None:
        """Entries for the manifest (seeds, device, timings of parts, ...)."""
        self.manifest.update(entries)

    def settings(self, study: str, scale: str) -> dict[str, Any]:
        """Another study's or scale's settings (``get_config(study, scale)``), for numbers the prose
        quotes (the paper's K, say). The manifest records them, so that these results count as stale
        once those settings change (the code hash leaves the settings tables out)."""
        cfg = get_config(study, scale)
        self.manifest.setdefault("settings_read", {})[f"{study}/{scale}"] = _canonical(cfg)
        return cfg

    def read_other_scale(self, study: str, scale: str) -> Results | None:
        """``study``'s results at another ``scale`` when they are there and hold that scale's current
        settings, else ``None``; never computed here (the paper scale takes hours). The manifest records
        what was read, or that nothing was, so that these results count as stale once that changes."""
        _check(study, scale)
        folder, key = self.root / scale / study, f"../{scale}/{study}"
        if _mismatch(folder, study_config(study, scale)) is not None:
            self._sources[key] = None
            return None
        res = Results(folder)
        self._sources[key] = res.manifest.get("id")
        return res

    def read(self, study: str) -> Results:
        """The results of an earlier study at the same scale and root (computed first if missing). The
        manifest records which results were read, so that these results are recomputed when those are."""
        res = results(study, self.scale, root=self.root, use_cache=self.use_cache, progress=self.progress)
        self._sources[study] = res.manifest.get("id")
        return res


# Where the load seen by each study's computations is kept across sessions (:class:`_LoadMonitor`).
LOADS = Path(".cache") / "loads"


class _LoadMonitor:
    """The highest one-minute load average above the torch threads seen while a study computes
    (sampled every 20 s), so that a timing taken while other work ran is marked as such.

    With ``record`` (a JSON file), the highest such excess of every session that computed the same
    study at the same scale with the same code is kept there, from the moment it passes ``BUSY``: a long
    run resumed from its checkpoints in a later session sums the seconds of all of them (up to each
    one's last checkpoint), so its timings are marked when any of those sessions shared the machine, even
    one that was killed. Conservative by design: the record outlives a change of settings and a cleared
    cache. Its limit: runs cached under ``.cache/`` and shared with another study (the MNIST chapter's
    with the MAP-seeds chapter's, say) carry only the record of the studies that computed them. The
    record never stops a study: one that cannot be read or written is ignored."""

    BUSY = 0.75  # load above the threads that marks a timing

    def __init__(self, threads: int, record: Path | None = None):
        self.threads, self.record = threads, record
        self.excess, self.busy_threads = self._recorded()

    def _recorded(self) -> tuple[float, int]:
        try:
            stored = json.loads(self.record.read_text()) if self.record else {}
            excess, threads = float(stored["excess"]), int(stored["threads"])
            return (excess, threads) if math.isfinite(excess) else (-math.inf, self.threads)
        except (OSError, ValueError, KeyError, TypeError):
            return -math.inf, self.threads

    def _see(self, load: float) -> None:
        with self._lock:
            if load - self.threads > self.excess:
                self.excess, self.busy_threads = load - self.threads, self.threads
            if self.record is None or self.excess <= self.BUSY:
                return
            try:  # the highest of this session and any other's since, written whole
                excess, threads = self._recorded()
                if excess > self.excess:
                    self.excess, self.busy_threads = excess, threads
                elif excess < self.excess:
                    self.record.parent.mkdir(parents=True, exist_ok=True)
                    part = self.record.with_name(f"{self.record.name}.{os.getpid()}")
                    part.write_text(json.dumps({"excess": self.excess, "threads": self.busy_threads}))
                    os.replace(part, self.record)
            except OSError:
                pass

    @property
    def note(self) -> str | None:
        """The manifest's timing note, or ``None`` when no session that computed the study was busy."""
        if self.excess <= self.BUSY:
            return None
        return (f"other work ran: load average up to {self.excess:.1f} above the {self.busy_threads} thread(s) "
                "in a session that computed it; its timings are not for comparisons")

    def __enter__(self):
        import threading

        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread = None
        if hasattr(os, "getloadavg"):
            self._see(os.getloadavg()[0])

            def watch():
                while not self._stop.wait(20):
                    self._see(os.getloadavg()[0])

            self._thread = threading.Thread(target=watch, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._see(-math.inf)  # takes up what another process recorded meanwhile
        return False


def _mismatch(folder: Path, config: dict[str, Any], code: str | None = None) -> str | None:
    """Why ``folder`` does not hold a study's current results (``None`` when it does)."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return "it holds no readable manifest.json"
    for source, run_id in manifest.get("sources", {}).items():  # results read from other studies
        if run_id is None:  # another scale's results it looked for and did not find (read_other_scale)
            scale, study = source.split("/")[1:]
            if _mismatch(folder.parent / source, study_config(study, scale)) is None:
                return f"the {source} results it did not find are there now"
            continue
        try:
            if json.loads((folder.parent / source / "manifest.json").read_text()).get("id") != run_id:
                return f"the {source} results it read have been recomputed since"
        except (OSError, ValueError):
            return f"the {source} results it read are missing"
    for name, stored in manifest.get("settings_read", {}).items():  # settings quoted from other studies
        if _canonical(get_config(*name.split("/"))) != stored:
            return f"the {name} settings it quotes have changed"
    if manifest.get("format") != FORMAT:
        return f"its manifest has format {manifest.get('format')}, not {FORMAT}"
    if manifest.get("config") != _canonical(config):
        return "it was computed with other settings"
    if code is not None and manifest.get("code") != code:
        return "it was computed by other code"
    missing = [name for name in manifest.get("tables", {}) if not (folder / f"{name}.csv").exists()]
    return f"its tables {missing} are missing" if missing else None


def compute(study: str, scale: str, root: str | Path = "results", use_cache: bool = True,
            progress: bool = False) -> Results:
    """Run ``study``'s ``compute`` at ``scale`` and write ``<root>/<scale>/<study>/`` (replacing what is there
    only once the run is complete)."""
    _check(study, scale)
    root = Path(root)
    config = study_config(study, scale)
    folder = root / scale / study
    scratch = root / scale / ".partial" / f"{study}.{os.getpid()}"  # two processes never share one
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    ctx = Context(study, scale, config, scratch, root, use_cache=use_cache, progress=progress)
    module = importlib.import_module(STUDIES[study])
    threads = environment()["torch_threads"]
    record = LOADS / f"{scale}-{study}-{code_hash(STUDIES[study])}.json" if use_cache else None
    started = time.perf_counter()
    with _LoadMonitor(threads, record) as load:
        module.compute(ctx)
    wall = time.perf_counter() - started
    if load.note:
        ctx.manifest.setdefault("timing_note", load.note)
    (scratch / "values.json").write_text(json.dumps(_canonical(ctx.values), indent=2))
    extra = _canonical(ctx.manifest)
    write_manifest(scratch, _canonical(config), extra.pop("seeds", {}), wall, format=FORMAT, study=study,
                   scale=scale, id=uuid.uuid4().hex, code=code_hash(STUDIES[study]), tables=ctx._tables,
                   figures=ctx._figures, sources=ctx._sources, **extra)
    if folder.exists():
        old = folder.with_name(f".{study}.old.{os.getpid()}")
        if old.exists():
            shutil.rmtree(old)
        folder.rename(old)
        scratch.rename(folder)
        shutil.rmtree(old)
    else:
        scratch.rename(folder)
    return Results(folder)


# Set (to anything) to make results() fail instead of computing: the committed book must only read.
READ_ONLY = "SMP_BOOK_READ_ONLY"


def results(study: str, scale: str, *, recompute: bool = False, root: str | Path = "results",
            use_cache: bool = True, progress: bool = False, code: bool = False) -> Results:
    """The results of ``study`` at ``scale``: read from ``<root>/<scale>/<study>/`` when they hold its
    current settings (and, with ``code=True``, were computed by its current code), else computed, unless
    the environment variable ``SMP_BOOK_READ_ONLY`` is set: then it raises, saying why it cannot read them."""
    _check(study, scale)
    folder = Path(root) / scale / study
    wanted_code = code_hash(STUDIES[study]) if code else None
    why = "recompute=True" if recompute else _mismatch(folder, study_config(study, scale), wanted_code)
    if why is None:
        res = Results(folder)
        if res.manifest.get("code") != code_hash(STUDIES[study]):
            _note(f"These results were computed by an earlier version of the code of this chapter's study: "
                  f"`make reproduce SCALE={scale}` recomputes them and reports what moved.")
        return res
    if os.environ.get(READ_ONLY):
        raise RuntimeError(f"results({study!r}, {scale!r}): {folder}/ cannot be read ({why}), and {READ_ONLY} is "
                           f"set, which forbids computing it here: run `make reproduce SCALE={scale}` (or unset "
                           f"{READ_ONLY}) to compute it")
    return compute(study, scale, root=root, use_cache=use_cache, progress=progress)


def _note(text: str) -> None:
    """A note on the chapter's page when it runs in a notebook (nothing otherwise)."""
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
    except ImportError:
        return
    if get_ipython() is not None:
        display(Markdown(f":::{{note}}\n{text}\n:::"))


def with_spread(mean: pd.DataFrame, std: pd.DataFrame, digits: int = 4) -> pd.DataFrame:
    """Each cell as ``mean ± sd`` over the replicates (no spread where the sd is NaN, as with one
    replicate), and "-" where a method has no value."""
    from .toy_study import beside_paper

    return beside_paper(mean, pd.DataFrame(), std, digits).droplevel(1, axis=1)


def beside_scales(paper: pd.DataFrame, scaled: dict[str, tuple[pd.DataFrame, pd.DataFrame | None]],
                  digits: int = 4) -> pd.DataFrame:
    """The paper's table beside ours at several scales, per column: ``(column, "paper")`` then
    ``(column, <scale>)`` for each ``scaled[<scale>] = (mean, std)`` (``std`` None or NaN: no spread shown),
    rows and columns those of the first scale's mean. A cell without a value shows "-"."""
    from .toy_study import beside_paper

    if not scaled:
        raise ValueError("scaled: give at least one scale's (mean, std)")
    first = next(iter(scaled.values()))[0]
    rows = first.index
    theirs = beside_paper(first, paper, None, digits)  # its (column, "paper") cells, formatted as everywhere
    parts = {name: beside_paper(mean.reindex(rows), pd.DataFrame(), None if std is None else std.reindex(rows),
                                digits).droplevel(1, axis=1) for name, (mean, std) in scaled.items()}
    cols = {}
    for column in first.columns:
        if (column, "paper") in theirs.columns:
            cols[(column, "paper")] = theirs[(column, "paper")]
        for name, part in parts.items():
            cols[(column, name)] = part[column] if column in part.columns else "-"
    return pd.DataFrame(cols, index=rows)


def ratio_to_paper(ours: pd.DataFrame, paper: pd.DataFrame) -> pd.DataFrame:
    """Each of our cells over the paper's, on the rows and columns both tables have (``ours``' order):
    1 is the paper's number. NaN where either is missing or the paper's is 0."""
    rows = [r for r in ours.index if r in paper.index]
    columns = [c for c in ours.columns if c in paper.columns]
    theirs = paper.loc[rows, columns].astype(float)
    return ours.loc[rows, columns].astype(float) / theirs.where(theirs != 0)


def paper_scale_choices(run: Results) -> str:
    """The two settings of ours in an MNIST run at the paper scale (``run``: its :class:`Results`), in
    words from its manifest and values: which MAP starts the chains (the rule, the candidates' validation
    losses and the one chosen) and how many validation images the periodic Fisher uses (the paper: all)."""
    config, values = run.config, run.values
    n_val, n_fisher = config["n_val"], config.get("n_fisher_periodic") or config["n_val"]
    seeds = config.get("select_map_from_seeds")
    if seeds and run.has("map_candidates"):
        candidates = run.table("map_candidates")
        losses = ", ".join(f"{int(s)}: {v:.4f}" for s, v in zip(candidates["seed"], candidates["val_loss"],
                                                                    strict=True))
        start = (f"The chains start from the MAP of seed {values['map_seed']}, the lowest validation loss after "
                 f"the last epoch among the seeds {', '.join(map(str, seeds))} ({losses}), a rule fixed before "
                 "any SMP run (the paper names no seed).")
    else:
        start = f"The chains start from the MAP of seed {values['map_seed']} (the paper names no seed)."
    fisher = ("The periodic Fisher is recomputed on all "
              f"{n_val:,} validation images, as in the paper." if n_fisher >= n_val else
              f"The periodic Fisher is recomputed on the first {n_fisher:,} of the {n_val:,} validation images "
              "(the paper: all of them).")
    return f"{start} {fisher}"


def with_paper_scale_rows(beside: pd.DataFrame, run: Results, map_seed: int | None = None) -> pd.DataFrame:
    """The tail chapter's table ``beside`` (rows ``(method, sampler)``; columns NLL, ECE, MI, logit
    variance, accuracy) with one more row per method: the recursion itself at the paper scale (``run``,
    the MNIST chapter's results there: its first replicate, as the tail's runs are), labelled with its
    ``K`` and, when it started from another MAP than the tail's (``map_seed``), with its MAP's seed."""
    columns = {"NLL": ("scores", "nll"), "ECE": ("scores", "ece"), "MI": ("scores", "mutual_info"),
               "logit variance": ("variances", "logits_variance"), "accuracy": ("scores", "accuracy")}
    tables = {name: run.table(name) for name in {t for t, _ in columns.values()}}
    other_map = map_seed is not None and run.values.get("map_seed") != map_seed
    label = (f"recursion at the paper scale (K = {run.config['n_steps']:,}"
             + (f", MAP of seed {run.values.get('map_seed')})" if other_map else ")"))
    rows = []
    for method in beside.index.get_level_values("method").unique():
        rows.append(beside.loc[[method]])
        if method in tables["scores"].index:
            cells = {c: tables[t].loc[method, col] for c, (t, col) in columns.items() if c in beside.columns}
            rows.append(pd.DataFrame([cells], index=pd.MultiIndex.from_tuples([(method, label)],
                                                                               names=beside.index.names)))
    return pd.concat(rows)


def shown(df: pd.DataFrame, digits: int = 3, significant: bool = False) -> pd.DataFrame:
    """``df`` for display: floats rounded to ``digits`` decimals (``significant=True``: to ``digits``
    significant digits), yes/no for booleans, and missing cells (in the index and the column labels too)
    as ``-``."""
    import math

    import numpy as np

    def cell(v):
        if isinstance(v, bool | np.bool_):
            return "yes" if v else "no"
        if isinstance(v, float | np.floating):
            return "-" if math.isnan(v) else (f"{v:.{digits}g}" if significant else round(float(v), digits))
        return "-" if v is None or (isinstance(v, str) and v == "") else v

    def label(v):
        return "-" if isinstance(v, float | np.floating) and math.isnan(v) else v

    out = df.map(cell)
    if isinstance(out.index, pd.MultiIndex):
        out.index = pd.MultiIndex.from_tuples([tuple(label(v) for v in key) for key in out.index],
                                              names=out.index.names)
    else:
        out.index = pd.Index([label(v) for v in out.index], name=out.index.name)
    if not isinstance(out.columns, pd.MultiIndex):
        out.columns = [label(c) for c in out.columns]
    return out


def timings(scale: str, root: str | Path = "results") -> pd.DataFrame:
    """Wall time and machine of every study's results at ``scale``, from their manifests (a study
    without results, or with results of an older format, is left out)."""
    rows = []
    for study in STUDIES:
        folder = Path(root) / scale / study
        try:
            res = Results(folder)
        except FileNotFoundError:
            continue
        if res.manifest.get("format") != FORMAT:
            continue
        env = res.manifest.get("environment", {})
        rows.append({"chapter": study, "minutes": round(res.manifest["wall_time_s"] / 60, 1),
                     "device": env.get("device", ""), "threads": env.get("torch_threads", ""),
                     "note": res.manifest.get("timing_note", "")})
    return pd.DataFrame(rows, columns=["chapter", "minutes", "device", "threads", "note"]).set_index("chapter")


def benchmark_table(path: str | Path, heading: str, index: list[str] | None = None) -> pd.DataFrame | None:
    """The markdown table right after the last line of ``path`` (a benchmark's saved output, such as
    ``benchmarks/gpu_h200.md``) that starts with ``heading`` (blank lines between them allowed), as a
    table of strings indexed by the columns ``index``, with that line in ``attrs["heading"]``; ``None``
    when the file, the heading or a table right after it is missing."""
    path = Path(path)
    if not path.exists():
        return None
    lines = path.read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(heading)]
    if not starts:
        return None
    rows = []
    for line in lines[starts[-1] + 1:]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip()[1:-1].split("|")])
        elif rows or line.strip():
            break
    if len(rows) < 2 or not all(set(cell) <= set("-: ") and cell for cell in rows[1]):
        return None
    table = pd.DataFrame(rows[2:], columns=rows[0])
    table.attrs["heading"] = lines[starts[-1]]
    return table.set_index(index) if index else table


def _numbers(cells: pd.Series) -> pd.Series:
    """A benchmark table's cells (``"16,729"``, say) as numbers, NaN where a cell holds words."""
    return pd.to_numeric(cells.astype(str).str.replace(",", ""), errors="coerce")


def numeric_rows(table: pd.DataFrame | None, column: str) -> pd.DataFrame | None:
    """The rows of a :func:`benchmark_table` whose ``column`` is a number (a whole run left out of a
    budget says so in words instead)."""
    if table is None:
        return None
    keep = _numbers(table[column]).notna()
    return table[keep] if keep.any() else None


def gpu_estimate(scaling: pd.DataFrame, steps: pd.DataFrame) -> str | None:
    """How one GPU's SMP-fixed-diag step with CUDA graphs (``steps``: ``bench_mnist.py``'s step table on a
    GPU, indexed by device, variant and what ran the step, its heading naming S) compares with the most
    processes of ``scaling`` (``bench_scaling.py``, the same variant on this CPU): a sentence, an estimate
    from the two tables and labelled so; ``None`` when a row it needs is missing."""
    found = re.search(r"S = (\d+)", steps.attrs.get("heading", ""))
    try:
        graphs, eager = _numbers(steps.loc[[("cuda", "SMP-fixed-diag", "CUDA graphs"),
                                            ("cuda", "SMP-fixed-diag", "batched torch, one by one")], "ms / step"])
    except KeyError:
        return None
    cpu = _numbers(scaling["chain-steps / s"]).iloc[-1]
    if found is None or pd.isna([graphs, eager, cpu]).any():
        return None
    gpu = int(found.group(1)) / (graphs / 1000)
    return (f"An estimate from these tables and `benchmarks/gpu_h200.md`, not a run: with CUDA graphs one H200 "
            f"steps {found.group(1)} chains of SMP-fixed-diag in {graphs} ms, {gpu:,.0f} chain-steps per second, "
            f"{gpu / cpu:.0f} times the {scaling.index[-1]} processes here. Without the graphs, which take away "
            f"the overhead of launching each kernel, the step takes {eager} ms ({eager / graphs:.1f} times as "
            "long): it is bound by launches more than by arithmetic, so we expect that splitting these chains "
            "over more GPUs would shorten a run little, and that more GPUs pay for more chains or a larger network.")
