"""The conclusions of Section 3.3.4 judged per MAP on replicate means, for the MAP-seeds chapter (the
paper's claims themselves are judged once, in :mod:`smp_book.register`)."""

from __future__ import annotations

from collections import Counter

import pandas as pd

DIAGONAL = ("SMP-fixed-diag", "SMP-ema-diag", "SMP-periodic-diag")
FIXED, EMA, PERIODIC = DIAGONAL
COLUMNS = ["claim", "criterion", "verdict", "evidence"]


def _verdict(flags: list[bool]) -> str:
    return "holds" if all(flags) else "partly" if any(flags) else "does not hold"


def verdict_counts(verdicts) -> str:
    """``["holds", "does not hold", "holds"]`` -> ``"holds 2, does not hold 1"`` (most frequent first)."""
    return ", ".join(f"{v} {n}" for v, n in Counter(verdicts).most_common())


def claims(scores: pd.DataFrame, variances: pd.DataFrame,
           replicates: list[tuple[pd.DataFrame, pd.DataFrame]] | None = None) -> pd.DataFrame:
    """The conclusions of Section 3.3.4, judged by stated criteria on ``scores`` and ``variances`` (with
    replicates, their means). ``replicates``, ``(scores, variances)`` of single runs, adds the column
    ``replicates``: the verdicts each run alone gets (:func:`verdict_counts`)."""
    table = _claims(scores, variances)
    if replicates:
        per_run = [_claims(s, v)["verdict"].tolist() for s, v in replicates]
        table["replicates"] = [verdict_counts(col) for col in zip(*per_run, strict=True)]
    return table


def _claims(s: pd.DataFrame, v: pd.DataFrame) -> pd.DataFrame:
    acc_gap = abs(s.loc["SMP-none", "accuracy"] - s.loc["MAP", "accuracy"])
    nll_gap = abs(s.loc["SMP-none", "nll"] - s.loc["MAP", "nll"])
    mi, std = s.loc["SMP-none", "mutual_info"], s.loc["SMP-none", "epistemic_std"]
    over = [s.loc[d, "mutual_info"] > 10 * max(mi, 1e-6) and s.loc[d, "nll"] > s.loc["MAP", "nll"] for d in DIAGONAL]
    least = min(DIAGONAL, key=lambda d: s.loc[d, "mutual_info"])
    big = [v.loc[d, "params_variance"] < 1e-3 and v.loc[d, "logits_variance"] > 1.0 for d in DIAGONAL]
    return pd.DataFrame([
        ["SMP-none predicts like MAP (same accuracy, Brier, NLL, ECE)",
         "accuracy within 0.002 and NLL within 0.005 of MAP",
         "holds" if acc_gap <= 0.002 and nll_gap <= 0.005 else ("partly" if acc_gap <= 0.005 else "does not hold"),
         f"accuracy {s.loc['SMP-none', 'accuracy']:.4f} vs {s.loc['MAP', 'accuracy']:.4f}; NLL "
         f"{s.loc['SMP-none', 'nll']:.4f} vs {s.loc['MAP', 'nll']:.4f}"],
        ["SMP-none collapses to a point estimate (tiny MI and epistemic std)", "MI < 0.005 and epistemic std < 0.005",
         _verdict([mi < 0.005 and std < 0.005]), f"MI {mi:.5f}, epistemic std {std:.5f}"],
        ["The diagonal variants over-disperse: much larger MI and worse NLL than MAP and SMP-none",
         "for each diagonal variant MI > 10x SMP-none's and NLL > MAP's (partly: some of them)", _verdict(over),
         "; ".join(f"{d}: MI {s.loc[d, 'mutual_info']:.4f}, NLL {s.loc[d, 'nll']:.4f}" for d in DIAGONAL)],
        ["Periodic recomputation over-disperses least among the diagonal variants",
         "SMP-periodic-diag has the smallest MI of the three", _verdict([least == PERIODIC]),
         f"smallest MI: {least}"],
        ["Diagonal variants: tiny parameter variance (< 1e-3) but large logit variance (> 1)",
         "both, for each diagonal variant (partly: some)", _verdict(big),
         "; ".join(f"{d}: params {v.loc[d, 'params_variance']:.2e}, logits {v.loc[d, 'logits_variance']:.3f}"
                   for d in DIAGONAL)]], columns=COLUMNS)
