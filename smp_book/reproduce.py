"""Recompute every chapter (``make reproduce``) into ``build/reproduce/<scale>/`` and judge each cell of each
table against the committed one; once every study is complete, the new results replace ``results/<scale>/``.
With ``--seed-offset N`` the chapters that take a seed (the toy's data, NUTS and SMP; MNIST's MAP and SMP) run
with their seed moved by ``N`` and without the caches: other random streams, judged against the committed
spread, and a report in ``results/<scale>/reproduction-seed-<N>/`` that never replaces the results.

Numbers equal to a relative 1e-6 are ``equal``; with replicates (``X_mean`` beside ``X_std`` and
``X_replicates``) a cell is ``within`` or ``outside`` its spread by Welch's test at level :data:`ALPHA` (one
replicate's table beside ``X_std``: two single draws); other numbers ``equal`` or ``differs``; timings are not
judged; verdicts and flags are ``same`` or ``changed``; criteria and evidence, and numbers formatted for a page
(``X ± s``, tables named ``*_shown``: their numbers are judged where they come from), are ``text``.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from .config import PARAMETERS, SCALES, get_config
from .pipeline import RESULTS, STUDIES, compute, results
from .results import Results

ALPHA = 0.01
TIMING = ("seconds", "wall", "time_s", "elapsed")  # a table or column of timings holds one of these
COLUMNS = ["table", "row", "column", "committed", "new", "p", "verdict"]
VERDICTS = ("within", "outside", "equal", "differs", "same", "changed", "timing", "text", "only committed", "only new")


def _spread(res: Results, name: str) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    """``(sd, n)`` of table ``name``'s cells over the replicates (``n = 1``: one replicate's table), or ``None``."""
    base = name.removesuffix("_mean")
    if not (res.has(f"{base}_std") and res.has(f"{base}_replicates")):
        return None
    sd = res.table(f"{base}_std")
    if base == name:
        return sd, sd.map(lambda _: 1)
    rep = res.table(f"{base}_replicates")
    return sd, rep.groupby(level=[n for n in rep.index.names if n != "replicate"], sort=False).count()


def _judge(table: str, column: str, old, new, old_spread, new_spread) -> tuple[str, float]:
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
        from scipy.stats import norm

        p = float(2 * norm.sf(abs(new - old) / math.hypot(s1, s2)))
    elif n1 >= 2 and n2 >= 2:
        from scipy.stats import ttest_ind_from_stats

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
        keyed = [t.set_index("claim") if "claim" in t.columns and t["claim"].is_unique else t
                 for t in (new.table(name), old.table(name) if old.has(name) else pd.DataFrame())]
        fresh, committed = keyed
        spreads = [_spread(res, name) for res in (old, new)]
        for row in fresh.index:
            for col in fresh.columns:
                entry = {"table": name, "row": str(row), "column": str(col), "new": fresh.at[row, col],
                         "committed": None, "p": math.nan, "verdict": "only new"}
                if row in committed.index and col in committed.columns:
                    entry["committed"] = committed.at[row, col]
                    cell = [None if s is None or row not in s[0].index or col not in s[0].columns
                            else (float(s[0].at[row, col]), int(s[1].at[row, col])) for s in spreads]
                    entry["verdict"], entry["p"] = _judge(name, str(col), entry["committed"], entry["new"], *cell)
                rows.append(entry)
        rows += [{"table": name, "row": str(row), "column": str(col), "committed": committed.at[row, col],
                  "verdict": "only committed"} for row in committed.index for col in committed.columns
                 if row not in fresh.index or col not in fresh.columns]
    return pd.DataFrame(rows, columns=COLUMNS)


def report(old_root: Path, new_root: Path, scale: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every cell of ``new_root/<scale>`` against ``old_root/<scale>``, and the count of each verdict per study."""
    cells = [compare_study(Results(old_root / scale / s), Results(new_root / scale / s)).assign(study=s)
             for s in STUDIES if (new_root / scale / s / "manifest.json").exists()
             and (old_root / scale / s / "manifest.json").exists()]
    table = pd.concat(cells, ignore_index=True) if cells else pd.DataFrame(columns=["study", *COLUMNS])
    counts = table.groupby(["study", "verdict"], sort=False).size().unstack(fill_value=0)
    return table, counts.reindex(columns=[v for v in VERDICTS if v in counts.columns])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", required=True, choices=SCALES)
    parser.add_argument("--only", default="", help="comma-separated studies (a partial run never replaces results/)")
    parser.add_argument("--work", type=Path, default=Path("build/reproduce"), help="where the new results go")
    parser.add_argument("--no-cache", action="store_true", help="recompute the cached runs too")
    parser.add_argument("--threads", type=int, default=None, help="torch's threads (1 per free core when shared)")
    parser.add_argument("--seed-offset", type=int, default=0, help="other random streams (the chapters with a seed)")
    args = parser.parse_args(argv)
    seeded = [s for s in STUDIES if "seed" in PARAMETERS.get(s, {})]
    studies = [s for s in args.only.split(",") if s] or (seeded if args.seed_offset else list(STUDIES))
    if unknown := [s for s in studies if s not in STUDIES]:
        parser.error(f"--only: unknown studies {unknown}; known: {', '.join(STUDIES)}")
    if args.seed_offset and (args.seed_offset < 0 or set(studies) - set(seeded)):
        parser.error(f"--seed-offset: a positive offset, for the chapters with a seed only ({', '.join(seeded)})")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads: must be at least 1, got {args.threads}")
    if args.threads is not None:
        __import__("torch").set_num_threads(args.threads)
    for i, study in enumerate(studies, 1):
        print(f"[{i}/{len(studies)}] {study} at scale {args.scale}", file=sys.stderr, flush=True)
        if args.seed_offset:  # into <work>/<scale>/<study>, where the report looks
            seed = {"seed": get_config(study, args.scale)["seed"] + args.seed_offset}
            shutil.rmtree(args.work / args.scale / study, ignore_errors=True)
            (args.work / args.scale).mkdir(parents=True, exist_ok=True)
            compute(study, args.scale, seed, root=args.work, use_cache=False, progress=True).folder.rename(
                args.work / args.scale / study)
        else:
            results(study, args.scale, root=args.work, use_cache=not args.no_cache, progress=True)
    cells, counts = report(RESULTS, args.work, args.scale)
    name = f"reproduction-seed-{args.seed_offset}" if args.seed_offset else "reproduction"
    folder = (RESULTS if args.seed_offset else args.work) / args.scale / name
    if args.seed_offset and (kept := read_report(args.scale, RESULTS, name)) is not None:
        cells, counts = keep_others(kept, (cells, counts), studies)
    folder.mkdir(parents=True, exist_ok=True)
    cells.to_csv(folder / "cells.csv", index=False)
    counts.to_csv(folder / "counts.csv")
    print(counts.to_string(), f"\nreport in {folder}", file=sys.stderr)
    if args.seed_offset or len(studies) < len(STUDIES):
        print("other seeds or a partial run: results/ left as it was", file=sys.stderr)
        return 0
    target, old = RESULTS / args.scale, RESULTS / f".{args.scale}.old"
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        target.rename(old)
    shutil.rmtree(args.work / args.scale / ".partial", ignore_errors=True)
    shutil.move(args.work / args.scale, target)
    shutil.rmtree(old, ignore_errors=True)
    print(f"results/{args.scale} replaced by the complete run", file=sys.stderr)
    return 0


def keep_others(kept: tuple[pd.DataFrame, pd.DataFrame], fresh: tuple[pd.DataFrame, pd.DataFrame],
                studies: list[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A report whose rows of ``studies`` are ``fresh``'s and whose other studies' rows are ``kept``'s: a rerun
    of some chapters replaces their part of a saved report and leaves the rest as it was."""
    (old_cells, old_counts), (cells, counts) = kept, fresh
    cells = pd.concat([old_cells[~old_cells["study"].isin(studies)], cells], ignore_index=True)
    counts = pd.concat([old_counts.drop(index=studies, errors="ignore"), counts]).fillna(0).astype(int)
    order = sorted(counts.index, key=lambda s: list(STUDIES).index(s) if s in STUDIES else len(STUDIES))
    return cells, counts.reindex(index=order, columns=[v for v in VERDICTS if v in counts.columns])


def read_report(scale: str, root: str | Path = RESULTS, name: str = "reproduction"
                ) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    """The reproduction report ``name`` saved with ``results/<scale>/``: ``(cells, counts)``, or None."""
    folder = Path(root) / scale / name
    if not (folder / "counts.csv").exists():
        return None
    counts = pd.read_csv(folder / "counts.csv", index_col="study").drop(columns="results_id", errors="ignore")
    return pd.read_csv(folder / "cells.csv"), counts


if __name__ == "__main__":
    raise SystemExit(main())
