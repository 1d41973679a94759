"""Recompute every chapter's results and compare them with the committed ones.

``python -m smp_book.reproduce --scale laptop`` (``make reproduce SCALE=laptop``) runs each study of
:data:`smp_book.chapters.STUDIES` into ``build/reproduce/<scale>/`` with progress on the terminal. An
interrupted run resumes: a study already complete there with the current code is kept, and the runs
inside a study are cached. Once every study is complete it writes the reproduction report (every
number of every table, the new run beside the committed one, with a verdict per cell) into
``reproduction/`` and only then replaces ``results/<scale>/`` by the new results.

A numeric cell equal to a relative 1e-6 is ``equal``. Otherwise a cell of a table with replicates
(``X_mean`` beside ``X_std`` and ``X_replicates``) is judged by Welch's t-test of the two sets of
replicates: ``within`` its Monte-Carlo spread when the two-sided
p-value is at least :data:`ALPHA`, ``outside`` otherwise (so about ``ALPHA`` of the cells are
``outside`` by chance alone). A cell without spread (one run, or the same value in every replicate)
is ``equal`` to a relative 1e-6 or ``differs``; a table of one replicate (``X`` beside ``X_std``) is
judged as two single draws, ``(new - committed) / sqrt(sd_committed^2 + sd_new^2)`` against a normal
(the sds of the replicates, so a little liberal with few of them); timings are ``timing`` (machine-dependent, not
judged); other cells that are not numbers (a claim's verdict, the best method, a yes/no flag) are
``same`` or ``changed``, free text (criteria, evidence) is ``text``, and a claims table is compared claim
by claim. The two runs share their seeds: where the code moved only rounding their replicates are
correlated and Welch's test is conservative. A recomputation reuses this machine's cached runs of the
same code and settings (``--no-cache`` recomputes them too). Committed results of an older format are
read with the new tables' layouts.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

from .chapters import STUDIES, Results, results
from .config import SCALES

ALPHA = 0.01
REPORT = "reproduction"
VERDICTS = ("within", "outside", "equal", "differs", "same", "changed", "timing", "text", "only committed", "only new")


FREE_TEXT = {"claim", "criterion", "evidence", "note", "notes"}


def _is_timing(table: str, column: str) -> bool:
    words = ("seconds", "wall", "time_s", "elapsed")
    return any(w in table.lower() for w in words) or any(w in str(column).lower() for w in words)


def _is_number(value) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool | np.bool_)


def _keyed(table: pd.DataFrame) -> pd.DataFrame:
    """A table written without its index (a claims table) keyed by its claim, so that a claim added or
    moved is compared with itself, not with the one at its old position."""
    if "claim" in table.columns and table["claim"].is_unique:
        return table.set_index("claim")
    return table


def _replicate_counts(res: Results, base: str) -> pd.DataFrame | None:
    name = f"{base}_replicates"
    if not res.has(name):
        return None
    rep = res.table(name)
    levels = [lvl for lvl in rep.index.names if lvl != "replicate"]
    if not levels or len(levels) == rep.index.nlevels:
        return None
    return rep.groupby(level=levels, sort=False).count()


def _welch_p(m1: float, s1: float, n1: int, m2: float, s2: float, n2: int) -> tuple[float, float]:
    """Welch's t statistic and two-sided p-value for two means with their sample sds and counts."""
    from scipy.stats import ttest_ind_from_stats

    if s1 == 0 and s2 == 0:
        return float("nan"), float("nan")
    test = ttest_ind_from_stats(m2, s2, n2, m1, s1, n1, equal_var=False)
    return float(test.statistic), float(test.pvalue)


def _close(a: float, b: float) -> bool:
    return bool(np.isclose(a, b, rtol=1e-6, atol=1e-12, equal_nan=True))


def compare_study(old: Results, new: Results) -> pd.DataFrame:
    """Every cell of every table of ``new`` beside ``old``, with its verdict (see the module's docstring)."""
    rows = []
    for name in new.tables():
        if name.endswith(("_std", "_replicates")):
            continue  # judged through their _mean table
        base = name.removesuffix("_mean")
        fresh = _keyed(new.table(name))
        committed = _keyed(old.table(name)) if old.has(name) else None
        n_new = _replicate_counts(new, base) if name.endswith("_mean") else None
        n_old = _replicate_counts(old, base) if name.endswith("_mean") else None
        sd_new = new.table(f"{base}_std") if n_new is not None and new.has(f"{base}_std") else None
        sd_old = old.table(f"{base}_std") if n_old is not None and old.has(f"{base}_std") else None
        # one replicate's table (the first), beside the spread of its replicates: two single draws
        single = (not name.endswith("_mean") and new.has(f"{name}_std") and old.has(f"{name}_std")
                  and new.has(f"{name}_replicates"))
        if single:
            sd_new, sd_old = new.table(f"{name}_std"), old.table(f"{name}_std")
            n_new = n_old = sd_new.map(lambda _: 1)
        for row in fresh.index:
            for col in fresh.columns:
                value = fresh.at[row, col]
                entry = {"table": name, "row": str(row), "column": str(col), "new": value, "committed": None,
                         "t": float("nan"), "p": float("nan")}
                if committed is None or row not in committed.index or col not in committed.columns:
                    entry["verdict"] = "only new"
                    rows.append(entry)
                    continue
                before = committed.at[row, col]
                entry["committed"] = before
                numeric = _is_number(value) and _is_number(before)
                if _is_timing(name, col):
                    entry["verdict"] = "timing"
                elif not numeric and str(col).lower() in FREE_TEXT:
                    entry["verdict"] = "text"  # criteria, evidence: quoted numbers, judged through their tables
                elif not numeric:  # verdicts, names of the best method, yes/no flags
                    entry["verdict"] = "same" if str(value) == str(before) else "changed"
                elif _close(float(before), float(value)):
                    entry["verdict"] = "equal"
                elif sd_new is not None and sd_old is not None:
                    try:
                        s1, s2 = float(sd_old.at[row, col]), float(sd_new.at[row, col])
                        n1, n2 = int(n_old.at[row, col]), int(n_new.at[row, col])
                    except (KeyError, ValueError):
                        s1 = s2 = float("nan")
                        n1 = n2 = 1
                    if single and np.isfinite([s1, s2]).all() and s1 + s2 > 0:
                        from scipy.stats import norm

                        entry["t"] = (float(value) - float(before)) / math.hypot(s1, s2)
                        entry["p"] = float(2 * norm.sf(abs(entry["t"])))
                        entry["verdict"] = "within" if entry["p"] >= ALPHA else "outside"
                    elif n1 >= 2 and n2 >= 2 and np.isfinite([s1, s2]).all() and s1 + s2 > 0:
                        entry["t"], entry["p"] = _welch_p(float(before), s1, n1, float(value), s2, n2)
                        entry["verdict"] = "within" if entry["p"] >= ALPHA else "outside"
                    else:
                        entry["verdict"] = "equal" if _close(float(before), float(value)) else "differs"
                else:
                    entry["verdict"] = "equal" if _close(float(before), float(value)) else "differs"
                rows.append(entry)
        if committed is not None:
            for row in committed.index:
                for col in committed.columns:
                    if row not in fresh.index or col not in fresh.columns:
                        rows.append({"table": name, "row": str(row), "column": str(col), "new": None,
                                     "committed": committed.at[row, col], "t": float("nan"), "p": float("nan"),
                                     "verdict": "only committed"})
    return pd.DataFrame(rows, columns=["table", "row", "column", "committed", "new", "t", "p", "verdict"])


def report(old_root: Path, new_root: Path, scale: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The reproduction report of ``new_root/<scale>`` against ``old_root/<scale>``: every cell, and the
    count of each verdict per study."""
    cells = []
    for study in STUDIES:
        new_folder, old_folder = new_root / scale / study, old_root / scale / study
        if not (new_folder / "manifest.json").exists():
            continue
        if not (old_folder / "manifest.json").exists():
            cells.append(pd.DataFrame([{"study": study, "table": "", "row": "", "column": "",
                                        "verdict": "only new"}]))
            continue
        new = Results(new_folder)
        old = Results(old_folder)
        if "tables" not in old.manifest:  # an older format: its CSVs read with the new tables' layouts
            old.manifest["tables"] = {name: layout for name, layout in new.manifest["tables"].items()
                                      if (old_folder / f"{name}.csv").exists()}
        cells.append(compare_study(old, new).assign(study=study))
    table = pd.concat(cells, ignore_index=True) if cells else pd.DataFrame(columns=["study", "verdict"])
    table = table[["study"] + [c for c in table.columns if c != "study"]]
    counts = table.groupby(["study", "verdict"], sort=False).size().unstack(fill_value=0)
    counts = counts.reindex(columns=[v for v in VERDICTS if v in counts.columns]).reindex(
        [s for s in STUDIES if s in counts.index])
    # which results the report judged, so that a study recomputed since is marked (read_report)
    counts["results_id"] = [Results(new_root / scale / s).manifest.get("id") for s in counts.index]
    return table, counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", required=True, choices=SCALES)
    parser.add_argument("--only", default="", help="comma-separated studies (default: all; a partial run "
                        "writes its report but never replaces results/)")
    parser.add_argument("--results", default="results", help="the committed results' root (default: results)")
    parser.add_argument("--work", default="build/reproduce", help="where the new results are built")
    parser.add_argument("--no-cache", action="store_true", help="recompute the cached runs too")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's threads (default: torch's own choice); on a machine shared with other "
                             "work, 1 thread per free core avoids threads that wait on each other")
    args = parser.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads: must be at least 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    studies = [s for s in args.only.split(",") if s] or list(STUDIES)
    unknown = [s for s in studies if s not in STUDIES]
    if unknown:
        parser.error(f"--only: unknown studies {unknown}; known: {', '.join(STUDIES)}")
    work, committed = Path(args.work), Path(args.results)
    started = time.perf_counter()
    for i, study in enumerate(studies, 1):
        print(f"[{i}/{len(studies)}] {study} at scale {args.scale}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        results(study, args.scale, root=work, use_cache=not args.no_cache, progress=True, code=True)
        print(f"    done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    cells, counts = report(committed, work, args.scale)
    folder = work / args.scale / REPORT
    folder.mkdir(parents=True, exist_ok=True)
    cells.to_csv(folder / "cells.csv", index=False)
    counts.to_csv(folder / "counts.csv")
    judged = int(counts.get("within", pd.Series(dtype=int)).sum() + counts.get("outside", pd.Series(dtype=int)).sum())
    print(counts.to_string(), file=sys.stderr)
    print(f"{judged} cells judged by their spread; were the two runs' replicates independent, about "
          f"{ALPHA * judged:.1f} would fall outside by chance alone (alpha = {ALPHA}; runs that share seeds "
          f"are correlated, which makes the test conservative); report in {folder}", file=sys.stderr)
    if len(studies) == len(STUDIES):
        target = committed / args.scale
        target.parent.mkdir(parents=True, exist_ok=True)
        old = target.with_name(f".{args.scale}.old")
        if old.exists() and not target.exists():  # an earlier run stopped between its two moves
            old.rename(target)
        if old.exists():
            shutil.rmtree(old)
        if target.exists():
            target.rename(old)
        shutil.rmtree(work / args.scale / ".partial", ignore_errors=True)
        shutil.move(work / args.scale, target)
        if old.exists():
            shutil.rmtree(old)
        print(f"results/{args.scale} replaced by the complete run ({time.perf_counter() - started:.0f} s)",
              file=sys.stderr)
    else:
        print("a partial run (--only): results/ left as it was", file=sys.stderr)
    return 0


def read_report(scale: str, root: str | Path = "results") -> tuple[pd.DataFrame, pd.DataFrame] | None:
    """The reproduction report saved with ``results/<scale>/``: ``(cells, counts)``, or None."""
    folder = Path(root) / scale / REPORT
    if not (folder / "counts.csv").exists():
        return None
    counts = pd.read_csv(folder / "counts.csv", index_col="study")
    if "results_id" in counts:  # a study recomputed after the report no longer holds the numbers it judged
        current = []
        for study in counts.index:
            try:
                current.append(Results(Path(root) / scale / study).manifest.get("id"))
            except FileNotFoundError:
                current.append(None)
        counts["judged these results"] = ["yes" if a == b else "no (recomputed since)"
                                          for a, b in zip(counts.pop("results_id"), current, strict=True)]
    return pd.read_csv(folder / "cells.csv"), counts


if __name__ == "__main__":
    raise SystemExit(main())
