"""Transcribe the paper's six result tables (LaTeX) into CSV files shipped with smp_core.

Usage: .venv/bin/python tools/transcribe_paper_tables.py [../shared/paper/tables]
Source: the paper's LaTeX tables (tables/ex1_*.tex, tables/ex2_*.tex), copied verbatim as numbers.
"""

import csv
import sys
from pathlib import Path

COLUMNS = {
    "Accuracy": "accuracy", "Brier": "brier", "NLL": "nll", "ECE": "ece", "Pred entropy": "pred_entropy",
    "Exp entropy": "exp_entropy", "Mutual info": "mutual_info", "Epistemic std": "epistemic_std",
    "Params variance": "params_variance", "Logits variance": "logits_variance", "Elapsed time": "seconds",
}


def parse(tex: str):
    body = tex.split("\\midrule")[1].split("\\bottomrule")[0]
    header = tex.split("\\toprule")[1].split("\\midrule")[0]
    names = [COLUMNS[c.strip().rstrip("\\").strip()] for c in header.split("&")[1:]]
    rows = []
    for line in body.strip().splitlines():
        cells = [c.strip().rstrip("\\").strip() for c in line.split("&")]
        rows.append([cells[0]] + cells[1:])
    return ["method"] + names, rows


def main():
    src = Path(sys.argv[1] if len(sys.argv) > 1 else "../shared/paper/tables")
    out = Path(__file__).resolve().parents[1] / "smp_core" / "paper_tables"
    for tex in sorted(src.glob("ex*.tex")):
        header, rows = parse(tex.read_text())
        with open(out / f"{tex.stem}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(header)
            w.writerows(rows)
        print(tex.name, "->", out / f"{tex.stem}.csv", len(rows), "rows")


if __name__ == "__main__":
    main()
