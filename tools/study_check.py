"""Bitwise check for a refactor of the book's studies: compute them at a scale without caches, at the old
revision and at the new one, and compare every table, value and figure but the timings.

    python tools/study_check.py capture before toy,toy_kfac      # at the old revision (a git worktree)
    python tools/study_check.py capture after toy,toy_kfac       # at the new one
    python tools/study_check.py compare before after             # the studies captured in after

Each capture runs in its own process at one thread and writes ``<name>/<scale>/<study>/``; both captures on
the same machine, since rounding differs between CPUs. A difference is printed as study, file and column.
"""

import json
import sys
from pathlib import Path

import pandas as pd

from smp_book import judge

# the reproduction report's timing words, and names of wall-clock values written into the studies' values
TIMING = (*judge.TIMING, "time_ratio", "_s_per", "minutes", "hours")


def _timing(name: str) -> bool:
    return any(word in name.lower() for word in TIMING)


def capture(out: Path, studies: list[str], scale: str) -> None:
    import torch

    torch.set_num_threads(1)
    from smp_book import pipeline

    for study in studies:
        print(f"{study} at {scale}", file=sys.stderr, flush=True)
        pipeline.compute(study, scale, root=out.resolve(), use_cache=False)


def compare(before: Path, after: Path) -> int:
    """Every study captured in ``after`` against the same study in ``before``: its tables, values and figures."""
    differences, captured = 0, sorted(p.parent for p in after.rglob("manifest.json"))
    if not captured:
        print(f"nothing captured in {after}: did the capture fail?")
        return 1
    for other in captured:
        folder, name = before / other.relative_to(after), other.relative_to(after)
        if not (folder / "manifest.json").exists():
            print(f"{name}: missing in {before}")
            differences += 1
            continue
        files = {p.relative_to(f) for f in (folder, other) for p in f.rglob("*.csv") if not _timing(p.stem)}
        for csv in sorted(files):  # a table of timings is skipped
            if not ((folder / csv).exists() and (other / csv).exists()):
                print(f"{name}/{csv}: only in {before if (folder / csv).exists() else after}")
                differences += 1
                continue
            old, new = (pd.read_csv(f / csv, dtype=str) for f in (folder, other))
            keep = [c for c in old.columns if not _timing(c)]
            if list(old.columns) != list(new.columns) or not old[keep].equals(new[keep]):
                print(f"{name}/{csv}: differs in "
                      f"{[c for c in keep if c not in new or not old[c].equals(new[c])] or 'its columns'}")
                differences += 1
        for png in sorted({p.relative_to(f) for f in (folder, other) for p in f.rglob("*.png")}):
            if not ((folder / png).exists() and (other / png).exists()) or \
                    (folder / png).read_bytes() != (other / png).read_bytes():
                print(f"{name}/{png}: differs (or is only on one side)")
                differences += 1
        old, new = (json.loads((f / "values.json").read_text()) for f in (folder, other))
        moved = sorted(k for k in old.keys() | new.keys() if not _timing(k) and old.get(k) != new.get(k))
        if moved:
            print(f"{name}/values.json: differs in {moved}")
            differences += 1
    print("equal" if not differences else f"{differences} files differ")
    return int(differences > 0)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "capture":
        capture(Path(args[0]), args[1].split(","), args[2] if len(args) > 2 else "ci")
    elif command == "compare":
        raise SystemExit(compare(Path(args[0]), Path(args[1])))
    else:
        raise SystemExit(__doc__)
