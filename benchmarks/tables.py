"""Benchmark tables printed as Markdown on the terminal and, with ``--csv DIR``, saved as CSV for the book.

    out = Tables(args.csv)
    out.start("steps", "SMP step, LeNet-5, S = 100", ["device", "variant", "ms / step"])
    out.row("cpu", "SMP-none", 2.64)
    out.save()   # DIR/steps.csv, and DIR/headings.json: each table's heading line and the machine line

A cell is printed as given (numbers formatted by the caller as strings keep their format in the CSV too).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path


class Tables:
    def __init__(self, folder: str | Path | None, machine: str = ""):
        self.folder, self.machine, self.tables, self.current = folder, machine, {}, None

    def start(self, name: str, heading: str, columns: list[str]) -> None:
        print(f"\n{heading}\n\n| {' | '.join(columns)} |\n|{'---|' * len(columns)}", flush=True)
        self.tables[name] = {"heading": heading, "columns": columns, "rows": []}
        self.current = name

    def row(self, *cells) -> None:
        print(f"| {' | '.join(str(c) for c in cells)} |", flush=True)
        self.tables[self.current]["rows"].append(list(cells))

    def save(self) -> None:
        if self.folder is None:
            return
        folder = Path(self.folder)
        folder.mkdir(parents=True, exist_ok=True)
        for name, table in self.tables.items():
            with open(folder / f"{name}.csv", "w", newline="") as f:
                writer = csv.writer(f)
                writer.writerow(table["columns"])
                writer.writerows(table["rows"])
        headings = {name: table["heading"] for name, table in self.tables.items()}
        (folder / "headings.json").write_text(json.dumps({"machine": self.machine, **headings}, indent=2) + "\n")
