"""How a rerun's numbers are judged against the committed ones (``make reproduce``, the reproduction page).

Numbers equal to a relative 1e-6 are ``equal``; with replicates (``X_mean`` beside ``X_std`` and
``X_replicates``) a cell is ``within`` or ``outside`` its spread by Welch's test at level :data:`ALPHA` (one
replicate's table beside ``X_std``: two single draws); other numbers ``equal`` or ``differs``; timings are not
judged; verdicts and flags are ``same`` or ``changed``; criteria and evidence, and numbers formatted for a page
(``X ± s``, tables named ``*_shown``: their numbers are judged where they come from), are ``text``.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.stats import norm, ttest_ind_from_stats
from scipy.stats import t as student

from .pipeline import RESULTS, STUDIES
from .results import Results

ALPHA = 0.01
TIMING = ("seconds", "wall", "time_s", "elapsed")  # a table or column of timings holds one of these
COLUMNS = ["table", "row", "column", "committed", "new", "p", "verdict"]
VERDICTS = ("within", "outside", "equal", "differs", "same", "changed", "timing", "text", "only committed", "only new")


def spread(res: Results, name: str) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    """``(sd, n)`` of table ``name``'s cells over the replicates (``n = 1``: one replicate's table), or ``None``."""
    base = name.removesuffix("_mean")
    if not (res.has(f"{base}_std") and res.has(f"{base}_replicates")):
        return None
    sd = res.table(f"{base}_std")
    if base == name:
        return sd, sd.map(lambda _: 1)
    rep = res.table(f"{base}_replicates")
    return sd, rep.groupby(level=[n for n in rep.index.names if n != "replicate"], sort=False).count()


def judge(table: str, column: str, old, new, old_spread, new_spread) -> tuple[str, float]:
    """The verdict on one cell, ``committed`` then ``new`` with their :func:`spread` (see the module), and its p."""
    number = (int, float, np.integer, np.floating)
    if any(w in f"{table} {column}".lower() for w in TIMING):
        return "timing", math.nan
    if table.endswith("_shown") or any("±" in str(v) for v in (old, new)):  # numbers formatted for a page:
        return "text", math.nan  # they are judged in the tables they were formatted from
    if not (isinstance(old, number) and isinstance(new, number)) or isinstance(old, bool | np.bool_):
        return ("text" if column.lower() in ("claim", "criterion", "evidence", "note", "notes")
                else "same" if str(old) == str(new) else "changed"), math.nan
    if np.isclose(old, new, rtol=1e-6, atol=1e-12, equal_nan=True):
        return "equal", math.nan
    if old_spread is None or new_spread is None:
        return "differs", math.nan
    (s1, n1), (s2, n2) = old_spread, new_spread
    if not (np.isfinite([s1, s2]).all() and s1 + s2 > 0):
        return "differs", math.nan
    if n1 == 1 and n2 == 1:
        p = float(2 * norm.sf(abs(new - old) / math.hypot(s1, s2)))
    elif n1 >= 2 and n2 >= 2:
        p = float(ttest_ind_from_stats(new, s2, n2, old, s1, n1, equal_var=False).pvalue)
    else:
        return "differs", math.nan
    return ("within" if p >= ALPHA else "outside"), p


def compare_study(old: Results, new: Results) -> pd.DataFrame:
    """Every cell of every table of ``new`` beside ``old``, with its verdict (see the module's docstring)."""
    rows = []
    for name in new.tables():
        if name.endswith(("_std", "_replicates")):
            continue
        fresh, committed = [t.set_index("claim") if "claim" in t.columns and t["claim"].is_unique else t
                            for t in (new.table(name), old.table(name) if old.has(name) else pd.DataFrame())]
        spreads = [spread(res, name) for res in (old, new)]
        for row in fresh.index:
            for col in fresh.columns:
                entry = {"table": name, "row": str(row), "column": str(col), "new": fresh.at[row, col],
                         "committed": None, "p": math.nan, "verdict": "only new"}
                if row in committed.index and col in committed.columns:
                    entry["committed"] = committed.at[row, col]
                    cell = [None if s is None or row not in s[0].index or col not in s[0].columns
                            else (float(s[0].at[row, col]), int(s[1].at[row, col])) for s in spreads]
                    entry["verdict"], entry["p"] = judge(name, str(col), entry["committed"], entry["new"], *cell)
                rows.append(entry)
        rows += [{"table": name, "row": str(row), "column": str(col), "committed": committed.at[row, col],
                  "verdict": "only committed"} for row in committed.index for col in committed.columns
                 if row not in fresh.index or col not in fresh.columns]
    return pd.DataFrame(rows, columns=COLUMNS)


RUN_COLUMNS = ["study", "code", "settings", "seeds", "committed threads", "new threads", "committed machine",
               "new machine", "committed git", "new git"]


def _same(old, new) -> str:
    """``same``; ``added`` where ``new`` only records keys (at any depth of its dicts) that ``old`` lacks; else
    ``changed``; ``unknown`` where either run does not record it."""
    if old is None or new is None:
        return "unknown"
    if old == new:
        return "same"
    if isinstance(old, dict) and isinstance(new, dict) and old.keys() <= new.keys():
        return "added" if all(_same(old[k], new[k]) != "changed" for k in old) else "changed"
    return "changed"


def compare_runs(study: str, old: Results, new: Results) -> dict:
    """What differs between the two runs of ``study`` whose cells are compared, from their manifests: the code,
    settings and seeds (``same``, ``changed``, or ``added`` where the new run records more settings and the same
    values for the others), the machine and thread count, the git revision."""
    env = [r.manifest.get("environment", {}) for r in (old, new)]
    same = [_same(old.manifest.get(k), new.manifest.get(k)) for k in ("code", "config", "seeds")]
    machines = [f"{e.get('cpu_model', '?')} ({e.get('cpu_count', '?')} cores)" for e in env]
    gits = [str(r.manifest.get("git", "?"))[:12] for r in (old, new)]
    return dict(zip(RUN_COLUMNS, [study, *same, *(e.get("torch_threads") for e in env), *machines, *gits], strict=True))


def counts(cells: pd.DataFrame) -> pd.DataFrame:
    """The number of cells of each verdict, per study."""
    table = cells.groupby(["study", "verdict"], sort=False).size().unstack(fill_value=0)
    order = sorted(table.index, key=lambda s: list(STUDIES).index(s) if s in STUDIES else len(STUDIES))
    return table.reindex(index=order, columns=[v for v in VERDICTS if v in table.columns])


def judge_by_map_seeds(cells: pd.DataFrame, scale: str, root: str | Path = RESULTS) -> pd.DataFrame:
    """The MNIST ``X_mean`` cells of a rerun from another MAP (other streams, or the MAP trained again elsewhere)
    that the MAP-seeds chapter has a spread for, judged against it: its ``X_std`` is the sd of that very mean over
    MAPs, so two such means differ with sd ``sqrt(2) X_std`` (``n_maps - 1`` degrees of freedom): Student's t at
    level ``ALPHA``, giving ``p`` and ``verdict`` (``within`` / ``outside`` / ``equal``, or ``differs`` without a
    spread)."""
    seeds = Results(Path(root) / scale / "mnist_seeds")
    mnist = cells[(cells["study"] == "mnist") & cells["table"].str.endswith("_mean") & (cells["verdict"] != "timing")]
    spreads = {table: spread(seeds, table) for table in mnist["table"].unique()}  # (sd, n maps) or None
    columns, rows = ["table", "row", "column", "committed", "new", "sd_maps", "n_maps", "p", "verdict"], []
    for table, row, column, committed, new in mnist[columns[:5]].itertuples(index=False):
        found = spreads[table]
        if found is None or row not in found[0].index.astype(str) or column not in found[0].columns:
            continue
        sd, n_maps = (part.set_axis(part.index.astype(str)).at[row, column] for part in found)
        sd, n_maps, old, fresh = float(sd), int(n_maps), float(committed), float(new)
        if np.isclose(old, fresh, rtol=1e-6, atol=1e-12, equal_nan=True):
            p, verdict = math.nan, "equal"
        elif not (np.isfinite(sd) and sd > 0):
            p, verdict = math.nan, "differs"
        else:
            p = float(2 * student.sf(abs(fresh - old) / (math.sqrt(2) * sd), df=n_maps - 1))
            verdict = "within" if p >= ALPHA else "outside"
        rows.append((table, row, column, old, fresh, sd, n_maps, p, verdict))
    return pd.DataFrame(rows, columns=columns)
