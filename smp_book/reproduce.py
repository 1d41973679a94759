"""Recompute every chapter (``make reproduce``) into ``build/reproduce/<scale>/`` and judge each cell of each
table against the committed one; once every study is complete, the new results replace ``results/<scale>/``.
With ``--seed-offset N`` the chapters that take a seed (the toy's data, NUTS and SMP; MNIST's MAP and SMP) run
with their seed moved by ``N`` and without the caches: other random streams, judged against the committed
spread, and a report in ``results/<scale>/reproduction-seed-<N>/`` that never replaces the results.

Each cell is judged by :mod:`smp_book.judge`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import pandas as pd

from .config import PARAMETERS, SCALES, get_config
from .judge import COLUMNS, RUN_COLUMNS, compare_runs, compare_study, counts
from .pipeline import RESULTS, STUDIES, compute, replace, results
from .results import Results


def report(old_root: Path, new_root: Path, scale: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every cell of ``new_root/<scale>`` against ``old_root/<scale>`` (:func:`compare_study`), with its study,
    and what differs between the two runs of each study (:func:`compare_runs`)."""
    pairs = {s: (Results(old_root / scale / s), Results(new_root / scale / s)) for s in STUDIES
             if (new_root / scale / s / "manifest.json").exists() and (old_root / scale / s / "manifest.json").exists()}
    cells = [compare_study(old, new).assign(study=s) for s, (old, new) in pairs.items()]
    return (pd.concat(cells, ignore_index=True) if cells else pd.DataFrame(columns=["study", *COLUMNS]),
            pd.DataFrame([compare_runs(s, *pair) for s, pair in pairs.items()], columns=RUN_COLUMNS))


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
            new = compute(study, args.scale, seed, root=args.work, use_cache=False, progress=True)
            replace(args.work / args.scale / study, new.folder)
        else:
            results(study, args.scale, root=args.work, use_cache=not args.no_cache, progress=True)
    cells, runs = report(RESULTS, args.work, args.scale)
    name = f"reproduction-seed-{args.seed_offset}" if args.seed_offset else "reproduction"
    folder = (RESULTS if args.seed_offset else args.work) / args.scale / name
    if args.seed_offset and (kept := read_report(args.scale, RESULTS, name)) is not None:
        cells = pd.concat([kept[0][~kept[0]["study"].isin(studies)], cells], ignore_index=True)  # the others kept
        runs = pd.concat([kept[2][~kept[2]["study"].isin(studies)], runs], ignore_index=True)
    folder.mkdir(parents=True, exist_ok=True)
    cells.to_csv(folder / "cells.csv", index=False)
    runs.to_csv(folder / "runs.csv", index=False)
    (per_study := counts(cells)).to_csv(folder / "counts.csv")
    print(per_study.to_string(), f"\nreport in {folder}", file=sys.stderr)
    if args.seed_offset or len(studies) < len(STUDIES):
        print("other seeds or a partial run: results/ left as it was", file=sys.stderr)
        return 0
    shutil.rmtree(args.work / args.scale / ".partial", ignore_errors=True)
    for entry in sorted((RESULTS / args.scale).glob("[!.]*")):  # what no study writes: other streams' reports, ...
        if not (args.work / args.scale / entry.name).exists():
            print(f"kept {entry.name}, which no study writes", file=sys.stderr)
            shutil.move(entry, args.work / args.scale / entry.name)
    replace(RESULTS / args.scale, args.work / args.scale)
    print(f"results/{args.scale} replaced by the complete run", file=sys.stderr)
    return 0


def read_report(scale: str, root: str | Path = RESULTS, name: str = "reproduction"
                ) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame] | None:
    """The reproduction report ``name`` saved with ``results/<scale>/``: ``(cells, counts, runs)``, or None."""
    folder = Path(root) / scale / name
    if not (folder / "cells.csv").exists():
        return None
    runs = pd.read_csv(folder / "runs.csv") if (folder / "runs.csv").exists() else pd.DataFrame(columns=RUN_COLUMNS)
    return (cells := pd.read_csv(folder / "cells.csv")), counts(cells), runs


if __name__ == "__main__":
    raise SystemExit(main())
