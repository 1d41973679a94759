"""The paper's own numbers (transcribed from its LaTeX tables), to show beside ours."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

TABLES = ("ex1_scores", "ex1_variances", "ex1_elapsed", "ex2_scores", "ex2_variances", "ex2_elapsed")
_FOLDER = Path(__file__).parent / "paper_tables"


def paper_table(name: str) -> pd.DataFrame:
    """One of the paper's tables as a DataFrame indexed by method (NUTS, SMP-ema-block, ...)."""
    if name not in TABLES:
        raise ValueError(f"unknown paper table {name!r}; choose one of {TABLES}")
    return pd.read_csv(_FOLDER / f"{name}.csv", index_col="method")
